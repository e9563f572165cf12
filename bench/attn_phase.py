"""One-row decode attention as a phase of a PDL chain (GPU only): what the library's
split launch and its merge cost a layer, against attention in one launch with no split.

Stop 59 found SmolLM2's one-row step waits on no weight bytes: it is ~180 dependent
launches, and a layer's attention (split keys, then a combine launch) is two of them,
~3.9 µs of its ~11.9 (bench/NOTES.md). This bench asks, before anyone builds it into the
library, whether one launch could do that job in less.

SmolLM2's heads by default (9 query heads, 3 KV heads, head_dim 64), one request, one
query token, `--ctx` keys in a paged cache (16-key blocks) at the main job's length
bound; `--phases` phases under one graph, each phase's query the output of the phase
before (a real dependency), each phase its own K/V cache (a layer's). µs a phase
(median replay / phases), for:

- `empty`: a launch of one program a query head that only waits (the PDL boundary);
- `library`: kernels.paged_attention as the decode step runs it (its split launch and
  the combine launch);
- `split + merge, float32 products`: the library's two launches, each in the one-launch
  kernel's style (`_split_kernel`, 16 key ranges a head, then `_merge_kernel`): whether a
  difference is the launch count or the library's tensor-core tile code;
- `one launch`: `_one_launch_kernel`, one program a query head over all of the
  request's keys with float32 products on the CUDA cores (no tensor cores, no split, no
  merge), 256-key chunks under an online softmax, its K/V and block table loaded after
  the PDL wait; `one launch, K/V before the wait`: the first chunk's K/V loaded before
  it (in a step every key but the step's own is final before the wait; that one row
  would come after it, beside q).

Each variant's output is checked against a float64 reference first (within 4 bf16
rounding steps of the reference); a variant that fails is reported and not timed.

    python -m bench.attn_phase [--out results] [--ctx 256,1000] [--phases 60]
        [--heads 9/3/64] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 16  # keys a cache block


@triton.jit
def _chunk(k_ptr, v_ptr, table_ptr, seq_len, c0, g, keys, d,
           NUM_KV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """K and V [BLOCK, D] of keys c0 + keys (zero past seq_len) for KV head g, read
    through the block table; and their mask."""
    pos = c0 + keys
    live = pos < seq_len
    blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    row = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV + g
    at = row[:, None] * D + d[None, :]
    k = tl.load(k_ptr + at, mask=live[:, None], other=0.0)
    v = tl.load(v_ptr + at, mask=live[:, None], other=0.0)
    return k, v, live


@triton.jit
def _one_launch_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seq_ptr, o_ptr, scale,
                       NUM_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRELOAD: tl.constexpr,
                       GDC: tl.constexpr):  # fmt: skip
    """o[h] = softmax(q[h] K^T * scale) V over the request's seq_len keys, one program
    per query head h (KV head h // GROUP); q, o: [H, D]; caches [blocks, BLOCK_SIZE,
    NUM_KV, D]; one request (its block-table row at table_ptr, its length at seq_ptr)."""
    h = tl.program_id(0)
    g = h // GROUP
    d = tl.arange(0, D)
    keys = tl.arange(0, BLOCK)
    seq_len = tl.load(seq_ptr)  # metadata: written before the graph, final before the wait
    if PRELOAD:
        k, v, live = _chunk(k_ptr, v_ptr, table_ptr, seq_len, 0, g, keys, d, NUM_KV, D,
                            BLOCK_SIZE)  # fmt: skip
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PRELOAD:
        k, v, live = _chunk(k_ptr, v_ptr, table_ptr, seq_len, 0, g, keys, d, NUM_KV, D,
                            BLOCK_SIZE)  # fmt: skip
    q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
    s = tl.where(live, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    m = tl.max(s, axis=0)
    p = tl.exp(s - m)
    l_sum = tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    for c0 in range(BLOCK, seq_len, BLOCK):  # later chunks: an online softmax
        k, v, live = _chunk(k_ptr, v_ptr, table_ptr, seq_len, c0, g, keys, d, NUM_KV, D,
                            BLOCK_SIZE)  # fmt: skip
        s = tl.where(live, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    tl.store(o_ptr + h * D + d, (acc / l_sum).to(o_ptr.dtype.element_ty))


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seq_ptr, part_ptr, lse_ptr, scale,
                  NUM_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr,
                  GDC: tl.constexpr):  # fmt: skip
    """Split s of query head h (program (h, s)): the same float32 products over keys
    [s * c, (s + 1) * c), c = cdiv(seq_len, SPLITS) <= BLOCK, normalised, into part [SPLITS,
    H, D] and its log-sum-exp into lse [SPLITS, H] (-inf for no keys)."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    g = h // GROUP
    d = tl.arange(0, D)
    keys = tl.arange(0, BLOCK)
    seq_len = tl.load(seq_ptr)
    per = tl.cdiv(seq_len, SPLITS)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    end = tl.minimum(seq_len, (sp + 1) * per)
    k, v, live = _chunk(k_ptr, v_ptr, table_ptr, end, sp * per, g, keys, d, NUM_KV, D,
                        BLOCK_SIZE)  # fmt: skip
    q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
    s = tl.where(live, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    m = tl.max(s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe)
    l_sum = tl.sum(p, axis=0)
    o = tl.sum(p[:, None] * v.to(tl.float32), axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
    heads = tl.num_programs(0)
    tl.store(part_ptr + (sp * heads + h) * D + d, o)
    lse = m_safe + tl.log(tl.where(l_sum > 0, l_sum, 1.0))  # no log(0) on empty splits
    tl.store(lse_ptr + sp * heads + h, tl.where(l_sum > 0, lse, float("-inf")))


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, o_ptr, H, D: tl.constexpr, SPLITS: tl.constexpr,
                  GDC: tl.constexpr):  # fmt: skip
    """o[h] from the SPLITS partials of head h (program h)."""
    h = tl.program_id(0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + sp * H + h)
    part = tl.load(part_ptr + (sp[:, None] * H + h) * D + d[None, :])
    w = tl.exp(lse - tl.max(lse, axis=0))
    o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + h * D + d, o.to(o_ptr.dtype.element_ty))


@triton.jit
def _wait_kernel(q_ptr, o_ptr, D: tl.constexpr, GDC: tl.constexpr):
    """A phase that only waits for the one before and lets the next start: o = q."""
    h = tl.program_id(0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    d = tl.arange(0, D)
    tl.store(o_ptr + h * D + d, tl.load(q_ptr + h * D + d))


def one_launch(
    q, k_cache, v_cache, block_table, seq_lens, scale: float, out, *, block: int = 256,
    preload: bool = False, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of one query token (q [H, D]) over one request's paged keys, into out
    [H, D]: _one_launch_kernel. block: keys a chunk (a power of two)."""
    from specdraft.kernels.launch import pdl_launch

    heads, dim = q.shape
    num_kv = k_cache.shape[2]
    if heads % num_kv or block & (block - 1) or dim & (dim - 1):
        raise ValueError(f"heads {heads} / KV heads {num_kv}, block {block}, head_dim {dim}")
    gdc, options = pdl_launch(pdl)
    _one_launch_kernel[(heads,)](q, k_cache, v_cache, block_table, seq_lens, out, scale,
                                 num_kv, heads // num_kv, dim, block, k_cache.shape[1],
                                 preload, gdc, num_warps=8 if block >= 256 else 4,
                                 **options)  # fmt: skip
    return out


def split_merge(
    q, k_cache, v_cache, block_table, seq_lens, scale: float, out, *, splits: int,
    bound: int, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The same attention as two launches: _split_kernel over `splits` key ranges of a
    request up to `bound` keys long (powers of two), then _merge_kernel, into out [H, D]."""
    from specdraft.kernels.launch import pdl_launch

    heads, dim = q.shape
    num_kv = k_cache.shape[2]
    if heads % num_kv or splits & (splits - 1) or dim & (dim - 1):
        raise ValueError(f"heads {heads} / KV heads {num_kv}, splits {splits}, head_dim {dim}")
    block = max(16, triton.next_power_of_2(triton.cdiv(bound, splits)))
    part = torch.empty(splits, heads, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, heads, device=q.device, dtype=torch.float32)
    gdc, options = pdl_launch(pdl)
    _split_kernel[(heads, splits)](q, k_cache, v_cache, block_table, seq_lens, part, lse, scale,
                                   num_kv, heads // num_kv, dim, block, k_cache.shape[1],
                                   splits, gdc, num_warps=4, **options)  # fmt: skip
    _merge_kernel[(heads,)](part, lse, out, heads, dim, splits, gdc, num_warps=1, **options)
    return out


def reference(q, k_cache, v_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
    """float64 attention of one query token q [H, D] over a request's first seq_len keys
    (block_table: its row): tests/reference.py's paged_attention_ref for that one token."""
    from tests.reference import paged_attention_ref

    dev = q.device
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    lens = torch.tensor([seq_len], device=dev, dtype=torch.int32)
    return paged_attention_ref(q[None], k_cache, v_cache, qsl, lens, block_table[None],
                               scale)[0]  # fmt: skip


def _bf16_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of the largest bf16 rounding error of want (>= 1e-6)."""
    own = (want.to(torch.bfloat16).double() - want).abs().max().item()
    return (got.double() - want).abs().max().item() / max(own, 1e-6)


def _chains(ctx: int, heads: int, num_kv: int, dim: int, n: int, bound: int, gen):
    """The five chains of n phases at ctx keys, the phases' outputs ([n, H, D]: phase
    i's output is phase i + 1's query) and the float64 reference of the first phase."""
    from specdraft import kernels
    from specdraft.kernels.launch import pdl_launch

    dev = "cuda"
    scale = 1.0 / math.sqrt(dim)
    blocks = triton.cdiv(ctx, BLOCK_SIZE)
    # Each phase (layer) its own cache; the request's blocks shuffled.
    table = torch.randperm(blocks, device=dev, generator=gen).to(torch.int32) + 1
    spare = triton.cdiv(bound, BLOCK_SIZE) - blocks
    table = torch.cat([table, torch.zeros(spare, dtype=torch.int32, device=dev)])[None]
    shape = (n, blocks + 1, BLOCK_SIZE, num_kv, dim)
    kc = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
    seq = torch.tensor([ctx], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    buf = torch.randn(n + 1, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    want = reference(buf[0], kc[0], vc[0], table[0], ctx, scale)
    gdc, options = pdl_launch(True)

    def library():
        for i in range(n):
            kernels.paged_attention(
                buf[i][None], kc[i], vc[i], qsl, seq, table, scale, out=buf[i + 1][None],
                max_query_len=1, max_seq_len=bound, pdl=True,
            )  # fmt: skip

    def ones(preload):
        def run():
            for i in range(n):
                one_launch(buf[i], kc[i], vc[i], table[0], seq, scale, buf[i + 1],
                           preload=preload, pdl=True)  # fmt: skip

        return run

    def empty():
        for i in range(n):
            _wait_kernel[(heads,)](buf[i], buf[i + 1], dim, gdc, **options)

    def splits16():
        for i in range(n):
            split_merge(buf[i], kc[i], vc[i], table[0], seq, scale, buf[i + 1], splits=16,
                        bound=bound, pdl=True)  # fmt: skip

    variants = {"empty": empty, "library": library, "split + merge, float32 products":
                splits16, "one launch": ones(False),
                "one launch, K/V before the wait": ones(True)}  # fmt: skip
    return variants, buf[1:], want


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--ctx", default="256,1000", help="keys cached, comma-separated")
    ap.add_argument("--phases", type=int, default=60)
    ap.add_argument("--heads", default="9/3/64", help="query heads / KV heads / head_dim")
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="the length bound the library's launch is chosen for")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        ctxs = [int(c) for c in args.ctx.split(",")]
        heads, num_kv, dim = (int(v) for v in args.heads.split("/"))
    except ValueError:
        ap.error(f"--ctx {args.ctx!r} / --heads {args.heads!r}: integers expected")
    if min(ctxs) < 1 or heads < 1 or num_kv < 1 or heads % num_kv or dim & (dim - 1):
        ap.error(f"--ctx {args.ctx} (each >= 1), --heads {args.heads} (H a multiple of "
                 "Hkv, head_dim a power of two)")  # fmt: skip
    if args.phases < 1 or max(ctxs) > args.max_model_len:
        ap.error(f"--phases {args.phases} (>= 1), --ctx {args.ctx} (<= --max-model-len "
                 f"{args.max_model_len})")  # fmt: skip
    if not torch.cuda.is_available():
        print("bench.attn_phase needs an NVIDIA GPU (tests/test_attn_phase.py: the CPU)")
        return 2
    from bench.common import environment, markdown_table, save_results, time_graph_us

    env = environment()
    n = args.phases
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; heads {heads}/{num_kv}"
          f"/{dim}, {n} phases", flush=True)  # fmt: skip
    rows = []
    for ctx in ctxs:
        variants, out, want = _chains(ctx, heads, num_kv, dim, n, args.max_model_len, gen)
        for name, fn in variants.items():
            row = {"ctx": ctx, "variant": name}
            if name != "empty":
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["bf16_steps"] = _bf16_steps(out[0], want)
                if not row["bf16_steps"] <= 4.0:
                    print(f"ctx {ctx} {name}: {row['bf16_steps']:.1f} bf16 steps off the "
                          "float64 reference: not timed", flush=True)  # fmt: skip
                    rows.append(row)
                    continue
            row["us"] = time_graph_us([fn], min_launches=1) / n
            print(f"ctx {ctx} {name:32s} {row['us']:7.3f} µs a phase", flush=True)
            rows.append(row)
    head = (f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
            f"one query token, heads {heads} / {num_kv} / {dim}, bound {args.max_model_len}, "
            f"{n} phases under one graph, PDL")  # fmt: skip
    cols = [("ctx", "keys"), ("variant", "variant"), ("us", "µs a phase"),
            ("bf16_steps", "error (bf16 steps of the float64 reference)")]  # fmt: skip
    text = head + "\n\n" + markdown_table(rows, cols)
    save_results(args.out, "attn_phase", {"env": env, "rows": rows}, text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
