"""`specdraft train-draft`: the whole self-distillation run for the embedded target
(SmolLM2-135M-Instruct from its GGUF, or a GGUF given): the target writes its answers to
the shipped training prompts, its features are computed, an EAGLE-1 head is trained
under a time budget, and the head is evaluated by real speculative decoding on the
held-out prompts (greedy, acceptance read from the engine's counters). Writes the head,
a loss plot, report.json and MODEL_CARD.md into --out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .distill import DistillSet, Sample, chat_ids, write_samples
from .generate import Engine, timed_generate
from .png import write_loss_png
from .runner import TargetRunner
from .train import TrainConfig, train_eagle_head

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.json"
REPORT_FILE = "report.json"
CARD_FILE = "MODEL_CARD.md"
SHIPPED_FILES = ("config.json", "model.safetensors", CARD_FILE)


@dataclass
class EvalRow:
    draft: str
    k: int
    acceptance_length: float
    per_position: list[float]
    tokens_per_s: float
    identical: bool  # greedy output equals target-only greedy output


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
            rows.append(
                EvalRow(
                    name,
                    k,
                    st.acceptance_length,
                    [a / p if p else float("nan") for a, p in zip(st.accepted, st.proposed)],
                    sum(len(o.token_ids) for o in outs) / secs,
                    [o.token_ids for o in outs] == want,
                )
            )
            logger.info("%s k=%d: acceptance length %.3f", name, k, st.acceptance_length)
    return target_tok_s, rows


def eval_table(target_tok_s: float, rows: Sequence[EvalRow]) -> str:
    lines = [
        "| draft | k | acceptance length | acceptance per position | tokens/s | speedup | "
        "greedy identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(f"{a:.3f}" for a in r.per_position)
        lines.append(
            f"| {r.draft} | {r.k} | {r.acceptance_length:.3f} | {per} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / target_tok_s:.2f}x | {'yes' if r.identical else 'NO'} |"
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

- {d["prompts"]} training prompts (specdraft's shipped training list), as one user turn
  of the target's chat template
- per prompt: {d["samples_per_prompt"]} answer(s) sampled at temperature
  {d["temperature"]} with distinct seeds{" plus the greedy answer" if d["greedy"] else ""};
  at most {d["max_new_tokens"]} new tokens each
- {d["sequences"]} sequences, {d["tokens"]} tokens ({d["answer_tokens"]} answer tokens)
- written in {d["seconds"]:.1f} s; features in {d["feature_seconds"]:.1f} s

## Training

- {t["steps"]} steps in {t["seconds"]:.1f} s on {report["device"]}
- config: `{json.dumps(t["config"])}`
- final loss {t["final"].get("loss", float("nan")):.4f}; top-1 agreement with the target
  per unrolled step: {", ".join(f"{a:.3f}" for a in t["final"].get("accuracy", []))}

## Held-out evaluation

{e["prompts"]} held-out prompts (no 8-gram shared with the training list), greedy, at
most {e["max_new_tokens"]} new tokens, through SpeculativeEngine. Acceptance length =
1 + accepted drafts per verification step; per-position acceptance from the rejection
sampler's counters. Target-only: {e["target_tokens_per_s"]:.1f} tokens/s.

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


def save_samples(out: Path, samples: list[Sample], key: dict, seconds: float) -> None:
    """The generated samples with the settings that made them and the time it took."""
    rows = [dataclasses.asdict(s) for s in samples]
    data = {"key": key, "seconds": seconds, "samples": rows}
    (out / SAMPLES_FILE).write_text(json.dumps(data))


def load_samples(out: Path, key: dict) -> tuple[list[Sample], float] | None:
    """(samples, seconds it took to write them) saved in `out` with the same settings,
    else None."""
    file = out / SAMPLES_FILE
    if not file.is_file():
        return None
    saved = json.loads(file.read_text())
    if saved.get("key") != key:
        logger.info("%s was written with other settings: writing the samples again", file)
        return None
    return [Sample(**s) for s in saved["samples"]], float(saved.get("seconds", 0.0))


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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf
    path = smollm2_gguf_path(wheel=gguf) if gguf is None or gguf.endswith(".whl") else gguf
    prompts = load_prompts("train")
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    heldout = load_prompts("heldout")
    model, tok = load_gguf(path, device=device, dtype=dtype, max_positions=args.max_model_len)
    ids, held_ids = chat_ids(tok, prompts), chat_ids(tok, heldout)
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
        prompts=len(prompts),
        samples_per_prompt=args.samples_per_prompt,
        greedy=not args.no_greedy,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    t_gen = time.perf_counter()
    saved = None if args.fresh else load_samples(out, key)
    if saved is None:
        gen_runner = new_runner(args.gen_batch)
        samples = write_samples(
            Engine(gen_runner, tok),
            ids,
            samples_per_prompt=args.samples_per_prompt,
            greedy=not args.no_greedy,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
        gen_runner.teardown()  # its graphs and KV cache are not needed again
        del gen_runner
        gen_s = time.perf_counter() - t_gen
        save_samples(out, samples, key, gen_s)
    else:
        samples, gen_s = saved
        logger.info("reusing %d samples from %s", len(samples), out / SAMPLES_FILE)
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
    result = train_eagle_head(model, data, out, config, resume=not args.fresh)
    write_loss_png(out / "loss.png", [r["loss"] for r in result.history])
    data_info = dict(
        key,
        sequences=len(data),
        tokens=data.num_tokens,
        answer_tokens=data.num_answer_tokens,
        seconds=gen_s,
        feature_seconds=feat_s,
    )
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
            name="SmolLM2-135M-Instruct" if gguf is None or gguf.endswith(".whl") else path,
            file=Path(path).name,
            dtype=str(dtype).removeprefix("torch."),
            hidden_size=model.cfg.hidden_size,
            vocab_size=model.cfg.vocab_size,
        ),
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "data": dict(data_info, prompts=len(prompts)),
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
