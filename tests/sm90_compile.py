"""Compile the rejection sampler's launches for an H100 / H200 (sm_90) on a machine
without a GPU: Triton's NVIDIA backend and its bundled ptxas run on the CPU once the
active driver reports a target. Nothing is launched. The interpreter accepts programs
the GPU compiler rejects (stop 23: an MLIR dominance failure in a multi-row cut tile
with float32 logits), so the CPU suite compiles them too.

    TRITON_INTERPRET=0 python -m tests.sm90_compile [--cases V,B,K ...] [--dtypes ...]
        [--sass] [--decode]

Prints one line per launch; exits 1 if any launch fails to compile. --sass adds each
kernel's SASS instruction count (nvdisasm), its local-memory loads and stores (register
spills), its most frequent opcodes and the instructions in each of its loops: a
device-free look at a kernel's cost. --decode
also compiles the fused decode path's launches with programmatic dependent launch (and
`--cases` with no value skips the sampler). Run it in
a process of its own: it replaces Triton's active driver.

SASS figures are the installed Triton's. For a figure that is to guide a change on the
device, compile with the device's version (triton 3.6 on the lent H100 / H200): another
version can lay the same source out differently (stop 54: the rows kernels compiled to
21-61 bar.sync with triton 3.9 and to one with 3.6). A CPU machine can hold it beside its
own: `pip download --no-deps triton==3.6.0`, `pip install --no-deps --target DIR` on the
wheel, then run this module with `PYTHONPATH=DIR:.`."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before any @triton.jit function is created

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from tests.sass import sass_summary  # noqa: E402


class _Sm90Driver:
    """What Triton's JIT asks of the active driver to compile (warmup), nothing more."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def launches(v: int, b: int, k: int, dtype: torch.dtype, sampled: bool, config=None) -> list[tuple]:
    """The launches rejection_sample would make for this shape (the GPU's tile choice, or
    `config`), with every sampling mode in the batch when sampled."""
    import kernels.rejection as kr
    from specdraft.sampling import SamplingParams as SP
    from specdraft.sampling import SamplingTensors

    kinds = [SP(0.0), SP(1.0), SP(0.7, top_k=5), SP(1.3, top_p=0.8), SP(0.5, top_k=9, top_p=0.6)]
    kinds = kinds if sampled else kinds[:1]
    ws = kr.RejectionWorkspace.allocate(b, k, v, "cpu", config)
    st = SamplingTensors.from_params([kinds[i % len(kinds)] for i in range(b)], "cpu")
    q = torch.softmax(torch.randn(b, k, v), -1) if sampled else None
    outs = (torch.empty(b, k + 1, dtype=torch.int64), torch.empty(b, dtype=torch.int32),
            torch.empty(b, dtype=torch.int32), torch.zeros(k, dtype=torch.int64),
            torch.zeros(k, dtype=torch.int64))  # fmt: skip
    plan = kr._plan(
        torch.randn(b * (k + 1), v).to(dtype), torch.randint(0, v, (b, k)), q, st.greedy,
        st.temperature, st.top_k, st.top_p, st.seed, torch.arange(b), *outs, ws, True,
        (2, 3, 4), True,  # with PDL, as RejectionSampler launches them on sm_90
    )  # fmt: skip
    return plan[3]


def decode_path_compiles() -> list[tuple[str, object]]:
    """The fused decode path's launches with programmatic dependent launch (SmolLM2's
    shapes: every fused_linear flavour at 1, 4, 16 and 32 rows; rotary + store, attention
    with its split merge; the int8 lm_head), each made through its own launcher with the
    JIT's run turned into a compile-only warmup. Returns (label, compiled kernel) pairs."""
    import importlib

    # import_module: the package's names fused_linear / paged_attention are functions
    fl = importlib.import_module("kernels.fused_linear")
    fm = importlib.import_module("kernels.fused_mma")
    pa = importlib.import_module("kernels.paged_attention")
    rot = importlib.import_module("kernels.rotary")
    emb = importlib.import_module("kernels.embedding")
    li = importlib.import_module("kernels.linear_int8")
    ta = importlib.import_module("kernels.token_attention")

    got: list[tuple[str, object]] = []
    label = [""]

    def compile_only(jit):
        run = jit.run

        def warm(*a, **kw):
            kw["warmup"] = True
            compiled = run(*a, **kw)
            got.append((f"{label[0]} {jit.__name__}", compiled))
            return compiled

        jit.run = warm

    for jit in (fl._fused_rows_kernel, fl._fused_linear_kernel, fl._fused_qkv_rope_kernel,
                fm._mma_linear_kernel, fm._mma_qkv_rope_kernel, rot._rotary_store_kv_kernel,
                pa._paged_attention_kernel, pa._combine_splits_kernel, emb._embed_fc_kernel,
                emb._embed_rows_kernel, li._linear_int8_kernel,
                ta._token_attention_kernel):  # fmt: skip
        compile_only(jit)
    bf = torch.bfloat16
    h, f, hq, hkv, d = 576, 1536, 9, 3, 64
    # 1 and 4 rows: the rows and wide kernels; 16 and 32: the tensor-core kernels
    for m, rows in ((1, 1), (4, 2), (16, None), (32, None)):
        fl.ROWS_PER_PROGRAM = rows
        stream = torch.randn(m, h).to(bf)
        for name, x, w, kw in (
            ("norm", stream, torch.randn(960, h), dict(norm_weight=torch.ones(h).to(bf))),
            ("residual", torch.randn(m, h).to(bf), torch.randn(h, h), dict(residual=stream)),
            ("silu", torch.randn(m, 2 * f).to(bf), torch.randn(h, f), dict(silu=True)),
            (
                "glu",
                stream,
                torch.randn(2 * f, h),
                dict(norm_weight=torch.ones(h).to(bf), glu=True),
            ),
            ("down", torch.randn(m, f).to(bf), torch.randn(h, f), dict(residual=stream)),
            (
                "wide",
                torch.randn(m, 4096).to(bf),
                torch.randn(64, 4096),
                dict(norm_weight=torch.ones(4096).to(bf), glu=True),
            ),
            ("bias", stream, torch.randn(960, h), dict(bias=torch.randn(960).to(bf))),
        ):
            if kw.get("silu") and m > fl.MAX_ROWS:
                continue  # the wide kernel's prologue only
            label[0] = f"decode M {m} {name}"
            fl.fused_linear(x, w.to(bf), pdl=True, **kw)
        label[0] = f"decode M {m} qkv rope"
        kc = torch.randn(8, 16, hkv, d).to(bf)
        fl.fused_qkv_rope(stream, torch.randn((hq + 2 * hkv) * d, h).to(bf), torch.arange(m),
                          torch.randn(64, d), kc, kc.clone(), torch.arange(m), num_q_heads=hq,
                          norm_weight=torch.ones(h).to(bf), pdl=True)  # fmt: skip
    fl.ROWS_PER_PROGRAM = None
    for m in (1, 4):  # the step's embedding gather
        label[0] = f"decode M {m} embedding"
        emb.embed_rows(torch.arange(m), torch.randn(100, h).to(bf), pdl=True)
    for m in (1, 4, 8):  # EAGLE-1's fc over [embed(token); hidden[rows]]
        label[0] = f"decode M {m} embed fc"
        emb.embed_fc(torch.arange(m), torch.randn(100, h).to(bf), torch.randn(m + 1, h).to(bf),
                     torch.randn(h, 2 * h).to(bf), torch.randn(h).to(bf),
                     hidden_rows=torch.arange(m), pdl=True)  # fmt: skip
    # a draft's int8 lm_head: SmolLM2's [49152, 576] at draft-step rows, a Llama-3-wide K;
    # one 16-row tile, 256-wide K steps, 32- and 64-row tiles
    for m, n, k in ((1, 49152, 576), (8, 49152, 576), (4, 2048, 4096), (20, 49152, 576),
                    (64, 32000, 768)):  # fmt: skip
        label[0] = f"decode M {m} int8 lm_head {n} x {k}"
        q8 = torch.zeros(n, k, dtype=torch.int8)
        li.linear_int8(torch.randn(m, k).to(bf), q8, torch.ones(n), pdl=True)
        if m in (1, 8, 64):  # x's rows to int8 too: int8 tensor-core products
            label[0] = f"decode M {m} int8 lm_head {n} x {k} act_int8"
            li.linear_int8(torch.randn(m, k).to(bf), q8, torch.ones(n), pdl=True, act_int8=True)
    # a greedy step's argmax partials from that lm_head, finished by advance / epilogue
    dr = importlib.import_module("kernels.draft_round")
    from tests.test_drafter import _random_buffers

    for jit in (dr._draft_prepare_kernel, dr._draft_advance_kernel, dr._draft_epilogue_kernel):
        compile_only(jit)
    for m in (1, 8, 64):
        label[0] = f"decode M {m} int8 lm_head partials 49152 x 576"
        val, idx = torch.empty(m, 384), torch.empty(m, 384, dtype=torch.int32)
        blocks = li.linear_int8_partials(torch.randn(m, 576).to(bf), q8.new_zeros(49152, 576),
                                         torch.ones(49152), val, idx, pdl=True)  # fmt: skip
        b, kw = _random_buffers(0, max_rows=m)
        parts = dr.ArgmaxParts(val, idx, blocks, torch.zeros(49152, dtype=torch.int64))
        label[0] = f"round M {m} finishing its argmax from {blocks} blocks"
        checks, dr.check_draft_round_buffers = dr.check_draft_round_buffers, lambda *a, **k: None
        rounds = dr.DraftRoundKernels(b, **kw)  # CPU tensors: compiled, never launched
        dr.check_draft_round_buffers = checks
        rounds._gdc, rounds._opts = dr.pdl_launch(True)  # as on an sm_90 device
        rounds.prepare(m)
        # prepare reading its inputs from the engine's tensors, EAGLE-3-wide bf16 states
        rounds.hidden = torch.zeros(m * kw["width"], 3 * 576).to(bf)
        rounds._prepare._compiled.clear()  # its key assumes one hidden buffer per instance
        rounds.prepare(m)
        rounds.advance(m, 1, 3, parts)
        rounds.epilogue(m, 3, parts)
    label[0] = "decode"
    t, blocks, bs = 4, 8, 16
    q, k, v = (torch.randn(t, n, d).to(bf) for n in (hq, hkv, hkv))
    kc, vc = (torch.randn(blocks, bs, hkv, d).to(bf) for _ in range(2))
    pos = torch.arange(t) + 20
    cos_sin = torch.randn(64, d)
    rot.rotary_store_kv(q, k, v, pos, cos_sin, kc, vc, torch.arange(t) + 20, pdl=True)
    qsl = torch.arange(t + 1, dtype=torch.int32)
    seq = torch.full((t,), 24, dtype=torch.int32)
    table = torch.arange(t * 2, dtype=torch.int32).view(t, 2) % blocks
    pa.paged_attention(q, kc, vc, qsl, seq, table, 0.125, max_query_len=1, max_seq_len=24,
                       num_splits=2, pdl=True)  # fmt: skip
    label[0] = "decode softcap window"
    pa.paged_attention(q, kc, vc, qsl, seq, table, 0.125, max_query_len=1, max_seq_len=24,
                       num_splits=2, sliding_window=8, softcap=5.0, pdl=True)  # fmt: skip
    # the masked key tiles with their loads run one or two tiles ahead (config.prefetch)
    for ahead in (1, 2):
        label[0] = f"decode prefetch {ahead}"
        cfg = pa.AttentionLaunchConfig(16, 5, 64, 2, 4, 2, prefetch=ahead)
        pa.paged_attention(q, kc, vc, qsl, seq, table, 0.125, max_query_len=1, max_seq_len=24,
                           config=cfg, pdl=True)  # fmt: skip
    # one token: the JIT makes an integer argument equal to 1 a constant (stop 48: the
    # split merge called .to() on it and failed to compile on the GPU only)
    label[0] = "decode one token"
    pa.paged_attention(q[:1], kc, vc, qsl[:2], seq[:1], table[:1], 0.125, max_query_len=1,
                       max_seq_len=24, num_splits=2, pdl=True)  # fmt: skip
    # the token programs (kernels/token_attention.py), one and several tokens, with a
    # window and a softcap, over one chunk and over several
    for m, bound, window, cap in ((1, 24, None, None), (4, 24, None, None), (1, 1024, 8, 5.0),
                                  (2, 1024, None, None)):  # fmt: skip
        label[0] = f"decode token programs M {m} bound {bound}"
        cfg = pa.choose_launch_config(num_tokens=m, num_reqs=m, max_query_len=1, num_q_heads=hq,
                                      num_kv_heads=hkv, head_dim=d, max_seq_len=bound)  # fmt: skip
        assert cfg.per_token, cfg
        pa.paged_attention(q[:m], kc, vc, qsl[: m + 1], seq[:m], table[:m], 0.125,
                           max_query_len=1, max_seq_len=bound, sliding_window=window,
                           softcap=cap, config=cfg, pdl=True)  # fmt: skip
    # the O projection merging split attention's partials on its loads (x_splits), 8 splits
    for m in (1, 4):
        label[0] = f"decode M {m} o merging splits"
        out, splits = pa.paged_attention_unmerged(
            q[:m], kc, vc, qsl[: m + 1], seq[:m], table[:m], 0.125, max_query_len=1,
            max_seq_len=24, num_splits=8, pdl=True,
        )  # fmt: skip
        fl.fused_linear(out.view(m, hq * d), torch.randn(h, hq * d).to(bf), residual=stream[:1]
                        .expand(m, h).contiguous(), x_splits=splits, pdl=True)  # fmt: skip
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # one request and one draft among them: the JIT makes an integer argument equal to 1 a
    # constant, which the interpreter never does (stop 48)
    ap.add_argument("--cases", nargs="*", default=["16,10,1", "49152,1,3"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sass", action="store_true", help="instruction counts (nvdisasm)")
    ap.add_argument("--decode", action="store_true", help="also the fused decode path (PDL)")
    args = ap.parse_args(argv)
    driver.set_active(_Sm90Driver())
    failed = 0
    import kernels.rejection as kr

    for case in args.cases:
        v, b, k = map(int, case.split(","))
        cfg = kr.choose_rejection_config(v, b, k)
        # the default tiles; and where the one-pass bracket runs, its cut with fuse_kp
        # the other way (so that flipping it cannot fail on the GPU only) and, at one
        # request, binary bisection steps (interp_f: on at large vocabularies), else the
        # 2048-value sample and scratch (sample_f, cap_f), in one compile
        variants = [(None, "", None)]
        if cfg.cap_f > 0:
            other = {"interp_f": 0} if b == 1 else {"sample_f": 2048, "cap_f": 2048}
            flip = dataclasses.replace(cfg, fuse_kp=not cfg.fuse_kp, **other)
            tag = f" fuse_kp={int(flip.fuse_kp)} " + " ".join(f"{n}={x}" for n, x in other.items())
            variants.append((flip, tag, "_cut_kernel"))
            # the narrow bracket sort and the top-k cut's own sample (small_f, sample_k: off
            # by default), with one column a lane in flight and the bracket's cut sorted
            # (loads_f 16, bisect_f: on at large vocabularies), in one compile
            narrow = dataclasses.replace(
                cfg, small_f=cfg.small_f or 512, sample_k=512, loads_f=17 - cfg.loads_f,
                bisect_f=not cfg.bisect_f,
            )  # fmt: skip
            tag = (f" small_f={narrow.small_f} sample_k=512 loads_f={narrow.loads_f}"
                   f" bisect_f={int(narrow.bisect_f)}")  # fmt: skip
            variants.append((narrow, tag, "_cut_kernel"))
        # the partials read twice or once (one_pass_v), the one-pass form with its exps
        # flushed or not (ftz_v): both on at large vocabularies, off at small ones
        flip = dataclasses.replace(cfg, one_pass_v=not cfg.one_pass_v, ftz_v=not cfg.ftz_v)
        tag = f" one_pass_v={int(flip.one_pass_v)} ftz_v={int(flip.ftz_v)}"
        variants.append((flip, tag, "_partials_kernel"))
        # and the one-pass form's argmax and smallest value found after its loop or in it
        # (lazy_v: on at large vocabularies)
        lazy = dataclasses.replace(cfg, one_pass_v=True, lazy_v=not cfg.lazy_v)
        variants.append((lazy, f" one_pass_v=1 lazy_v={int(lazy.lazy_v)}", "_partials_kernel"))
        # the all-greedy launch's argmax found after its loop or in it (lazy_g)
        lazy = dataclasses.replace(cfg, lazy_g=not cfg.lazy_g)
        variants.append((lazy, f" lazy_g={int(lazy.lazy_g)}", "_greedy_kernel"))
        # the race drawn over lists of the kept columns or not (pack_r: on at large
        # vocabularies; its list store is inline PTX, which the interpreter never compiles)
        pack = dataclasses.replace(cfg, pack_r=0 if cfg.pack_r else cfg.block_r // 4)
        variants.append((pack, f" pack_r={pack.pack_r}", "_resample_kernel"))
        # the top-p cut from counts of equal 16-bit values (hist_p; its launch only)
        hist = dataclasses.replace(cfg, hist_p=cfg.hist_p or 256)
        variants.append((hist, f" hist_p={hist.hist_p}", "_hist_cut_kernel"))
        for name, (config, tag, only), sampled in itertools.product(
            args.dtypes.split(","), variants, (True, False)
        ):
            if only not in (None, "_greedy_kernel") and not sampled:
                continue  # the cut, partials and race run in sampled batches only
            if only == "_greedy_kernel" and sampled:
                continue  # the one-launch greedy kernel: all-greedy batches only
            if (config is not None or cfg.cap_f > 0) and name != args.dtypes.split(",")[-1]:
                # a variant's branches, and the wide tiles (whose one-row bracket launch
                # takes ~90 s a compile here): one logits dtype is enough (CI time)
                continue
            for cached, _, grid, kargs, options in launches(
                v, b, k, getattr(torch, name), sampled, config
            ):
                if only is not None and cached.jit_fn.__name__ != only:
                    continue
                what = f"V {v} B {b} K {k} {name}{tag} {cached.jit_fn.__name__}"
                try:
                    compiled = cached.jit_fn.warmup(*kargs, grid=grid, **options)
                except Exception as e:  # any compiler failure is the finding
                    failed += 1
                    first = str(e).strip().splitlines()[:1] or [""]
                    print(f"FAIL {what}: {type(e).__name__}: {first[0][:200]}", flush=True)
                else:
                    cubin = compiled.asm.get("cubin", b"")
                    extra = f"; {sass_summary(cubin)}" if args.sass else ""
                    print(f"ok   {what}: cubin {len(cubin)} bytes{extra}", flush=True)
    if args.decode:
        try:
            for what, compiled in decode_path_compiles():
                cubin = compiled.asm.get("cubin", b"")
                gdc = "griddepcontrol.wait" in compiled.asm.get("ptx", "")
                extra = f"; {sass_summary(cubin)}" if args.sass else ""
                bars = compiled.asm.get("ptx", "").count("bar.sync")
                print(f"ok   {what}: cubin {len(cubin)} bytes, griddepcontrol.wait {gdc}, "
                      f"bar.sync {bars}{extra}")  # fmt: skip
        except Exception as e:  # any compiler failure is the finding
            failed += 1
            first = str(e).strip().splitlines()[:1] or [""]
            print(f"FAIL decode path: {type(e).__name__}: {first[0][:200]}", flush=True)
    print(f"{failed} launches failed to compile for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
