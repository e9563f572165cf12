"""The one-stream rule, checked in the source: specdraft, its kernels and the benchmarks
make no CUDA stream outside cuda_graph.capture_stream (bench/graph_state.py makes them on
purpose, to show the cost). On the H200 a process whose work has gone to a few (three to
six) distinct streams pays ~0.18 µs more per kernel node in every graph it replays
(bench/NOTES.md, stop 45), so a stray `torch.cuda.Stream()` in a manager or a timing
helper slows the engine or skews a benchmark without failing anything else."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    ("specdraft/cuda_graph.py", "capture_stream"),
    ("bench/graph_state.py", "main"),
    ("bench/graph_state.py", "capture"),  # per_manager_streams: the old way, for comparison
}


def stream_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every torch.cuda.Stream(...) (or torch.Stream)
    call in `path` (specdraft.sampling's Stream, the random draws' enum, is not one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            f = getattr(child, "func", None)
            if isinstance(f, ast.Attribute) and f.attr == "Stream":  # torch.cuda.Stream(...)
                owner = f.value.attr if isinstance(f.value, ast.Attribute) else f.value
                if getattr(owner, "id", owner) in ("cuda", "torch"):
                    found.append((func, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_stream_is_made_outside_the_capture_stream():
    files = [p for d in ("specdraft", "kernels", "bench") for p in (ROOT / d).rglob("*.py")]
    files = [p for p in files if "specdraft/kernels" not in p.as_posix()]  # a link to kernels/
    assert len(files) > 50, "the scan found the sources"
    stray = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        stray += [f"{rel}:{line} in {func}" for func, line in stream_calls(path)
                  if (rel, func) not in ALLOWED]  # fmt: skip
    assert not stray, f"streams made outside cuda_graph.capture_stream: {stray}"


def test_the_scan_finds_a_stream(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nfrom x import Stream\n\ndef f():\n    Stream(2)\n"
                   "    return torch.cuda.Stream()\n")  # fmt: skip
    assert stream_calls(src) == [("f", 6)]
