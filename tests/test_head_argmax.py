"""kernels.head_argmax (the greedy lm_head in one launch) against the float64 product
rounded to the logits' dtype and then argmax; its use in a model's greedy forward; bad
inputs."""

from __future__ import annotations

import pytest
import torch

from specdraft import ops
from specdraft.kernels import HEAD_TICKETS, head_argmax, use_validation
from specdraft.layers import GreedyHead


def rounded_logits(x, w, rows, dtype):
    """The logits as a GEMM in `dtype` would store them, from the float64 product."""
    sel = x if rows is None else x[rows]
    return (sel.double() @ w.double().T).to(dtype).float()


def assert_argmax(got, logits, offsets=None):
    """got[i] is the first index of row i's maximum of `logits`, except where the two
    largest values lie within one rounding step of the dtype (there either may win:
    the kernel's float32 accumulation order is not float64's); plus offsets."""
    top2 = logits.topk(2, dim=-1).values
    tight = (top2[:, 0] - top2[:, 1]) <= 2e-3 * top2[:, 0].abs().clamp(min=1)
    want = logits.argmax(-1)
    idx = got.clone()
    if offsets is not None:  # back to column indices: the offsets are distinct per column
        want = want + offsets[want]
    for i in range(got.shape[0]):
        if tight[i]:
            col = [c for c in range(logits.shape[1])
                   if int(c + (0 if offsets is None else offsets[c])) == int(idx[i])]  # fmt: skip
            assert col and logits[i, col[0]] >= top2[i, 1], (i, idx[i])
        else:
            assert int(got[i]) == int(want[i]), (i, got[i], want[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "t, m, n, k", [(1, 1, 300, 40), (5, 3, 1000, 96), (8, 4, 513, 576), (9, 2, 777, 1152)]
)
def test_head_argmax_is_lm_head_then_argmax(device, dtype, t, m, n, k):
    """Fresh random x and W per call, twice (the ticket must come back to zero); rows
    gathered or all of x; the token written into a strided column of a poisoned table
    through an id map; the other columns untouched."""
    tickets = torch.zeros(HEAD_TICKETS, dtype=torch.int32, device=device)
    offsets = torch.randperm(n, device=device) * 3 - torch.arange(n, device=device)  # distinct
    for call in range(2):
        x = torch.randn(t, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        gather = call == 0 or m < t
        rows = torch.randint(0, t, (m,), device=device) if gather else None
        table = torch.full((m, 3), -7, dtype=torch.int64, device=device)
        off = offsets if call == 0 else None
        got = head_argmax(x, w, out=table[:, 1], tickets=tickets, rows=rows, offsets=off)
        assert got.data_ptr() == table[:, 1].data_ptr()
        assert_argmax(table[:, 1].cpu(), rounded_logits(x, w, rows, dtype).cpu(),
                      None if off is None else off.cpu())  # fmt: skip
        assert bool((table[:, [0, 2]] == -7).all()) and int(tickets.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_argmax_ties_and_nan(device, dtype):
    """Equal W rows in different column blocks give equal logits: the lower index wins;
    a NaN in x makes every logit NaN, which ranks as the maximum: index 0, as torch."""
    n, k = 700, 64
    w = torch.randn(n, k, device=device).to(dtype)
    x = torch.randn(3, k, device=device).to(dtype)
    best = (x[0].double() @ w.double().T).argmax()
    w[650] = w[40] = w[best] * 1
    x[2, 5] = float("nan")
    out = torch.full((3,), -7, dtype=torch.int64, device=device)
    head_argmax(x, w, out=out, tickets=torch.zeros(HEAD_TICKETS, dtype=torch.int32, device=device))
    assert int(out[0]) == min(40, int(best))
    assert int(out[2]) == 0


def test_head_argmax_bad_inputs(device):
    """A ValueError or TypeError naming the argument; out and tickets unchanged."""
    x = torch.randn(4, 32, device=device)
    w = torch.randn(50, 32, device=device)
    out = torch.full((4,), -7, dtype=torch.int64, device=device)
    zeros = torch.zeros(HEAD_TICKETS, dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    bad = [
        (TypeError, "weight", dict(w=w.half())),
        (ValueError, "weight", dict(w=torch.randn(50, 31, device=device))),
        (ValueError, "rows", dict(rows=torch.tensor([0, 1, 4, 2], **i64))),
        (ValueError, "rows", dict(rows=torch.tensor([0, -1, 2, 2], **i64))),
        (TypeError, "rows", dict(rows=torch.zeros(4, dtype=torch.int32, device=device))),
        (ValueError, "5 rows", dict(x=torch.randn(5, 32, device=device), out=out.repeat(2)[:5])),
        (ValueError, "out", dict(out=out[:3])),
        (ValueError, "out", dict(out=out[:, None])),
        (TypeError, "out", dict(out=out.int())),
        (TypeError, "out", dict(out=[0, 0, 0, 0])),
        (TypeError, "tickets", dict(tickets=zeros.long())),
        (ValueError, "tickets", dict(tickets=zeros.repeat(2)[::2])),
        (ValueError, "tickets", dict(tickets=zeros[:-1])),
        (TypeError, "offsets", dict(offsets=torch.zeros(50, device=device))),
        (ValueError, "offsets", dict(offsets=torch.zeros(49, **i64))),
    ]
    for exc, name, kw in bad:
        args = dict(x=x, w=w, out=out, tickets=zeros, rows=None, offsets=None)
        args.update(kw)
        # rows' values are checked in validation mode (on by default on the CPU only)
        with pytest.raises(exc, match=name), use_validation(True):
            head_argmax(args["x"], args["w"], out=args["out"], tickets=args["tickets"],
                        rows=args["rows"], offsets=args["offsets"])  # fmt: skip
        assert bool((out == -7).all()) and int(zeros.abs().sum()) == 0


def test_greedy_forward_writes_the_argmax_of_its_logits(device):
    """A model's greedy forward (GreedyHead: one launch on the Triton backend) writes the
    argmax of the logits the same forward returns without it: a padded prefill (each
    request's last row gathered) and a padded decode step (every row as it is)."""
    from specdraft.models.tiny import random_causal_lm, tiny_config
    from tests.model_helpers import PagedRunner

    cfg = tiny_config()
    model = random_causal_lm(cfg, seed=0, device=device)
    runner = PagedRunner(cfg, device, dtype=model.dtype)
    tickets = torch.zeros(HEAD_TICKETS, dtype=torch.int32, device=device)
    steps = [([(0, [3, 5, 7, 11]), (1, [2, 4])], 2), ([(0, [1]), (1, [2])], 1)]
    for reqs, pad in steps:
        meta = runner.step(reqs, pad_reqs=1, pad_tokens=pad)
        _, logits = model(meta.input_ids, meta, runner.cache)
        out = torch.full((logits.shape[0] + 1,), -7, dtype=torch.int64, device=device)
        hidden, none = model(meta.input_ids, meta, runner.cache,
                             greedy=GreedyHead(out[1:], tickets))  # fmt: skip
        assert none is None and int(out[0]) == -7 and int(tickets.abs().sum()) == 0
        assert_argmax(out[1:].cpu(), logits.float().cpu())
        takes = ops.head_argmax_takes(hidden, model.lm_head.weight, logits.shape[0])
        assert takes == (ops.backend_for(hidden) == "triton")


@pytest.mark.gpu
def test_gpu_head_argmax_bf16_vocab_49152():
    """SmolLM2's lm_head shape in bf16 against cuBLAS's logits then torch.argmax: equal
    except where cuBLAS's top two logits are within a bf16 step of each other."""
    w = torch.randn(49152, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    tickets = torch.zeros(HEAD_TICKETS, dtype=torch.int32, device="cuda")
    for m in (1, 2, 4):
        x = torch.randn(m + 2, 576, device="cuda", dtype=torch.bfloat16)
        rows = torch.randperm(m + 2, device="cuda")[:m]
        out = torch.full((m,), -7, dtype=torch.int64, device="cuda")
        head_argmax(x, w, out=out, tickets=tickets, rows=rows, pdl=True)
        logits = torch.nn.functional.linear(x[rows], w).float()
        assert_argmax(out.cpu(), logits.cpu())
