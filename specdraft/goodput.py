"""The number of speculative tokens by batch size, from measured throughput.

Speculation pays where a verification step of K + 1 rows a request costs little more
than a decode step. On the fused decode path that depends on the batch: on the H200, at
batch 1 a SmolLM2 step of 4 rows is fused and speculation with the shipped head gains
1.13-1.22x. At batch 8 the 32 verified rows take the unfused path, and speculation
loses (0.72x). So the default K is looked up in a table of measured tokens/s: for the
measured batch nearest to the one asked for, the K with the highest rate. K = 0
(target-only) is a measured entry like any other, so a batch where no K beats the plain
decode step gets no speculation by default.

A table holds, for each measured batch size, the rate of target-only decoding (k 0) and
of at least one k > 0, with the device, model and commands it came from.
`bench/goodput.py` measures one with `specdraft generate`. The shipped table
(`specdraft/data/goodput.json`) is the H200's, for SmolLM2-135M-Instruct with the
shipped head; other devices or drafts have no table and keep the caller's K."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).parent / "data" / "goodput.json"


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True)
class GoodputPoint:
    """Tokens per second of `specdraft generate` at one batch size and k (0: no draft)."""

    batch: int
    k: int
    tokens_per_s: float


class GoodputTable:
    """Measured (batch, k, tokens/s) points and the K they recommend by batch size.

    device: the GPU name the points were measured on (torch.cuda.get_device_name);
    model: what was run (target and draft); source: how (commands, versions)."""

    def __init__(self, points, *, device: str, model: str, source: str):
        for name, v in (("device", device), ("model", model), ("source", source)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        pts = []
        for i, p in enumerate(points):
            if not isinstance(p, GoodputPoint):
                raise TypeError(f"points[{i}] must be a GoodputPoint, got {type(p).__name__}")
            _int(f"points[{i}].batch", p.batch, 1)
            _int(f"points[{i}].k", p.k, 0)
            rate = p.tokens_per_s
            if isinstance(rate, bool) or not isinstance(rate, (int, float)):
                raise ValueError(f"points[{i}].tokens_per_s must be a number, got {rate!r}")
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"points[{i}].tokens_per_s must be positive, got {rate!r}")
            pts.append(p)
        if not pts:
            raise ValueError("points is empty: a table needs measured points")
        seen: dict[tuple[int, int], int] = {}
        for i, p in enumerate(pts):
            if (p.batch, p.k) in seen:
                raise ValueError(
                    f"points[{i}] repeats batch {p.batch}, k {p.k} (points[{seen[p.batch, p.k]}])"
                )
            seen[p.batch, p.k] = i
        for b in sorted({p.batch for p in pts}):
            ks = {p.k for p in pts if p.batch == b}
            if 0 not in ks or len(ks) < 2:
                raise ValueError(
                    f"batch {b} has k {sorted(ks)}: each measured batch needs target-only "
                    "(k 0) and at least one k > 0"
                )
        self.points = tuple(sorted(pts, key=lambda p: (p.batch, p.k)))
        self.device, self.model, self.source = device, model, source

    @property
    def batches(self) -> list[int]:
        return sorted({p.batch for p in self.points})

    def nearest_batch(self, batch: int) -> int:
        """The measured batch size nearest to `batch` (ties: the smaller one)."""
        _int("batch", batch, 1)
        return min(self.batches, key=lambda b: (abs(b - batch), b))

    def best_k(self, batch: int) -> int:
        """The k with the highest measured rate at the nearest measured batch (0: decode
        without a draft); ties go to the smaller k."""
        b = self.nearest_batch(batch)
        at = [p for p in self.points if p.batch == b]
        return max(at, key=lambda p: (p.tokens_per_s, -p.k)).k

    def rate(self, batch: int, k: int) -> float | None:
        """The measured tokens/s at exactly this batch and k, or None."""
        for p in self.points:
            if p.batch == batch and p.k == k:
                return p.tokens_per_s
        return None

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "model": self.model,
            "source": self.source,
            "points": [vars(p) for p in self.points],
        }

    @classmethod
    def from_dict(cls, d: dict) -> GoodputTable:
        if not isinstance(d, dict):
            raise ValueError(f"a goodput table is a JSON object, got {type(d).__name__}")
        missing = [k for k in ("device", "model", "source", "points") if k not in d]
        if missing:
            raise ValueError(f"goodput table lacks {', '.join(missing)}")
        if not isinstance(d["points"], list):
            raise ValueError("goodput table's points must be a list")
        points = []
        for i, p in enumerate(d["points"]):
            if not isinstance(p, dict) or set(p) != {"batch", "k", "tokens_per_s"}:
                raise ValueError(
                    f"points[{i}] must have exactly batch, k and tokens_per_s, got {p!r}"
                )
            points.append(GoodputPoint(p["batch"], p["k"], p["tokens_per_s"]))
        return cls(points, device=d["device"], model=d["model"], source=d["source"])

    @classmethod
    def load(cls, path: str | Path) -> GoodputTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"goodput table {str(path)!r} could not be read: {e}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def shipped_table() -> GoodputTable:
    """The table shipped with specdraft (SmolLM2-135M-Instruct and its head, H200)."""
    return GoodputTable.load(SHIPPED)


def table_for(device_name: str | None, table: GoodputTable | None = None) -> GoodputTable | None:
    """`table` (default: the shipped one) when it was measured on a device of this name,
    else None: throughput does not carry from one GPU to another."""
    if device_name is None:
        return None
    t = shipped_table() if table is None else table
    return t if t.device == device_name else None
