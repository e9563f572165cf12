"""Reading an nvdisasm listing: instruction counts, registers, spills and loop bodies.
A module of its own, free of tests/sm90_compile.py's `TRITON_INTERPRET=0`, which would
leave later tests in the same process compiling for a GPU that is not there."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile


def sass_loops(text: str) -> list[int]:
    """Instructions in each loop of an nvdisasm listing (a label that a later branch
    jumps back to, up to that branch), in listing order; one-instruction loops (a
    kernel's closing self-branch) left out. An instruction count a loop iteration,
    divided by the elements a thread takes an iteration, is a device-free cost figure."""
    labels: dict[str, int] = {}
    loops, n = [], 0
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = n
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        back = re.search(r"\bBRA\s+(?:!?U?P\w+,\s*)?`?\(?(\.L_x_\d+)", m.group(1))
        if back and labels.get(back.group(1), n + 1) < n:
            loops.append(n + 1 - labels[back.group(1)])
        n += 1
    return loops


def sass_summary(cubin: bytes) -> str:
    """Instruction count, registers, spills (STL / LDL), the top opcodes of a cubin and
    the instructions of each of its loops."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text)
    count = collections.Counter(op.split(".")[0] for op in ops)
    top = ", ".join(f"{op} {n}" for op, n in count.most_common(6))
    # Registers a thread: the highest general register named, plus one (R255 is RZ).
    regs = 1 + max((int(r) for r in re.findall(r"\bR(\d+)\b", text) if int(r) < 255), default=-1)
    loops = " ".join(str(x) for x in sass_loops(text)) or "none"
    return (f"{len(ops)} SASS instructions, {regs} registers, STL {count['STL']}, "
            f"LDL {count['LDL']}; {top}; loops {loops}")  # fmt: skip
