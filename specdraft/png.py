"""Line plots as PNG files with numpy, zlib and struct only (no plotting dependency):
a small rasteriser (lines, a frame, tick labels in a 3x5 pixel font) and an RGB PNG
encoder (8-bit truecolour, no interlace, filter 0 on every row)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3x5 glyphs, rows top to bottom, 3 bits per row (4 = left pixel).
_GLYPHS = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 3, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 1, 2, 2),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
    "-": (0, 0, 7, 0, 0),
    "+": (0, 2, 7, 2, 0),
    "e": (0, 7, 7, 4, 7),
    "k": (4, 5, 6, 5, 5),
    " ": (0, 0, 0, 0, 0),
}


def _chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an RGB image, uint8 [height, width, 3]."""
    if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8:
        raise TypeError("pixels must be a uint8 numpy array")
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.shape[0] < 1 or pixels.shape[1] < 1:
        raise ValueError(f"pixels must have shape [height, width, 3], got {pixels.shape}")
    h, w, _ = pixels.shape
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    rows = np.concatenate([np.zeros((h, 1), np.uint8), pixels.reshape(h, w * 3)], axis=1)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + _chunk(b"IEND", b"")
    )


class Canvas:
    """An RGB image with a white background and integer pixel drawing."""

    def __init__(self, width: int, height: int):
        self.pixels = np.full((height, width, 3), 255, dtype=np.uint8)

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.rint(np.linspace(x0, x1, n + 1)).astype(int)
        ys = np.rint(np.linspace(y0, y1, n + 1)).astype(int)
        w, h = self.size
        for d in range(width):
            ok = (xs >= 0) & (xs < w) & (ys + d >= 0) & (ys + d < h)
            self.pixels[ys[ok] + d, xs[ok]] = color

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        """Draw s (digits, '.', '-', '+', 'e', 'k', space) with its top-left at (x, y)."""
        w, h = self.size
        for i, ch in enumerate(s):
            for r, bits in enumerate(_GLYPHS.get(ch, _GLYPHS[" "])):
                for c in range(3):
                    if bits & (4 >> c):
                        px, py = x + (4 * i + c) * scale, y + r * scale
                        if px >= 0 and py >= 0 and px + scale <= w and py + scale <= h:
                            self.pixels[py : py + scale, px : px + scale] = color


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:.3g}"


def line_plot(
    series: Sequence[tuple[Sequence[float], Sequence[float], tuple[int, int, int]]],
    *,
    width: int = 720,
    height: int = 400,
    ylim: tuple[float, float] | None = None,
) -> np.ndarray:
    """An RGB image of (xs, ys, colour) series on shared axes, with min/mid/max tick
    labels on both axes."""
    series = [(np.asarray(x, float), np.asarray(y, float), c) for x, y, c in series]
    series = [(x, y, c) for x, y, c in series if len(x) and len(x) == len(y)]
    if not series:
        raise ValueError("series holds no (xs, ys) pair of equal, non-zero length")
    x_lo = min(float(x.min()) for x, _, _ in series)
    x_hi = max(float(x.max()) for x, _, _ in series)
    finite = np.concatenate([y[np.isfinite(y)] for _, y, _ in series])
    if ylim is not None:
        y_lo, y_hi = ylim
    else:
        y_lo, y_hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    if y_hi == y_lo:
        y_hi = y_lo + 1
    canvas = Canvas(width, height)
    left, right, top, bottom = 70, width - 15, 15, height - 30
    grey = (205, 205, 205)
    for f in (0.0, 0.5, 1.0):
        y = bottom - f * (bottom - top)
        canvas.line(left, y, right, y, grey)
        canvas.text(4, int(y) - 5, _label(y_lo + f * (y_hi - y_lo)))
        x = left + f * (right - left)
        canvas.line(x, top, x, bottom, grey)
        lab = _label(x_lo + f * (x_hi - x_lo))
        canvas.text(int(x - f * 8 * len(lab)), bottom + 8, lab)  # 8 px a glyph
    canvas.line(left, bottom, right, bottom, (0, 0, 0))
    canvas.line(left, top, left, bottom, (0, 0, 0))
    for xs, ys, color in series:
        px = left + (xs - x_lo) / (x_hi - x_lo) * (right - left)
        py = bottom - (np.clip(ys, y_lo, y_hi) - y_lo) / (y_hi - y_lo) * (bottom - top)
        keep = np.isfinite(py)
        px, py = px[keep], py[keep]
        if len(px) == 1:
            canvas.line(px[0], py[0], px[0], py[0], color, width=2)
        for i in range(len(px) - 1):
            canvas.line(px[i], py[i], px[i + 1], py[i + 1], color, width=2)
    return canvas.pixels


def write_loss_png(path: str | Path, losses: Sequence[float], *, smooth: float = 0.95) -> Path:
    """The loss per step (light) and its exponential moving average (dark) as a PNG."""
    ys = np.asarray(losses, float)
    if ys.size == 0:
        raise ValueError("losses is empty")
    ema, acc = np.empty_like(ys), ys[0]
    for i, v in enumerate(ys):
        acc = smooth * acc + (1 - smooth) * v
        ema[i] = acc if i else v
    xs = np.arange(1, ys.size + 1)
    hi = float(np.quantile(ys, 0.99)) if ys.size > 20 else float(ys.max())
    pixels = line_plot(
        [(xs, ys, (160, 190, 230)), (xs, ema, (20, 60, 160))], ylim=(float(ys.min()), hi)
    )
    path = Path(path)
    path.write_bytes(encode_png(pixels))
    return path
