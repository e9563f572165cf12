"""`specdraft selfcheck`: run the Triton kernels on random paged batches and compare
them with the PyTorch implementation of the same math (specdraft.torch_ops).

On a GPU the kernels run there (float32 and bfloat16). Without one they run under the
Triton interpreter on CPU tensors (float32), in a child process started with
TRITON_INTERPRET=1, since the variable must be set before the kernels are defined.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def _random_batch(q_lens, ctx_lens, *, hq, hkv, d, block, dtype, device, gen):
    """A ragged batch over a paged cache with permuted blocks and a padded request."""
    lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_req = [-(-n // block) for n in lens]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    width = max(per_req)
    table = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(per_req):
        table[r, :nb] = perm[used : used + nb]
        used += nb
    shape = (num_blocks, block, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q_lens) + 2  # two padded tokens
    q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist(), sum(q_lens)])
    seq_lens = torch.tensor([*lens, 0])
    to = dict(device=device)
    return (
        q.to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        qsl.to(torch.int32).to(**to),
        seq_lens.to(torch.int32).to(**to),
        table.to(**to),
    )


def run_checks(device: str) -> int:
    from specdraft import kernels, torch_ops

    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    cases = [([1, 1, 1], [40, 7, 90], None), ([1, 4, 9], [30, 64, 0], 4), ([5], [300], None)]
    failed = 0
    for dtype in dtypes:
        for q_lens, ctx, splits in cases:
            q, kc, vc, qsl, sl, bt = _random_batch(
                q_lens, ctx, hq=8, hkv=2, d=64, block=16, dtype=dtype, device=device, gen=gen
            )
            out = torch.full_like(q, float("nan"))
            kernels.paged_attention(
                q,
                kc,
                vc,
                qsl,
                sl,
                bt,
                0.125,
                out=out,
                max_query_len=max(q_lens),
                num_splits=splits,
            )
            ref = torch_ops.paged_attention(
                q.float().cpu(),
                kc.float().cpu(),
                vc.float().cpu(),
                qsl.cpu(),
                sl.cpu(),
                bt.cpu(),
                0.125,
            )
            err = (out.float().cpu() - ref).abs().max().item()
            # bf16: the output's own rounding (|out| <~ 3, 2^-8 relative) plus q/k/v
            # rounding already in the inputs of both sides.
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            ok = not torch.isnan(out).any().item() and err <= tol
            failed += not ok
            print(
                f"paged_attention {str(dtype):15s} q_lens={q_lens} ctx={ctx} splits={splits}: "
                f"max abs error {err:.2e} (limit {tol:.0e}) {'ok' if ok else 'FAILED'}"
            )
    where = "GPU" if device == "cuda" else "CPU under the Triton interpreter"
    print(f"selfcheck on the {where}: {'passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


def main() -> int:
    if torch.cuda.is_available():
        return run_checks("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return run_checks("cpu")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import sys; from specdraft.selfcheck import run_checks; sys.exit(run_checks('cpu'))"
    return subprocess.call([sys.executable, "-c", code], env=env)
