"""Draft-head training: the dense target forward equals specdraft's model, a tiny run
lowers the loss, the saved head loads into EagleHead with the training module's outputs
(unrolled steps included, against the paged cache's draft steps), the PNG writer, and
bad arguments of the training entry point."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from specdraft import ops
from specdraft.batch import ScheduledBatch
from specdraft.dense import target_hidden
from specdraft.distill import DistillSet, Sample, write_samples
from specdraft.generate import Engine
from specdraft.loader import load_draft
from specdraft.models.eagle import EagleHead
from specdraft.models.tiny import random_causal_lm, tiny_config
from specdraft.png import PNG_SIGNATURE, encode_png, write_loss_png
from specdraft.runner import TargetRunner
from specdraft.train import EagleTrainHead, TrainConfig, train_eagle_head
from tests.model_helpers import PagedRunner, rel_err

CFG = tiny_config(num_layers=3, vocab_size=128)


@pytest.fixture(scope="module")
def target():
    return random_causal_lm(CFG, seed=0, dtype=torch.float32, max_positions=128)


@pytest.fixture(scope="module")
def data(target):
    """The tiny target's own answers (greedy + 2 samples) to 8 random prompts."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in range(4, 12)]
    with ops.use_backend("torch"):
        runner = TargetRunner(target, max_num_reqs=8, max_num_tokens=128, max_model_len=128)
        samples = write_samples(
            Engine(runner), prompts, samples_per_prompt=2, max_new_tokens=24, seed=5
        )
    assert len(samples) == 8 * 3
    assert all(len(s.tokens) == s.prompt_len + 24 for s in samples)
    sampled = [s.tokens for s in samples if s.prompt_index == 0]
    assert len({tuple(t) for t in sampled}) > 1, "samples of one prompt differ"
    return DistillSet.from_samples(target, samples, batch_tokens=100)


def test_dense_forward_matches_the_runtime(target):
    """Final hidden states (after the final norm: what the runner keeps for EAGLE-1)
    from the dense padded forward against a prefill through the paged cache."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (13, 5, 30)]
    with ops.use_backend("torch"):
        runner = TargetRunner(target, max_num_reqs=4, max_num_tokens=128, max_model_len=64)
        runner.keep_features()
        for rid, s in enumerate(seqs):
            runner.tables.add_request(rid, len(s))
        runner.execute(
            ScheduledBatch.from_requests([(i, s, 0) for i, s in enumerate(seqs)]),
            greedy=True,
            features=True,
        )
        want = runner.last_features.split([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), 30, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    got = target_hidden(target, ids)
    for i, s in enumerate(seqs):
        assert rel_err(got[i, : len(s)], want[i]) < 1e-5


def test_distill_set_features_are_the_dense_forward(target, data):
    ids, feats, lengths, prompt_lens = data.batch(torch.tensor([0, 5]))
    for r in range(2):
        n = int(lengths[r])
        want = target_hidden(target, ids[r : r + 1, :n])[0]
        assert torch.equal(feats[r, :n], want)
        assert not feats[r, n:].any()
    assert data.num_answer_tokens == 24 * len(data)


def test_tiny_run_lowers_the_loss_and_loads_into_eagle_head(target, data, tmp_path):
    cfg = TrainConfig(steps=60, batch_size=6, lr=3e-3, warmup_steps=5, save_dtype="float32")
    res = train_eagle_head(target, data, tmp_path / "head", cfg)
    losses = [r["loss"] for r in res.history]
    assert len(losses) == 60 and np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5])
    assert (tmp_path / "head" / "loss.png").exists() is False  # the CLI draws it
    for name in ("config.json", "model.safetensors", "train_state.pt", "train_log.json"):
        assert (tmp_path / "head" / name).is_file(), name

    head = load_draft(tmp_path / "head", target=target)
    assert isinstance(head, EagleHead) and head.fc.bias is not None
    trained = EagleTrainHead(target)
    state = torch.load(tmp_path / "head" / "train_state.pt", weights_only=False)["head"]
    trained.load_state_dict(state)
    check_against_paged_steps(trained, head, data)


def check_against_paged_steps(trained, head, data, n: int = 9):
    """Rows 0 .. n - 1 prefilled with the target's features, then two draft steps
    feeding back the head's own output: they are unrolled steps 1 and 2 of training."""
    ids, feats, lengths, _ = data.batch(torch.tensor([1]))
    ids_next, inputs = ids[:, 1 : n + 3], feats[:, : n + 2]
    with torch.no_grad():
        outs = trained(ids_next, inputs, steps=3)
    with ops.use_backend("torch"), torch.no_grad():
        runner = PagedRunner(head.cfg, "cpu", dtype=torch.float32, max_model_len=64)
        meta = runner.step([("r", ids_next[0, :n].tolist())])
        got, _ = head(meta.input_ids, inputs[0, :n].contiguous(), meta, runner.cache)
        assert rel_err(got, outs[0][0, :n]) < 1e-5
        fed = outs[0][0, n - 1 : n]
        for s in (1, 2):
            meta = runner.step([("r", [int(ids_next[0, n + s - 1])])])
            fed, _ = head(meta.input_ids, fed.contiguous(), meta, runner.cache)
            assert rel_err(fed[0], outs[s][0, n + s - 1]) < 1e-5, f"unrolled step {s}"


def test_a_two_layer_head_loads_with_identical_outputs(target, data, tmp_path):
    """--head-layers 2: the saved checkpoint builds a two-layer EagleHead (layer 1 with
    its input norm) whose prefill and draft steps equal the training module's."""
    cfg = TrainConfig(steps=3, batch_size=4, save_dtype="float32", head_layers=2)
    train_eagle_head(target, data, tmp_path, cfg)
    head = load_draft(tmp_path, target=target)
    assert isinstance(head, EagleHead) and len(head.layers) == 2
    trained = EagleTrainHead(target, num_layers=2)
    trained.load_state_dict(torch.load(tmp_path / "train_state.pt", weights_only=False)["head"])
    check_against_paged_steps(trained, head, data)


def test_resume_continues_from_the_saved_step(target, data, tmp_path):
    cfg = TrainConfig(steps=4, batch_size=4, save_every=2, save_dtype="float32")
    first = train_eagle_head(target, data, tmp_path, cfg)
    more = train_eagle_head(target, data, tmp_path, TrainConfig(**{**cfg.__dict__, "steps": 6}))
    assert first.steps == 4 and more.steps == 6
    assert [r["step"] for r in more.history] == [1, 2, 3, 4, 5, 6]
    assert more.history[:4] == first.history


def test_time_budget_stops_the_loop(target, data, tmp_path):
    cfg = TrainConfig(steps=10_000, batch_size=2, max_seconds=0.5, save_dtype="float32")
    res = train_eagle_head(target, data, tmp_path, cfg)
    assert 0 < res.steps < 10_000 and (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "change, error, word",
    [
        (dict(target="model"), TypeError, "target"),
        (dict(data=[1, 2]), TypeError, "data"),
        (dict(config={"steps": 3}), TypeError, "config"),
        (dict(out_dir=3), TypeError, "out_dir"),
    ],
)
def test_bad_arguments_write_nothing(target, data, tmp_path, change, error, word):
    args = dict(target=target, data=data, out_dir=tmp_path / "out", config=TrainConfig(steps=1))
    args.update(change)
    with pytest.raises(error, match=word):
        train_eagle_head(**args)
    assert not (tmp_path / "out").exists()


def test_data_for_another_target_writes_nothing(data, tmp_path):
    other = random_causal_lm(tiny_config(hidden_size=32, num_heads=2, head_dim=16), seed=1)
    with pytest.raises(ValueError, match="hidden_size"):
        train_eagle_head(other, data, tmp_path / "out", TrainConfig(steps=1))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kw, error, word",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(steps=2.5), TypeError, "steps"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(ttt_steps=True), TypeError, "ttt_steps"),
        (dict(cls_weight=float("nan")), TypeError, "cls_weight"),
        (dict(save_dtype="int8"), ValueError, "save_dtype"),
        (dict(max_seconds=0), ValueError, "max_seconds"),
        (dict(head_layers=0), ValueError, "head_layers"),
    ],
)
def test_bad_config(kw, error, word):
    with pytest.raises(error, match=word):
        TrainConfig(**kw)


def test_distill_set_refuses_short_samples(target):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        DistillSet.from_samples(target, [Sample(0, [5], 1, None)])


def decode_png(data: bytes) -> np.ndarray:
    """A minimal decoder for what encode_png writes: chunks with their CRCs, IHDR,
    the IDAT stream, filter type 0 on every row."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF, kind
        chunks.append((kind, payload))
        pos += 12 + n
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(h, 1 + 3 * w)
    assert not raw[:, 0].any()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trip(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(encode_png(pixels)), pixels)
    path = write_loss_png(tmp_path / "loss.png", [3.0 / (1 + i) + 0.1 * (i % 3) for i in range(50)])
    img = decode_png(path.read_bytes())
    assert img.shape == (400, 720, 3)
    dark = (img == (20, 60, 160)).all(-1)
    assert dark.sum() > 100, "the smoothed curve is drawn"
    cols = np.nonzero(dark.any(0))[0]
    assert cols.max() - cols.min() > 500, "it spans the plot"
    with pytest.raises(TypeError, match="uint8"):
        encode_png(pixels.astype(np.float32))
    with pytest.raises(ValueError, match="empty"):
        write_loss_png(tmp_path / "x.png", [])


def test_evaluation_and_model_card(target, data, tmp_path):
    """The CLI's tail on the tiny target: a real speculative evaluation of the trained
    head (greedy output identical to target-only) and the model card from its report."""
    from specdraft.loader import load_draft
    from specdraft.train_run import EvalRow, evaluate_drafts, write_model_card

    cfg = TrainConfig(steps=3, batch_size=4, save_dtype="float32")
    res = train_eagle_head(target, data, tmp_path, cfg)
    head = load_draft(tmp_path, target=target)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    with ops.use_backend("torch"):
        runner = TargetRunner(target, max_num_reqs=4, max_num_tokens=64, max_model_len=64)
        tok_s, rows = evaluate_drafts(
            runner, None, prompts, {"head": head}, ks=(1, 3), max_new_tokens=10
        )
    assert tok_s > 0 and [r.k for r in rows] == [1, 3]
    assert all(r.identical and 1 <= r.acceptance_length <= r.k + 1 for r in rows)
    assert len(rows[1].per_position) == 3
    report = {
        "target": dict(name="tiny", file="-", dtype="float32", hidden_size=64, vocab_size=128),
        "device": "CPU",
        "data": dict(
            prompts=8,
            samples_per_prompt=2,
            temperature=1.0,
            greedy=True,
            max_new_tokens=24,
            sequences=len(data),
            tokens=data.num_tokens,
            answer_tokens=data.num_answer_tokens,
            seconds=1.0,
            feature_seconds=0.1,
        ),
        "training": dict(steps=res.steps, seconds=res.seconds, config={}, final=res.final),
        "evaluation": dict(
            head="head",
            prompts=2,
            max_new_tokens=10,
            target_tokens_per_s=tok_s,
            rows=[r.__dict__ for r in rows],
        ),
        "command": "specdraft train-draft",
    }
    text = write_model_card(tmp_path / "MODEL_CARD.md", report).read_text()
    al = next(r for r in rows if r.k == 3).acceptance_length
    assert f"Acceptance length at k = 3: **{al:.3f}**" in text
    assert "Apache-2.0" in text and f"{data.num_answer_tokens} answer tokens" in text
    assert isinstance(rows[0], EvalRow)


def test_shipped_draft_path_and_ship_refusal(tmp_path):
    from specdraft.embedded import shipped_draft_path
    from specdraft.train_run import ship

    path = shipped_draft_path()
    assert path is None or {"config.json", "model.safetensors"} <= {p.name for p in path.iterdir()}
    with pytest.raises(ValueError, match="lacks"):
        ship(tmp_path)
