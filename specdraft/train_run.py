"""`specdraft train-draft`: the whole self-distillation run for the embedded target
(SmolLM2-135M-Instruct from its GGUF, or a GGUF given): the target writes user turns of
its own (--self-prompts) beside the shipped training prompts and answers them all until
the data time budget (--data-minutes) runs out, its features are computed, an EAGLE-1
head is trained under the rest of the time budget, and the head is evaluated by real
speculative decoding on the held-out prompts (greedy, acceptance read from the engine's
counters). Writes the head, a loss plot, report.json and MODEL_CARD.md into --out."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .distill import (
    DistillSet,
    Sample,
    chat_ids,
    keep_self_prompts,
    user_turn_opener,
    write_samples,
    write_self_prompts,
)
from .generate import Engine, timed_generate
from .near_ties import explain_differences, summary
from .png import write_loss_png
from .runner import TargetRunner
from .train import STATE_FILE, TrainConfig, train_eagle_head

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.json"
REPORT_FILE = "report.json"
CARD_FILE = "MODEL_CARD.md"
SHIPPED_FILES = ("config.json", "model.safetensors", CARD_FILE)
# The features stay on the target's device when they take at most this share of its free
# memory; a data set larger than that is cut to its first sequences that fit.
FEATURE_MEMORY_FRACTION = 0.5
# Self-written prompts stop being started after this share of --data-minutes (a slow
# device still leaves time to answer them; on an H200 they take a small part of it).
SELF_PROMPT_SHARE = 1 / 3


@dataclass
class EvalRow:
    draft: str
    k: int
    acceptance_length: float
    per_position: list[float]
    tokens_per_s: float
    identical: bool  # greedy output equals target-only greedy output
    differences: str = "yes"  # near_ties.summary: how many differ, how many at near-ties


def evaluate_drafts(
    runner: TargetRunner,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    drafts: Mapping[str, torch.nn.Module],
    *,
    ks: Sequence[int] = (3,),
    max_new_tokens: int = 128,
) -> tuple[float, list[EvalRow]]:
    """Greedy speculative decoding of `prompt_ids` with each draft and each k through
    SpeculativeEngine; returns (target-only tokens/s, one row per draft and k)."""
    from .drafter import Drafter
    from .speculative import SpeculativeEngine

    cuda = runner.device.type == "cuda"
    engine = Engine(runner, tokenizer)
    engine.generate(prompt_ids[:1], max_new_tokens=2)  # warm-up
    ref, secs = timed_generate(engine, prompt_ids, max_new_tokens=max_new_tokens)
    want = [o.token_ids for o in ref]
    target_tok_s = sum(map(len, want)) / secs
    rows = []
    for name, draft in drafts.items():
        drafter = Drafter(
            draft,
            max_num_reqs=min(len(prompt_ids), runner.limits.max_num_reqs),
            k_max_options=tuple(ks),
            max_model_len=runner.limits.max_model_len,
            graph_modes=("greedy",),
            cuda_graphs=None if cuda else False,
        )
        for k in ks:
            spec = SpeculativeEngine(runner, drafter, k=k, tokenizer=tokenizer)
            spec.generate(prompt_ids[:1], max_new_tokens=2)  # warm-up
            spec.stats.proposed, spec.stats.accepted = [0] * k, [0] * k
            outs, secs = timed_generate(spec, prompt_ids, max_new_tokens=max_new_tokens)
            st = spec.stats
            got = [o.token_ids for o in outs]
            differ = sum(a != b for a, b in zip(got, want))
            diffs = explain_differences(runner.model, prompt_ids, want, got) if differ else []
            for d in diffs:
                logger.info("%s k=%d greedy difference: %s", name, k, d.line())
            rows.append(
                EvalRow(
                    name,
                    k,
                    st.acceptance_length,
                    [a / p if p else float("nan") for a, p in zip(st.accepted, st.proposed)],
                    sum(len(o.token_ids) for o in outs) / secs,
                    not differ,
                    summary(diffs, differ),
                )
            )
            logger.info("%s k=%d: acceptance length %.3f", name, k, st.acceptance_length)
    return target_tok_s, rows


def eval_table(target_tok_s: float, rows: Sequence[EvalRow]) -> str:
    """The acceptance table. No speed columns: this evaluation runs every held-out prompt
    at once, right after capture, possibly beside other work on the GPU; speed is the
    main job's (`specdraft generate`) to measure."""
    lines = [
        "| draft | k | acceptance length | acceptance per position | greedy identical |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(f"{a:.3f}" for a in r.per_position)
        lines.append(
            f"| {r.draft} | {r.k} | {r.acceptance_length:.3f} | {per} | "
            f"{'yes' if r.identical else r.differences} |"
        )
    return "\n".join(lines)


def write_model_card(path: str | Path, report: Mapping) -> Path:
    """MODEL_CARD.md from a report (the dict run_train_draft writes to report.json)."""
    d, t, e = report["data"], report["training"], report["evaluation"]
    headline = next((r for r in e["rows"] if r["k"] == 3 and r["draft"] == e["head"]), None)
    head_rows = [EvalRow(**r) for r in e["rows"]]
    al = "not evaluated" if headline is None else f"{headline['acceptance_length']:.3f}"
    text = f"""# EAGLE-1 draft head for {report["target"]["name"]}

A one-layer EAGLE-1 head (fc over [token embedding; target feature], one Llama decoder
layer without its input norm, no final norm) trained by self-distillation for
{report["target"]["name"]}. It shares the target's token embedding and lm_head, which
are not stored here. It reads the target's final hidden states (after the final
RMSNorm), the features specdraft's TargetRunner keeps for EAGLE-1 heads.

Load it with `specdraft.loader.load_draft(path, target=model)`.

## Target

- {report["target"]["name"]}, from `{report["target"]["file"]}` ({report["target"]["dtype"]})
- hidden size {report["target"]["hidden_size"]}, vocabulary {report["target"]["vocab_size"]}

## Data

{_data_lines(d)}

## Training

- {t["steps"]} steps in {t["seconds"]:.1f} s on {report["device"]}
- config: `{json.dumps(t["config"])}`
- final loss {t["final"].get("loss", float("nan")):.4f}; top-1 agreement with the target
  per unrolled step: {", ".join(f"{a:.3f}" for a in t["final"].get("accuracy", []))}

## Held-out evaluation

{e["prompts"]} held-out prompts (no word 8-gram shared with a training prompt, listed or
self-written), greedy, at most {e["max_new_tokens"]} new tokens, through
SpeculativeEngine. Acceptance length = 1 + accepted drafts per verification step;
per-position acceptance from the rejection sampler's counters. Speed is measured by
`specdraft generate`, which times target-only and speculative decoding in one run.

Acceptance length at k = 3: **{al}**

{eval_table(e["target_tokens_per_s"], head_rows)}

## License

Apache-2.0, the license of the target model whose outputs and features trained it.

## Reproduce

`{report["command"]}`
"""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path


def _data_lines(d: Mapping) -> str:
    """The model card's data section, from the report's "data" entry."""
    sp = d.get("self_prompts") or {}
    why = {
        "unfinished": "no end-of-turn token within the limit",
        "special": "another special token inside",
        "empty": "no words",
        "duplicate": "the words of an earlier or listed prompt",
        "heldout": "a word 8-gram or the words of a held-out prompt",
    }
    dropped = ", ".join(
        f"{v} {k} ({why.get(k, k)})" for k, v in (sp.get("dropped") or {}).items() if v
    )
    written = sp.get("written", sp.get("requested", 0))
    asked = ""
    if written < sp.get("requested", 0):
        asked = f" (of {sp['requested']} asked for: the time budget ended the writing)"
    lines = [
        f"- {d['prompts']} prompts from specdraft's shipped training list"
        + (
            f" and {sp.get('kept', 0)} user turns the target wrote itself: "
            f"{written} sampled{asked} at temperature {sp.get('temperature', 1.0)} "
            "with distinct seeds from the chat template opened at the user turn (its "
            f"system turn included), at most {sp.get('max_new_tokens')} tokens each, "
            f"dropped: {dropped or 'none'}"
            if sp.get("requested")
            else ""
        ),
        "- each prompt as one user turn of the target's chat template; answered: "
        f"{d.get('prompts_answered', d['prompts'])} prompts "
        f"({d.get('listed_answered', d['prompts'])} listed, "
        f"{d.get('self_answered', 0)} self-written)"
        + (
            f", the data time budget ({d['data_budget_s']:.0f} s) ended the writing"
            if d.get("budget_cut")
            else ""
        ),
        _answers_line(d),
        f"- {d['sequences']} sequences, {d['tokens']} tokens ({d['answer_tokens']} answer tokens)",
    ]
    if d.get("dropped_for_memory"):
        lines.append(
            f"- {d['dropped_for_memory']} sequences left out: their features did not fit "
            "the device's memory"
        )
    rate = d.get("answer_tokens_per_s")
    lines.append(
        f"- written in {d['seconds']:.1f} s"
        + (f" ({rate:.0f} answer tokens/s)" if rate else "")
        + f"; features in {d['feature_seconds']:.1f} s"
    )
    return "\n".join(lines)


def _answers_line(d: Mapping) -> str:
    asked = (
        f"{'the greedy answer and ' if d['greedy'] else ''}{d['samples_per_prompt']} "
        f"sampled at temperature {d['temperature']} with distinct seeds"
    )
    if "greedy_answers" not in d:
        return f"- per prompt: {asked}; at most {d['max_new_tokens']} new tokens each"
    return (
        f"- answers: {d['greedy_answers']} greedy and {d['sampled_answers']} sampled "
        f"(asked per prompt: {asked}; the greedy answers to every prompt are written "
        f"first, then the sampled ones), at most {d['max_new_tokens']} new tokens each"
    )


def save_samples(
    out: Path, samples: list[Sample], key: dict, seconds: float, info: dict | None = None
) -> None:
    """The generated samples with the settings that made them, the time it took and
    what else the run records about them (info: the self-written prompts)."""
    rows = [dataclasses.asdict(s) for s in samples]
    data = {"key": key, "seconds": seconds, "info": info or {}, "samples": rows}
    (out / SAMPLES_FILE).write_text(json.dumps(data))


def load_samples(out: Path, key: dict) -> tuple[list[Sample], float, dict] | None:
    """(samples, seconds it took to write them, info) saved in `out` with the same
    settings, else None."""
    file = out / SAMPLES_FILE
    if not file.is_file():
        return None
    saved = json.loads(file.read_text())
    if saved.get("key") != key:
        logger.info("%s was written with other settings: writing the samples again", file)
        return None
    samples = [Sample(**s) for s in saved["samples"]]
    return samples, float(saved.get("seconds", 0.0)), dict(saved.get("info") or {})


def fit_samples(samples: list[Sample], max_tokens: int) -> list[Sample]:
    """The longest prefix of `samples` holding at most max_tokens tokens."""
    total = 0
    for i, s in enumerate(samples):
        total += len(s.tokens)
        if total > max_tokens:
            return samples[:i]
    return samples


def run_train_draft(args: argparse.Namespace) -> int:
    from .data import load_prompts
    from .embedded import smollm2_gguf_path
    from .gguf import load_gguf
    from .loader import load_draft
    from .models.llama import layer_truncated

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.dtype:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"--dtype {args.dtype!r} is not a torch dtype")
    _parse_ks(args.eval_ks)  # refused before any work
    _check_data_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf
    path = smollm2_gguf_path(wheel=gguf) if gguf is None or gguf.endswith(".whl") else gguf
    listed = load_prompts("train")
    if args.num_prompts:
        listed = listed[: args.num_prompts]
    heldout = load_prompts("heldout")
    model, tok = load_gguf(path, device=device, dtype=dtype, max_positions=args.max_model_len)
    held_ids = chat_ids(tok, heldout)
    graphs = device == "cuda" and not args.no_graphs

    def new_runner(max_num_reqs: int) -> TargetRunner:
        runner = TargetRunner(
            model,
            max_num_reqs=max_num_reqs,
            max_num_tokens=max(2048, max_num_reqs),
            max_model_len=args.max_model_len,
            cuda_graphs=graphs,
        )
        runner.capture()
        return runner

    key = dict(
        gguf=str(Path(path).name),
        prompts=len(listed),
        prompt_list=hashlib.sha256("\n".join(listed).encode()).hexdigest()[:16],
        self_prompts=args.self_prompts,
        self_prompt_tokens=args.self_prompt_tokens,
        samples_per_prompt=args.samples_per_prompt,
        greedy=not args.no_greedy,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        data_minutes=args.data_minutes,
    )
    t_gen = time.perf_counter()
    saved = None if args.fresh else load_samples(out, key)
    if saved is None:
        gen_runner = new_runner(args.gen_batch)
        engine = Engine(gen_runner, tok)
        info = _write_self_prompts(
            engine, tok, args, listed, heldout, SELF_PROMPT_SHARE * args.data_minutes * 60
        )
        prompts = listed + info["texts"]
        budget_s = args.data_minutes * 60 - (time.perf_counter() - t_gen)
        t_ans = time.perf_counter()
        samples = write_samples(
            engine,
            chat_ids(tok, prompts),
            samples_per_prompt=args.samples_per_prompt,
            greedy=not args.no_greedy,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            max_seconds=max(0.0, budget_s),
        )
        info["answer_seconds"] = time.perf_counter() - t_ans
        info["answer_budget_s"] = max(0.0, budget_s)
        gen_runner.teardown()  # its graphs and KV cache are not needed again
        del gen_runner, engine
        gen_s = time.perf_counter() - t_gen
        save_samples(out, samples, key, gen_s, info)
    else:
        samples, gen_s, info = saved
        logger.info("reusing %d samples from %s", len(samples), out / SAMPLES_FILE)
    num_texts = len(info.get("texts", []))
    written = len(samples)
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    dropped_for_memory = 0
    if device == "cuda":
        torch.cuda.empty_cache()  # the generation runner's cache and graphs are gone
        free = torch.cuda.mem_get_info()[0]
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        per_token = model.cfg.hidden_size * dtype.itemsize + 8  # features + token id
        fit = fit_samples(samples, int(FEATURE_MEMORY_FRACTION * free / per_token))
        dropped_for_memory = len(samples) - len(fit)
        if dropped_for_memory:
            logger.warning(
                "features of %d tokens would take over %.0f%% of the free GPU memory: "
                "training on the first %d of %d sequences",
                sum(len(x.tokens) for x in samples),
                100 * FEATURE_MEMORY_FRACTION,
                len(fit),
                len(samples),
            )
        samples = fit
    answered = {s.prompt_index for s in samples}
    listed_answered = sum(i < len(listed) for i in answered)
    t_feat = time.perf_counter()
    data = DistillSet.from_samples(model, samples)
    if device == "cuda":
        torch.cuda.synchronize()
    feat_s = time.perf_counter() - t_feat
    logger.info(
        "data: %d sequences, %d tokens (%d answer tokens) in %.1f s + features %.1f s",
        len(data),
        data.num_tokens,
        data.num_answer_tokens,
        gen_s,
        feat_s,
    )
    data_info = dict(
        key,
        self_prompts=dict(
            requested=args.self_prompts,
            temperature=1.0,
            max_new_tokens=args.self_prompt_tokens,
            kept=num_texts,
            **{k: info[k] for k in ("written", "dropped", "tokens", "seconds") if k in info},
        ),
        prompts_answered=len(answered),
        listed_answered=listed_answered,
        self_answered=len(answered) - listed_answered,
        greedy_answers=sum(x.seed is None for x in samples),
        sampled_answers=sum(x.seed is not None for x in samples),
        budget_cut=written
        < (len(listed) + num_texts) * (args.samples_per_prompt + (not args.no_greedy)),
        data_budget_s=args.data_minutes * 60,
        answer_tokens_per_s=answer_tokens / info["answer_seconds"]
        if info.get("answer_seconds")
        else None,
        dropped_for_memory=dropped_for_memory,
        sequences=len(data),
        tokens=data.num_tokens,
        answer_tokens=data.num_answer_tokens,
        seconds=gen_s,
        feature_seconds=feat_s,
    )
    budget = args.max_minutes * 60 - (time.perf_counter() - t0) - args.eval_reserve_s
    if budget <= 0:
        raise SystemExit(
            f"--max-minutes {args.max_minutes} leaves no time to train after the data "
            f"({time.perf_counter() - t0:.0f} s) and --eval-reserve-s {args.eval_reserve_s}"
        )
    config = TrainConfig(
        steps=args.steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        cls_weight=args.cls_weight,
        ttt_steps=args.ttt_steps,
        head_layers=args.head_layers,
        noise=args.noise,
        seed=args.seed,
        max_seconds=budget,
    )
    # A saved training state belongs to the samples it trained on: resume it only with
    # those samples reused, never over newly written ones.
    resume = not args.fresh and saved is not None
    if saved is None and (out / STATE_FILE).is_file():
        logger.info("new samples: %s is not resumed, training starts over", out / STATE_FILE)
    result = train_eagle_head(model, data, out, config, resume=resume)
    write_loss_png(out / "loss.png", [r["loss"] for r in result.history])
    del data
    if device == "cuda":
        torch.cuda.empty_cache()

    ks = _parse_ks(args.eval_ks)
    head_name = "trained EAGLE-1 head"
    drafts = {head_name: load_draft(out, target=model)}
    if args.baseline_layers:
        drafts[f"first {args.baseline_layers} target layers"] = layer_truncated(
            model, args.baseline_layers
        )
    # A fresh runner: one that served sampled requests keeps their rows' host flags
    # (SamplingTensors.all_greedy looks at every row), and greedy speculation then asks
    # for draft probabilities a greedy drafter does not make.
    target_tok_s, rows = evaluate_drafts(
        new_runner(len(held_ids)),
        tok,
        held_ids,
        drafts,
        ks=ks,
        max_new_tokens=args.eval_max_new_tokens,
    )
    report = {
        "target": dict(
            name=Path(path).name.split(".")[0],  # SmolLM2-135M-Instruct.Q4_1.gguf
            file=Path(path).name,
            dtype=str(dtype).removeprefix("torch."),
            hidden_size=model.cfg.hidden_size,
            vocab_size=model.cfg.vocab_size,
        ),
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "data": data_info,
        "training": dict(
            steps=result.steps,
            seconds=result.seconds,
            config=dataclasses.asdict(config),
            final=result.final,
        ),
        "evaluation": dict(
            head=head_name,
            prompts=len(held_ids),
            max_new_tokens=args.eval_max_new_tokens,
            target_tokens_per_s=target_tok_s,
            rows=[dataclasses.asdict(r) for r in rows],
        ),
        "total_seconds": time.perf_counter() - t0,
        "command": "specdraft " + " ".join(getattr(args, "argv", None) or ["train-draft"]),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    write_model_card(out / CARD_FILE, report)
    print(eval_table(target_tok_s, rows))
    print(
        f"\ndata {gen_s:.0f} s + {feat_s:.0f} s, training {result.steps} steps "
        f"{result.seconds:.0f} s, total {report['total_seconds']:.0f} s; written to {out}"
    )
    if args.ship:
        dest = ship(out)
        print(f"copied {', '.join(SHIPPED_FILES)} to {dest}")
    return 0


def _check_data_args(args: argparse.Namespace) -> None:
    """The data options, refused before any work."""
    if args.self_prompts < 0:
        raise SystemExit(f"--self-prompts must be >= 0, got {args.self_prompts}")
    if args.self_prompt_tokens < 1:
        raise SystemExit(f"--self-prompt-tokens must be >= 1, got {args.self_prompt_tokens}")
    if not args.data_minutes > 0:
        raise SystemExit(f"--data-minutes must be > 0, got {args.data_minutes}")
    if args.data_minutes * 60 + args.eval_reserve_s >= args.max_minutes * 60:
        raise SystemExit(
            f"--data-minutes {args.data_minutes} and --eval-reserve-s {args.eval_reserve_s} "
            f"leave no time to train within --max-minutes {args.max_minutes}"
        )


def _write_self_prompts(
    engine: Engine, tok, args, listed, heldout, max_seconds: float | None = None
) -> dict:
    """--self-prompts user turns written by the target (none started after max_seconds)
    and filtered (keep_self_prompts): {"texts": kept, "written", "dropped": per reason,
    "tokens", "seconds"}."""
    info: dict = dict(texts=[], written=0, dropped={}, tokens=0, seconds=0.0)
    if not args.self_prompts:
        return info
    t = time.perf_counter()
    outs = write_self_prompts(
        engine,
        user_turn_opener(tok),
        args.self_prompts,
        max_new_tokens=args.self_prompt_tokens,
        temperature=1.0,
        seed=args.seed + 1,  # not the answers' seed list
        max_seconds=max_seconds,
    )
    texts, dropped = keep_self_prompts(
        outs,
        lambda ids: tok.decode(ids, skip_special_tokens=False),
        stop_ids=tok.stop_token_ids,
        special_ids=tok.special_ids,
        known=listed,
        heldout=heldout,
    )
    info.update(
        texts=texts,
        written=len(outs),
        dropped=dropped,
        tokens=sum(len(o.token_ids) for o in outs),
        seconds=time.perf_counter() - t,
    )
    logger.info(
        "kept %d of %d self-written user turns (dropped: %s)",
        len(texts),
        len(outs),
        ", ".join(f"{v} {k}" for k, v in dropped.items() if v) or "none",
    )
    return info


def _parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",")})
    except ValueError:
        raise SystemExit(f"--eval-ks must be comma-separated ints, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise SystemExit(f"--eval-ks values must be >= 1, got {text!r}")
    return ks


def ship(out: str | Path) -> Path:
    """Copy a trained head (config.json, model.safetensors, MODEL_CARD.md) into the
    source tree's specdraft/data/smollm2_eagle/, where shipped_draft_path finds it."""
    from .embedded import SHIPPED_DRAFT_DIR

    out = Path(out)
    missing = [f for f in SHIPPED_FILES if not (out / f).is_file()]
    if missing:
        raise ValueError(f"out {str(out)!r} lacks {missing}: run the training first")
    dest = Path(__file__).parent / "data" / SHIPPED_DRAFT_DIR
    dest.mkdir(exist_ok=True)
    for f in SHIPPED_FILES:
        shutil.copyfile(out / f, dest / f)
    return dest
