"""Measure a reduced draft vocabulary (specdraft.draft_vocab): the target's greedy answers
to the training prompts, counted, and the share of its greedy answers to the held-out
prompts that each vocabulary size covers (what a reduced head can still propose).
Writes token_counts.json (specdraft.draft_vocab's format; copy it to
specdraft/data/smollm2_eagle/ to ship it) and coverage.md.

    python -m bench.draft_vocab [--out results] [--train-limit N] [--max-new-tokens 128]
        [--batch 64] [--sizes 4096,8192,16384,24576] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def answers(engine, prompts: list[str], max_new: int, batch: int) -> list[list[int]]:
    """The target's greedy answers (token ids) to chat-templated prompts."""
    from specdraft.distill import chat_ids
    from specdraft.sampling import SamplingParams

    ids = chat_ids(engine.tokenizer, prompts)
    out: list[list[int]] = []
    for i in range(0, len(ids), batch):
        res = engine.generate(ids[i : i + batch], params=SamplingParams(), max_new_tokens=max_new)
        out += [list(r.token_ids) for r in res]
    return out


def coverage_table(train, heldout, vocab_size: int, sizes: list[int]) -> str:
    from specdraft.draft_vocab import count_tokens, coverage, top_ids

    counts, held = count_tokens(train), count_tokens(heldout)
    lines = [
        f"train answers: {sum(counts.values())} tokens, {len(counts)} distinct; held-out "
        f"answers: {sum(held.values())} tokens, {len(held)} distinct",
        "",
        "| draft vocabulary | share of the vocabulary | held-out answer tokens covered |",
        "|---|---|---|",
    ]
    for n in sizes:
        ids = top_ids(counts, vocab_size, n)
        lines.append(f"| {n} | {n / vocab_size:.3f} | {coverage(held, ids):.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--train-limit", type=int, default=None, help="first N training prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sizes", default="4096,8192,16384,24576")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    args = ap.parse_args(argv)
    import torch

    from specdraft.data import load_prompts
    from specdraft.demo import load_engine
    from specdraft.draft_vocab import count_tokens, save_counts

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = [int(x) for x in args.sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    engine, _, _ = load_engine(
        None, device=device, dtype=dtype, max_num_reqs=args.batch, max_model_len=1024,
        graphs=device == "cuda",
    )  # fmt: skip
    vocab = engine.runner.model.cfg.vocab_size
    train = load_prompts("train")[: args.train_limit]
    t0 = time.perf_counter()
    train_ans = answers(engine, train, args.max_new_tokens, args.batch)
    held_ans = answers(engine, load_prompts("heldout"), args.max_new_tokens, args.batch)
    secs = time.perf_counter() - t0
    source = (
        f"python -m bench.draft_vocab --max-new-tokens {args.max_new_tokens}"
        + (f" --train-limit {args.train_limit}" if args.train_limit else "")
        + f": SmolLM2-135M-Instruct's greedy answers ({device}, {str(dtype)[6:]}) to "
        f"{len(train)} training prompts; torch {torch.__version__}"
    )
    save_counts(args.out / "token_counts.json", count_tokens(train_ans), vocab, source)
    table = coverage_table(train_ans, held_ans, vocab, sizes)
    text = f"{source}\n\n{table}\n\n({secs:.1f} s of generation)\n"
    (args.out / "coverage.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
