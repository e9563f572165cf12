"""bench.rejection's per-launch breakdown off the GPU (the Triton interpreter): one plan
per input set is found, every launch is named and timed as a prefix difference, and the
prefixes it runs are the sampler's own launches (the last prefix writes the tokens)."""

from __future__ import annotations

import pytest
import torch

from bench import rejection as br
from specdraft.rejection import RejectionSampler
from specdraft.sampling import SamplingParams, SamplingTensors

# CPU tensors through Triton kernels: the interpreter's checks, skipped where CUDA is
pytestmark = pytest.mark.interpreter


def test_per_launch_names_every_launch_and_runs_the_real_prefixes(monkeypatch):
    b, k, v = 2, 2, 64
    g = torch.Generator().manual_seed(7)
    sets = []
    for _ in range(3):
        logits = torch.randn(b * (k + 1), v, generator=g) * 2
        q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
        drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k)
        sets.append((logits, drafts, q, torch.tensor([5, 9])))
    st = SamplingTensors.from_params(
        [SamplingParams(1.0, top_p=0.9, seed=i) for i in range(b)], "cpu"
    )
    sampler = RejectionSampler(b, k, v, "cpu")
    calls = []

    def fake_time(launches, min_launches):
        # Each prefix callable runs its launches: poisoned outputs tell whether the last
        # prefix (every launch) wrote the tokens.
        sampler.tokens.fill_(-7)
        for fn in launches:
            fn()
        calls.append(sampler.tokens.clone())
        return 10.0 * len(calls)

    monkeypatch.setattr(br, "time_graph_us", fake_time)
    text = br.per_launch_us(sampler, sets, st)
    parts = [p.split(":") for p in text.split()]
    names = [n for n, _ in parts]
    assert names[0] == "partials" and "resample" in names, text
    assert all(float(t) == 10.0 for _, t in parts), text  # differences of 10, 20, 30, ...
    assert len(calls) == len(names)
    assert (calls[0] == -7).all()  # the partials alone write no tokens
    last = calls[-1][:b, : k + 1]
    assert (last != -7).all() and (last[:, 0] >= 0).all()  # the whole plan did


def _blocks(t: torch.Tensor, nb: int, width: int, fill: float) -> torch.Tensor:
    """t [R, V] padded with `fill` to nb * width columns, as [R, nb, width]."""
    pad = torch.full((t.shape[0], nb * width - t.shape[1]), fill, dtype=t.dtype)
    return torch.cat([t, pad], 1).view(t.shape[0], nb, width)


def test_partials_ladder_rungs_compute_what_they_claim():
    from bench.rejection_ladder import PARTIAL_RUNGS, partials_ladder

    r, v, width = 5, 300, 128
    x = torch.randn(r, v) * 3
    x[1, 7] = x[1, 9] = 50.0  # a tie: the first index wins
    drafts = torch.randint(0, v, (r,))
    nb = 3
    xb = _blocks(x, nb, width, float("-inf"))
    mx = xb.max(-1).values
    arg = (xb == mx[..., None]).float().argmax(-1) + torch.arange(nb) * width
    ez = torch.exp(xb - mx[..., None])
    above = xb > x[torch.arange(r), drafts][:, None, None]
    # out's columns: sum (rung 0) or max, argmax, sum exp, min, mass and count above
    want = [mx, arg.float(), ez.sum(-1), _blocks(x, nb, width, float("inf")).min(-1).values,
            torch.where(above, ez, 0.0).sum(-1), above.sum(-1).float()]  # fmt: skip
    written_by = {0: [0], 1: [0], 2: [0, 1], 3: [0, 1, 2], 4: [0, 1, 2, 3], 5: list(range(6))}
    for rung in range(len(PARTIAL_RUNGS)):
        out = partials_ladder(x, drafts, rung, 2, width, 4)
        for c in written_by[rung]:
            ref = _blocks(x, nb, width, 0.0).sum(-1) if rung == 0 else want[c]
            torch.testing.assert_close(out[..., c], ref, rtol=1e-5, atol=1e-4)
        written = torch.zeros(6, dtype=torch.bool)
        written[written_by[rung]] = True
        assert out[..., ~written].isnan().all()  # poisoned: nothing else written


def test_race_ladder_rungs_compute_what_they_claim():
    from bench.rejection_ladder import race_ladder
    from specdraft.sampling import RESIDUAL, exponential_race, keyed_uniform

    b, v, block, sub = 3, 300, 128, 64
    x = torch.randn(b, v) * 2
    q = torch.softmax(torch.randn(b, v), -1)
    m = x.max(-1).values
    thr = torch.tensor([float("-inf"), 0.5, -1.0])
    tot = torch.exp(x - m[:, None]).where(x >= thr[:, None], 0.0).sum(-1)
    seed, pos = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    p = torch.exp(x - m[:, None]).where(x >= thr[:, None], 0.0) / tot[:, None]
    w = (p - q).clamp_min(0.0)
    u = keyed_uniform(seed[:, None], pos[:, None], int(RESIDUAL), v)[:, 0]
    nb = 3
    args = (x, q, m, thr, tot, seed, pos)
    sums = [_blocks(x + q, nb, block, 0.0).sum(-1), _blocks(w, nb, block, 0.0).sum(-1),
            _blocks(w * u, nb, block, 0.0).sum(-1)]  # fmt: skip
    for rung in range(3):
        out = race_ladder(*args, rung, block, sub, 4)
        torch.testing.assert_close(out[..., 0], sums[rung], rtol=1e-4, atol=1e-5)
    races = [race_ladder(*args, rung, block, sub, 4) for rung in (3, 4)]
    assert torch.equal(races[0], races[1])  # zero dividends skipped: the same bits
    for blk in range(nb):  # each block's winner is the keyed race's over that block
        wb = torch.zeros_like(w)
        wb[:, blk * block : (blk + 1) * block] = w[:, blk * block : (blk + 1) * block]
        won = exponential_race(wb, seed, pos, int(RESIDUAL))
        has = wb.amax(-1) > 0
        assert torch.equal(races[0][has, blk, 1].long(), won[has]), blk


def test_cut_ladder_rungs_compute_what_they_claim():
    from bench.rejection_ladder import CUT_RUNGS, cut_ladder, top_p_brackets

    r, v = 4, 300
    tile = block, sample, cap, lanes, _ = (64, 64, 128, 1, 4)
    x = torch.randn(r, v) * 2
    m = x.max(-1).values
    b_lo, b_hi = top_p_brackets(x, 0.9, half=40)
    fxs = float(2 ** (62 - (v - 1).bit_length()))
    fx = (torch.exp(x - m[:, None]) * fxs).long()
    ss = x[:, torch.arange(sample) * v // sample].sort(-1, descending=True).values
    up = x > b_hi[:, None]
    inb = (x >= b_lo[:, None]) & (x <= b_hi[:, None])
    # each lane (column % block) keeps the first `lanes` bracket values it meets
    lane_rank = torch.zeros_like(inb, dtype=torch.long)
    for c0 in range(block, v, block):
        prev = inb[:, c0 - block : c0].long() + lane_rank[:, c0 - block : c0]
        lane_rank[:, c0 : c0 + block] = prev[:, : min(block, v - c0)]
    kept = inb & (lane_rank < lanes)
    median, half_at = [], []
    for i in range(r):
        vals = x[i][kept[i]].sort(descending=True).values
        e = (torch.exp(vals - m[i]) * fxs).long()
        median.append(vals[len(vals) // 2])
        half_at.append(int((2 * e.cumsum(0) < e.sum()).sum()))
    want = {
        0: (ss * torch.arange(sample)).sum(-1),
        1: up.sum(-1).float(),
        2: ((fx * up).sum(-1).double() / fxs).float(),
        3: kept.sum(-1).float(),
        4: torch.stack(median),
    }
    written_by = {0: [0], 1: [1, 2], 2: [1, 2, 3], 3: [1, 2, 3, 4, 5], 4: list(range(6))}
    assert (kept.sum(-1) > 4).all() and (kept.sum(-1) < inb.sum(-1)).any()  # slots drop some
    for rung in range(len(CUT_RUNGS)):
        out = cut_ladder(x, m, b_lo, b_hi, rung, tile=tile)
        for c in written_by[rung]:
            if c == 5:  # the mass median's rank: exp may differ by an ulp from torch's
                got = out[:, 5].long()
                assert ((got - torch.tensor(half_at)).abs() <= 1).all(), (got, half_at)
            else:
                torch.testing.assert_close(out[:, c], want[c], rtol=1e-5, atol=1e-4)
        written = torch.zeros(6, dtype=torch.bool)
        written[written_by[rung]] = True
        assert out[:, ~written].isnan().all()  # poisoned: nothing else written


def test_ladder_refuses_an_unknown_pass(capsys):
    from bench.rejection_ladder import main

    with pytest.raises(SystemExit) as e:
        main(["--passes", "race,sort"])
    assert e.value.code == 2
    assert "--passes 'race,sort'" in capsys.readouterr().err
