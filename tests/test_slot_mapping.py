"""Slot mapping against the Python reference: every token of out[:num_tokens] written,
padding and out-of-table positions -1, out[num_tokens:] untouched, int64 slots, and one
captured launch replayed with new contents (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.kernels import compute_slot_mapping
from tests.reference import slot_mapping_ref

POISON = -7
EXTRA = 5  # entries of positions / out past num_tokens, which must stay untouched


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(
    q_lens: list[int],
    block_size: int,
    *,
    pad_reqs: int,
    pad_tokens: int,
    device: str,
    rng: random.Random,
    max_ctx: int = 300,
) -> dict:
    """A batch whose requests own random, permuted block ids; context lengths are random,
    so positions are rarely block-aligned. Padded tokens carry positions that would map
    to valid slots if a kernel mistook them for real ones."""
    ctx = [rng.randint(0, max_ctx) for _ in q_lens]
    total = sum(q_lens)
    num_tokens = total + pad_tokens
    num_rows = len(q_lens) + pad_reqs + 1  # one spare row past num_reqs
    width = max([cdiv(c + q, block_size) for c, q in zip(ctx, q_lens)], default=1) + 1
    num_blocks = num_rows * width + 7
    table = torch.randperm(num_blocks)[: num_rows * width].view(num_rows, width)
    positions = [rng.randrange(width * block_size) for _ in range(num_tokens + EXTRA)]
    qsl, t = [0], 0
    for c, q in zip(ctx, q_lens):
        positions[t : t + q] = range(c, c + q)
        t += q
        qsl.append(t)
    qsl += [total] * pad_reqs
    return dict(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_table=table.to(torch.int32).to(device),
        block_size=block_size,
        out=torch.full((num_tokens + EXTRA,), POISON, dtype=torch.int64, device=device),
        num_tokens=num_tokens,
    )


def run_and_check(args: dict) -> torch.Tensor:
    out, n = args["out"], args["num_tokens"]
    out.fill_(POISON)
    compute_slot_mapping(**args)
    ref = slot_mapping_ref(
        args["positions"], args["query_start_loc"], args["block_table"], args["block_size"], n
    )
    assert (out[:n] != POISON).all(), "some token was not written"
    assert torch.equal(out[:n], ref)
    assert (out[n:] == POISON).all(), "wrote past num_tokens"
    return ref


def q_lens_for(kind: str, num_reqs: int, rng: random.Random) -> list[int]:
    if kind == "decode":
        return [1] * num_reqs
    if kind == "multi":  # verification / draft prefill: K + 1 tokens per request
        return [5] * num_reqs
    # mixed: empty, decode, short multi-token and one prefill longer than a chunk
    lens = [rng.choice([0, 1, 1, 3, 8]) for _ in range(num_reqs)]
    lens[rng.randrange(num_reqs)] = 150
    return lens


@pytest.mark.parametrize("num_reqs", [1, 6, 42])
@pytest.mark.parametrize("kind", ["decode", "multi", "mixed"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("pad_reqs, pad_tokens", [(0, 0), (3, 0), (2, 70)])
def test_matches_reference(device, num_reqs, kind, block_size, pad_reqs, pad_tokens):
    rng = random.Random(f"{num_reqs}-{kind}-{block_size}-{pad_reqs}-{pad_tokens}")
    q_lens = q_lens_for(kind, num_reqs, rng)
    args = make_case(
        q_lens, block_size, pad_reqs=pad_reqs, pad_tokens=pad_tokens, device=device, rng=rng
    )
    ref = run_and_check(args)
    # the test can fail: real tokens got real slots, padded ones -1
    total = sum(q_lens)
    assert (ref[:total] >= 0).all() and (ref[total:] == -1).all()


def test_block_size_one_and_256(device):
    rng = random.Random(0)
    for block_size in (1, 256):
        run_and_check(
            make_case([3, 1, 9], block_size, pad_reqs=1, pad_tokens=4, device=device, rng=rng)
        )


def test_slots_past_2_31_use_int64(device):
    rng = random.Random(1)
    args = make_case([4, 1, 2], 256, pad_reqs=0, pad_tokens=2, device=device, rng=rng)
    bt = args["block_table"]
    big = torch.tensor([2**31 - 1, 2**30 + 3, 2**24 + 1], dtype=torch.int32)
    bt.copy_(big[torch.randint(0, 3, bt.shape)])
    ref = run_and_check(args)
    assert ref.max().item() > 2**31 * 64


def test_out_of_table_positions_get_minus_one(device):
    rng = random.Random(2)
    bs = 16
    args = make_case([6, 3], bs, pad_reqs=0, pad_tokens=0, device=device, rng=rng)
    width = args["block_table"].shape[1]
    pos = args["positions"]
    pos[0] = width * bs  # first position past the table
    pos[1] = width * bs - 1  # last position inside it
    pos[2] = -1
    pos[3] = 2**40
    pos[6] = -(2**40)
    pos[7] = 5
    args["block_table"][1, 0] = -1  # a negative block id writes nothing either
    ref = run_and_check(args)
    assert ref[[0, 2, 3, 6, 7]].tolist() == [-1] * 5
    assert ref[1].item() == args["block_table"][0, width - 1].item() * bs + bs - 1


def test_empty_rows_padding_only_and_zero_tokens(device):
    rng = random.Random(3)
    # zero-length real requests between non-empty ones
    run_and_check(
        make_case([0, 2, 0, 0, 7, 0], 16, pad_reqs=0, pad_tokens=1, device=device, rng=rng)
    )
    # no request at all: every token is padding
    args = make_case([], 16, pad_reqs=0, pad_tokens=9, device=device, rng=rng)
    assert torch.equal(run_and_check(args), torch.full((9,), -1, dtype=torch.int64, device=device))
    # only padded requests
    args = make_case([0, 0, 0], 32, pad_reqs=2, pad_tokens=66, device=device, rng=rng)
    run_and_check(args)
    # a table with no columns maps everything to -1
    args = make_case([2, 3], 16, pad_reqs=0, pad_tokens=1, device=device, rng=rng)
    args["block_table"] = args["block_table"][:, :0]
    assert (run_and_check(args) == -1).all()
    # num_tokens == 0 launches nothing
    args = make_case([2], 16, pad_reqs=0, pad_tokens=0, device=device, rng=rng)
    args["out"].fill_(POISON)
    compute_slot_mapping(**{**args, "num_tokens": 0})
    assert (args["out"] == POISON).all()


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("width", [5, 40])
def test_gather_rows_then_map(device, kind, width):
    """With rows / row_slots the launch copies each request's persistent row into the
    step table (padded requests get the null row) and maps slots from it; table rows
    past num_reqs stay as they were."""
    rng = random.Random(f"gather-{kind}-{width}")
    num_reqs, pad_reqs, bs = 9, 3, 16
    q_lens = q_lens_for(kind, num_reqs, rng)
    q_lens = [min(q, width * bs // 2) for q in q_lens]
    args = make_case(q_lens, bs, pad_reqs=pad_reqs, pad_tokens=7, device=device, rng=rng)
    n_rows = 20  # persistent rows; the last one is the null row
    rows = torch.randint(1, 5000, (n_rows, width), dtype=torch.int32)
    rows[-1] = 0
    picked = rng.sample(range(n_rows - 1), num_reqs) + [n_rows - 1] * pad_reqs
    row_slots = torch.tensor(picked, dtype=torch.int64)
    total = sum(q_lens)
    pos = args["positions"]
    qsl = args["query_start_loc"].tolist()
    for r, q in enumerate(q_lens):  # positions inside each row's width
        ctx = rng.randint(0, width * bs - q)
        pos[qsl[r] : qsl[r] + q] = torch.arange(ctx, ctx + q)
    table = torch.full((num_reqs + pad_reqs + 2, width), POISON, dtype=torch.int32)
    table, rows, row_slots = (x.to(device) for x in (table, rows, row_slots))
    out = args["out"].fill_(POISON)
    n = args["num_tokens"]
    compute_slot_mapping(
        pos, args["query_start_loc"], table, bs, out, n, rows=rows, row_slots=row_slots
    )
    r_all = num_reqs + pad_reqs
    assert torch.equal(table[:r_all], rows[row_slots])
    assert (table[r_all:] == POISON).all(), "wrote table rows past num_reqs"
    ref = slot_mapping_ref(pos, args["query_start_loc"], rows[row_slots], bs, n)
    assert torch.equal(out[:n], ref) and (out[n:] == POISON).all()
    assert (ref[:total] >= 0).all() and (ref[total:] == -1).all()


@pytest.mark.parametrize(
    "extra, exc, words",
    [
        ({"rows": "r"}, ValueError, "rows and row_slots go together"),
        ({"rows": "r", "row_slots": "s32"}, TypeError, "row_slots must have dtype"),
        ({"rows": "narrow", "row_slots": "s"}, ValueError, "rows has 3 columns"),
        ({"rows": "r", "row_slots": "short"}, ValueError, "row_slots has 1 entries"),
    ],
)
def test_gather_bad_input_writes_nothing(device, extra, exc, words):
    rng = random.Random(9)
    args = make_case([3, 1, 4], 16, pad_reqs=0, pad_tokens=2, device=device, rng=rng)
    width = args["block_table"].shape[1]
    made = {
        "r": torch.ones(4, width, dtype=torch.int32, device=device),
        "narrow": torch.ones(4, 3, dtype=torch.int32, device=device),
        "s": torch.zeros(3, dtype=torch.int64, device=device),
        "s32": torch.zeros(3, dtype=torch.int32, device=device),
        "short": torch.zeros(1, dtype=torch.int64, device=device),
    }
    before = (args["out"].clone(), args["block_table"].clone())
    with pytest.raises(exc, match=words):
        compute_slot_mapping(**args, **{k: made[v] for k, v in extra.items()})
    assert torch.equal(args["out"], before[0]) and torch.equal(args["block_table"], before[1])


def test_lengths_past_num_tokens_never_write_out_of_range(device):
    """query_start_loc claiming more tokens than num_tokens: the writes stop at num_tokens."""
    rng = random.Random(4)
    args = make_case([5, 9, 4], 16, pad_reqs=0, pad_tokens=0, device=device, rng=rng)
    run_and_check({**args, "num_tokens": 11})


def test_same_buffers_new_contents(device):
    """One set of buffers and one launch shape, refilled with different batches."""
    replay_with_new_contents(device, num_replays=4, graph=False)


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (lambda a: {"positions": a["positions"].int()}, TypeError, "positions must have dtype"),
        (lambda a: {"positions": a["positions"][None]}, ValueError, "positions must have 1"),
        (lambda a: {"positions": a["positions"][::2]}, ValueError, "positions must be contig"),
        (lambda a: {"positions": a["positions"][:4]}, ValueError, "positions.numel"),
        (lambda a: {"positions": [0, 1, 2]}, TypeError, "positions must be a torch.Tensor"),
        (lambda a: {"query_start_loc": a["query_start_loc"].long()}, TypeError, "query_start_l"),
        (lambda a: {"query_start_loc": a["query_start_loc"][:0]}, ValueError, "query_start_loc"),
        (lambda a: {"block_table": a["block_table"].long()}, TypeError, "block_table"),
        (lambda a: {"block_table": a["block_table"][0]}, ValueError, "block_table must have 2"),
        (lambda a: {"block_table": a["block_table"][:1]}, ValueError, "block_table has 1 rows"),
        (lambda a: {"block_table": a["block_table"][:, ::2]}, ValueError, "contiguous"),
        (lambda a: {"out": a["out"].int()}, TypeError, "out must have dtype"),
        (lambda a: {"out": a["out"][:6]}, ValueError, "out has 6 entries"),
        (lambda a: {"block_size": 24}, ValueError, "block_size must be a power of two"),
        (lambda a: {"block_size": 0}, ValueError, "block_size"),
        (lambda a: {"block_size": 512}, ValueError, "block_size"),
        (lambda a: {"block_size": 16.0}, TypeError, "block_size must be an int"),
        (lambda a: {"num_tokens": -1}, ValueError, "num_tokens"),
        (lambda a: {"num_tokens": 10**6}, ValueError, "num_tokens"),
        (lambda a: {"num_tokens": 3.0}, TypeError, "num_tokens must be an int"),
        (lambda a: {"block_table": a["block_table"].to("meta")}, ValueError, "block_table is on"),
        (lambda a: {"positions": a["positions"].to("meta")}, ValueError, "positions is on"),
    ],
)
def test_bad_input_raises_and_writes_nothing(device, change, exc, words):
    rng = random.Random(5)
    args = make_case([3, 1, 4], 16, pad_reqs=0, pad_tokens=2, device=device, rng=rng)
    out = args["out"]
    before = out.clone()
    args.update(change(args))
    with pytest.raises(exc, match=words):
        compute_slot_mapping(**args)
    assert torch.equal(out, before)


def replay_with_new_contents(device: str, *, num_replays: int, graph: bool) -> None:
    """Persistent buffers sized for one descriptor (max_reqs, max_tokens). Each round
    copies a new batch INTO them (fewer real requests and tokens, the rest padded), then
    runs the launch (eagerly, or by replaying one captured graph) and checks it."""
    max_reqs, max_tokens, bs, width = 16, 96, 16, 64
    pos_buf = torch.zeros(max_tokens + EXTRA, dtype=torch.int64, device=device)
    qsl_buf = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
    bt_buf = torch.zeros(max_reqs, width, dtype=torch.int32, device=device)
    out_buf = torch.full((max_tokens + EXTRA,), POISON, dtype=torch.int64, device=device)
    rng = random.Random(6)

    def fill(num_reqs: int) -> None:
        q_lens = [rng.randint(0, 5) for _ in range(num_reqs)]  # at most 80 < max_tokens
        args = make_case(
            q_lens, bs, pad_reqs=max_reqs - num_reqs, pad_tokens=0, device=device, rng=rng
        )
        total = sum(q_lens)
        pos = torch.randint(0, width * bs, (max_tokens + EXTRA,), device=device)
        pos[:total] = args["positions"][:total]
        pos[total] = width * bs + 3  # garbage in the padded tail
        pos_buf.copy_(pos)
        qsl_buf.copy_(args["query_start_loc"])
        bt = args["block_table"]
        bt_buf.zero_()
        bt_buf[:, : bt.shape[1]].copy_(bt[:max_reqs])
        out_buf.fill_(POISON)

    def step() -> None:
        compute_slot_mapping(pos_buf, qsl_buf, bt_buf, bs, out_buf, max_tokens)

    def check() -> None:
        ref = slot_mapping_ref(pos_buf, qsl_buf, bt_buf, bs, max_tokens)
        assert (out_buf[:max_tokens] != POISON).all()
        assert torch.equal(out_buf[:max_tokens], ref)
        assert (out_buf[max_tokens:] == POISON).all()

    fill(max_reqs)
    step()  # compiles and warms up outside any capture
    check()
    g = None
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    for num_reqs in [1, 3, 16, 7, 12, 5][:num_replays]:
        fill(num_reqs)
        if g is None:
            step()
        else:
            g.replay()
            torch.cuda.synchronize()
        check()


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_contents():
    replay_with_new_contents("cuda", num_replays=6, graph=True)
