"""The `specdraft` command (also `python -m specdraft`)."""

from __future__ import annotations

import argparse
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    from specdraft.selfcheck import main

    return main()


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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
