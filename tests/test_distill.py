"""The data side of draft training: the shipped prompt list, user turns the target writes
itself (the chat template opened at the user turn, the filter that drops unfinished,
duplicate and held-out-like ones), answer writing under a time budget, the data
options of `specdraft train-draft` and the model card's data section."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdraft import ops
from specdraft.cli import build_parser
from specdraft.data import load_prompts
from specdraft.distill import (
    DROP_REASONS,
    keep_self_prompts,
    user_turn_opener,
    word_ngrams,
    words,
    write_samples,
    write_self_prompts,
)
from specdraft.generate import Engine, GenerationOutput
from specdraft.models.tiny import random_causal_lm, tiny_config
from specdraft.runner import TargetRunner
from specdraft.train_run import fit_samples, write_model_card
from tests import test_prompts as prompt_checks

pytestmark = pytest.mark.no_overflow_check  # see conftest

CFG = tiny_config(num_layers=2, vocab_size=64)


@pytest.fixture(scope="module")
def target():
    return random_causal_lm(CFG, seed=0, dtype=torch.float32, max_positions=128)


def engine_for(target, max_num_reqs: int) -> Engine:
    runner = TargetRunner(target, max_num_reqs=max_num_reqs, max_num_tokens=128, max_model_len=64)
    return Engine(runner)


# ---- the shipped prompt list ----------------------------------------------------------


def test_training_list_is_large_unique_and_shares_no_8gram_with_heldout():
    train, held = load_prompts("train"), load_prompts("heldout")
    assert len(train) >= 1000
    assert len({tuple(words(p)) for p in train}) == len(train), "no two lines with the same words"
    held_grams = set().union(*(word_ngrams(p) for p in held))
    for p in train:
        assert word_ngrams(p) == prompt_checks.ngrams(p), "the same tokenization as test_prompts"
        assert not word_ngrams(p) & held_grams, p
    assert not {tuple(words(p)) for p in train} & {tuple(words(p)) for p in held}


# ---- self-written prompts -------------------------------------------------------------


class _CharTokenizer:
    """A chat template with a default system turn over one id per character."""

    special = {"<s>": 1, "</s>": 2}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "<s>system\nBe brief.</s>\n"
        for m in messages:
            text += f"<s>{m['role']}\n{m['content']}</s>\n"
        return text + ("<s>assistant\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.special if text.startswith(t, i)), None)
            ids.append(self.special[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return ids


def test_user_turn_opener_is_what_the_template_writes_before_the_user():
    tok = _CharTokenizer()
    opener = user_turn_opener(tok)
    assert opener == tok.encode("<s>system\nBe brief.</s>\n<s>user\n")
    full = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}], False))
    assert full[: len(opener)] == opener and full[len(opener) :][:2] == [ord("H"), ord("i")]


def test_user_turn_opener_of_smollm2():
    """With the real tokenizer (when its GGUF is already cached): SmolLM2's template
    adds its default system turn before the user's header."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    pytest.importorskip("gguf")
    from specdraft.embedded import GGUF_NAME, default_cache_dir
    from specdraft.tokenizer import Tokenizer

    path = default_cache_dir() / GGUF_NAME
    if not path.is_file():
        pytest.skip("the SmolLM2 GGUF is not cached here")
    tok = Tokenizer.from_gguf(path)
    text = tok.decode(user_turn_opener(tok))
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_end|>\n<|im_start|>user\n"
    )


def out(ids, reason="stop"):
    return GenerationOutput([1], list(ids), None, reason)


def decode_words(ids):
    """Token t < 30 is the word w<t>, t in 30..39 punctuation."""
    return " ".join(f"w{t}" if t < 30 else "!?.,;:-()'"[t - 30] for t in ids)


def test_keep_self_prompts_drops_each_kind():
    stop, special = 50, 51
    held = ["w3 w4", "w1 w2 w3 w4 w5 w6 w7 w8 w9"]
    outputs = [
        out([5, 6, stop]),  # kept
        out([5, 6, 7], "length"),  # unfinished: cut at the limit
        out([5, 6], "stop"),  # unfinished: no stop token at the end
        out([5, special, 6, stop]),  # another special token inside
        out([5, stop, 6, stop]),  # a stop token inside
        out([30, 31, stop]),  # empty: punctuation only
        out([stop]),  # empty
        out([5, 6, 32, stop]),  # duplicate words of the first ("w5 w6 .")
        out([10, 11, stop]),  # duplicate of a known (listed) prompt
        out([3, 4, stop]),  # the words of a held-out prompt
        out([0, 1, 2, 3, 4, 5, 6, 7, 8, 20, stop]),  # an 8-gram of a held-out prompt
        out([1, 2, 3, 4, 5, 6, 7, 20, stop]),  # seven shared words only: kept
        out([12, stop]),  # kept
    ]
    kept, dropped = keep_self_prompts(
        outputs,
        decode_words,
        stop_ids=[stop],
        special_ids=[special],
        known=["W10, w11!"],
        heldout=held,
    )
    assert kept == ["w5 w6", "w1 w2 w3 w4 w5 w6 w7 w20", "w12"]
    assert dropped == dict(unfinished=2, special=2, empty=2, duplicate=2, heldout=2)
    assert tuple(dropped) == DROP_REASONS


def test_self_prompts_on_a_tiny_target_are_sampled_and_filtered(target):
    """The opener continued at T = 1 with distinct seeds through the batched Engine,
    then filtered: every output is kept or dropped for one reason, the unfinished ones
    are those cut at the limit, and no kept text repeats."""
    stops = list(range(0, 64, 5))  # about one token in five ends a turn
    with ops.use_backend("torch"):
        outs = write_self_prompts(
            engine_for(target, 8), [7, 8, 9], 16, max_new_tokens=6, seed=3, stop_token_ids=stops
        )
        again = write_self_prompts(
            engine_for(target, 4), [7, 8, 9], 16, max_new_tokens=6, seed=3, stop_token_ids=stops
        )
    assert len(outs) == 16 and all(o.prompt_token_ids == [7, 8, 9] for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again], "seeded"
    assert len({tuple(o.token_ids) for o in outs}) > 8, "distinct seeds, distinct turns"
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert 0 < len(finished) < 16
    assert all(o.token_ids[-1] in stops for o in finished)
    assert all(len(o.token_ids) == 6 for o in outs if o.finish_reason == "length")
    kept, dropped = keep_self_prompts(
        outs + outs[:3], lambda ids: " ".join(f"w{t}" for t in ids), stop_ids=stops
    )
    assert len(kept) + sum(dropped.values()) == 19
    assert dropped["unfinished"] == 16 - len(finished) + sum(
        o.finish_reason != "stop" for o in outs[:3]
    )
    assert len(set(kept)) == len(kept) and dropped["duplicate"] >= 1


def test_time_budget_stops_starting_self_prompts(target):
    """A clock that moves one second per reading: the first fill (every row and one
    more waiting) and the turns started before max_seconds come back, finished."""
    ticks = itertools.count()
    with ops.use_backend("torch"):
        outs = write_self_prompts(
            engine_for(target, 2),
            [7, 8],
            20,
            max_new_tokens=4,
            max_seconds=3,
            clock=lambda: next(ticks),
        )
    assert 3 <= len(outs) < 20
    assert all(len(o.token_ids) == 4 or o.finish_reason == "stop" for o in outs)


def test_bad_self_prompt_count(target):
    with pytest.raises(ValueError, match="n must be"):
        write_self_prompts(engine_for(target, 2), [1], 0)


# ---- answers under a time budget ------------------------------------------------------


@pytest.mark.parametrize("max_seconds, phase", [(4, "greedy"), (12, "sampled")])
def test_time_budget_stops_answering_new_prompts(target, max_seconds, phase):
    """A clock that moves one second per reading: the greedy answers to every prompt
    come first, then each prompt's samples together; after max_seconds nothing new is
    queued and what was queued is finished: the result is a prefix of the full plan."""
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(12)]
    kw = dict(samples_per_prompt=2, max_new_tokens=8, seed=1)
    with ops.use_backend("torch"):
        full = write_samples(engine_for(target, 4), prompts, **kw)
        ticks = itertools.count()
        cut = write_samples(
            engine_for(target, 4), prompts, max_seconds=max_seconds, clock=lambda: next(ticks), **kw
        )
    plan = [(i, None) for i in range(12)] + [(i, "s") for i in range(12) for _ in range(2)]
    assert [(s.prompt_index, s.seed and "s") for s in full] == plan
    assert len({s.seed for s in full}) == 25, "distinct seeds for the sampled answers"
    assert 4 <= len(cut) < len(full)
    assert [(s.prompt_index, s.seed) for s in cut] == [
        (s.prompt_index, s.seed) for s in full[: len(cut)]
    ], "a prefix of the same plan, seeds included"
    assert (len(cut) <= 12) == (phase == "greedy")
    assert (len(cut) - 12) % 2 == 0 or phase == "greedy", "a prompt's samples together"
    assert all(len(s.tokens) == s.prompt_len + 8 for s in cut), "queued answers finished"


def test_no_budget_left_still_answers_the_first_fill(target):
    """max_seconds 0: the first fill (every row, and one prompt more waiting) only."""
    prompts = [[1 + i, 2] for i in range(6)]
    with ops.use_backend("torch"):
        got = write_samples(engine_for(target, 2), prompts, samples_per_prompt=0, max_seconds=0)
    assert [s.prompt_index for s in got] == [0, 1, 2]


def test_answers_are_clipped_to_the_model_length(target):
    """An answer that would run past max_model_len (64) gets fewer new tokens."""
    with ops.use_backend("torch"):
        got = write_samples(
            engine_for(target, 2), [list(range(1, 61))], samples_per_prompt=0, max_new_tokens=32
        )
    assert len(got) == 1 and len(got[0].tokens) == 64


def test_nothing_to_write_is_refused(target):
    with pytest.raises(ValueError, match="no samples"):
        write_samples(engine_for(target, 2), [[1, 2]], samples_per_prompt=0, greedy=False)
    with pytest.raises(ValueError, match="no samples"):
        write_samples(engine_for(target, 2), [], samples_per_prompt=1)


def test_fit_samples_keeps_the_prefix_that_fits():
    from specdraft.distill import Sample

    samples = [Sample(i, [1] * 10, 2, None) for i in range(5)]
    assert fit_samples(samples, 35) == samples[:3]
    assert fit_samples(samples, 50) == samples and fit_samples(samples, 9) == []


# ---- the command's data options and the model card ------------------------------------


def test_train_draft_data_defaults():
    args = build_parser().parse_args(["train-draft"])
    assert (args.samples_per_prompt, args.temperature, args.no_greedy) == (1, 0.7, False)
    assert args.self_prompts > 0 and args.self_prompt_tokens == 64
    assert args.data_minutes * 60 + args.eval_reserve_s < args.max_minutes * 60
    assert args.epochs == 10


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--data-minutes", "8"], "leave no time to train"),
        (["--data-minutes", "0"], "--data-minutes"),
        (["--self-prompts", "-1"], "--self-prompts"),
        (["--self-prompt-tokens", "0"], "--self-prompt-tokens"),
    ],
)
def test_bad_data_options_are_refused_before_any_work(tmp_path, argv, word):
    from specdraft.cli import main

    with pytest.raises(SystemExit, match=word):
        main(["train-draft", "--out", str(tmp_path / "out"), "--device", "cpu", *argv])
    assert not (tmp_path / "out").exists()


def report(**data):
    base = dict(
        prompts=1235,
        samples_per_prompt=1,
        temperature=0.7,
        greedy=True,
        max_new_tokens=384,
        sequences=100,
        tokens=20000,
        answer_tokens=15000,
        seconds=100.0,
        feature_seconds=2.0,
    )
    return {
        "target": dict(name="tiny", file="-", dtype="float32", hidden_size=64, vocab_size=64),
        "device": "CPU",
        "data": {**base, **data},
        "training": dict(steps=1, seconds=1.0, config={}, final={}),
        "evaluation": dict(
            head="head", prompts=21, max_new_tokens=128, target_tokens_per_s=1.0, rows=[]
        ),
        "command": "specdraft train-draft",
    }


def test_model_card_describes_the_data(tmp_path):
    r = report(
        self_prompts=dict(
            requested=6000,
            written=5000,
            temperature=1.0,
            max_new_tokens=64,
            kept=4012,
            dropped=dict(unfinished=1900, special=3, empty=5, duplicate=70, heldout=10),
        ),
        prompts_answered=3000,
        listed_answered=1235,
        self_answered=1765,
        budget_cut=True,
        data_budget_s=120.0,
        answer_tokens_per_s=25000.0,
        greedy_answers=2000,
        sampled_answers=1000,
    )
    text = write_model_card(tmp_path / "card.md", r).read_text()
    for part in (
        "1235 prompts from specdraft's shipped training list",
        "4012 user turns the target wrote itself",
        "5000 sampled (of 6000 asked for: the time budget ended the writing) at temperature 1.0",
        "1900 unfinished",
        "10 heldout",
        "answered: 3000 prompts (1235 listed, 1765 self-written)",
        "the data time budget (120 s) ended the writing",
        "asked per prompt: the greedy answer and 1 sampled at temperature 0.7",
        "answers: 2000 greedy and 1000 sampled",
        "100 sequences, 20000 tokens (15000 answer tokens)",
        "25000 answer tokens/s",
    ):
        assert part in text, part
    plain = write_model_card(tmp_path / "plain.md", report()).read_text()
    assert "wrote itself" not in plain and "time budget" not in plain
    assert "answered: 1235 prompts (1235 listed, 0 self-written)" in plain


class _WordTokenizer:
    """For the tiny target (64 ids): 0 opens a turn, 1..8 end one, 9.. are words w9.."""

    stop_token_ids = tuple(range(1, 9))
    special_ids = frozenset(range(9))

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<s> {m['role']} {m['content']} </s> " for m in messages)
        return text + ("<s> assistant " if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        names = {"<s>": 0, "</s>": 1, "user": 9, "assistant": 10}
        return [names[w] if w in names else int(w[1:]) for w in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{t}" for t in ids if t >= 9 or not skip_special_tokens)

    def stream_decoder(self):
        class _Quiet:
            def push(self, ids):
                return ""

            def flush(self):
                return ""

        return _Quiet()


def test_train_run_drops_self_written_prompts_like_listed_or_heldout_ones(target):
    """train_run's self-prompt step on the tiny target: the same seeds write the same
    turns; given one of them as a listed prompt and another inside a held-out prompt
    (an 8-gram shared, the words not equal), the second run drops exactly those."""
    from argparse import Namespace

    from specdraft.train_run import _write_self_prompts

    tok = _WordTokenizer()
    args = Namespace(self_prompts=24, self_prompt_tokens=20, seed=0)

    def run(listed, heldout):
        runner = TargetRunner(target, max_num_reqs=8, max_num_tokens=128, max_model_len=64)
        with ops.use_backend("torch"):
            return _write_self_prompts(Engine(runner, tok), tok, args, listed, heldout)

    first = run([], [])
    texts = first["texts"]
    assert first["written"] == 24 and len(texts) + sum(first["dropped"].values()) == 24
    long = next(t for t in texts if len(t.split()) >= 8)
    short = next(t for t in texts if t != long)
    second = run([short.upper()], [f"Please {long} now"])
    assert set(second["texts"]) == set(texts) - {short, long}
    assert second["dropped"]["duplicate"] >= 1 and second["dropped"]["heldout"] >= 1
