"""Save a line plot (a loss curve) as a PNG with no plotting library: zlib + struct only.

    from lineplot import save_line_plot
    save_line_plot("loss.png", losses, title="train loss", xlabel="step")

Uses matplotlib when it is installed (``backend="auto"``); otherwise, or with ``backend="builtin"``,
draws the curve itself: white canvas, grey grid, axis labels in a 3x5 pixel font, the curve in blue,
written as an 8-bit RGB PNG (signature, IHDR, one zlib IDAT, IEND).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

# 3x5 glyphs, one string of 5 rows of 3 pixels each ("#" = ink); unknown characters draw as blanks.
_FONT = {
    "0": "###,#.#,#.#,#.#,###", "1": ".#.,##.,.#.,.#.,###", "2": "###,..#,###,#..,###",
    "3": "###,..#,.##,..#,###", "4": "#.#,#.#,###,..#,..#", "5": "###,#..,###,..#,###",
    "6": "###,#..,###,#.#,###", "7": "###,..#,.#.,.#.,.#.", "8": "###,#.#,###,#.#,###",
    "9": "###,#.#,###,..#,###", ".": "...,...,...,...,.#.", "-": "...,...,###,...,...",
    "+": "...,.#.,###,.#.,...", ":": "...,.#.,...,.#.,...", "(": ".#.,#..,#..,#..,.#.",
    ")": ".#.,..#,..#,..#,.#.", "/": "..#,..#,.#.,#..,#..", "_": "...,...,...,...,###",
    "a": ".#.,#.#,###,#.#,#.#", "b": "##.,#.#,##.,#.#,##.", "c": ".##,#..,#..,#..,.##",
    "d": "##.,#.#,#.#,#.#,##.", "e": "###,#..,##.,#..,###", "f": "###,#..,##.,#..,#..",
    "g": ".##,#..,#.#,#.#,.##", "h": "#.#,#.#,###,#.#,#.#", "i": "###,.#.,.#.,.#.,###",
    "j": "..#,..#,..#,#.#,.#.", "k": "#.#,#.#,##.,#.#,#.#", "l": "#..,#..,#..,#..,###",
    "m": "#.#,###,###,#.#,#.#", "n": "##.,#.#,#.#,#.#,#.#", "o": ".#.,#.#,#.#,#.#,.#.",
    "p": "##.,#.#,##.,#..,#..", "q": ".#.,#.#,#.#,.#.,..#", "r": "##.,#.#,##.,#.#,#.#",
    "s": ".##,#..,.#.,..#,##.", "t": "###,.#.,.#.,.#.,.#.", "u": "#.#,#.#,#.#,#.#,###",
    "v": "#.#,#.#,#.#,#.#,.#.", "w": "#.#,#.#,###,###,#.#", "x": "#.#,#.#,.#.,#.#,#.#",
    "y": "#.#,#.#,.#.,.#.,.#.", "z": "###,..#,.#.,#..,###",
}
WHITE, BLACK, GREY, BLUE = (255, 255, 255), (0, 0, 0), (225, 225, 225), (31, 119, 180)


class Canvas:
    """An RGB pixel buffer with the few drawing primitives a line plot needs.

        c = Canvas(64, 32); c.line(0, 0, 63, 31, BLUE); png_bytes = c.png()
    """

    def __init__(self, width: int, height: int, bg: tuple[int, int, int] = WHITE):
        if width < 1 or height < 1:
            raise ValueError(f"canvas must be at least 1x1, got {width}x{height}")
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def set(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> tuple[int, int, int]:
        i = 3 * (y * self.w + x)
        return tuple(self.px[i:i + 3])

    def line(self, x0: int, y0: int, x1: int, y1: int, color, width: int = 1) -> None:
        """Bresenham's line, ``width`` pixels thick (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        r0, r1 = -((width - 1) // 2), width // 2
        while True:
            for ox in range(r0, r1 + 1):
                for oy in range(r0, r1 + 1):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2) -> None:
        """Draw ``s`` with its top-left corner at (x, y), 4 * scale pixels per character."""
        for k, ch in enumerate(s.lower()):
            rows = _FONT.get(ch, "...,...,...,...,...").split(",")
            for ry, row in enumerate(rows):
                for rx, bit in enumerate(row):
                    if bit == "#":
                        for a in range(scale):
                            for b in range(scale):
                                self.set(x + (4 * k + rx) * scale + a, y + ry * scale + b, color)

    def png(self) -> bytes:
        """The canvas encoded as an 8-bit RGB PNG."""
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        stride = 3 * self.w
        raw = b"".join(b"\x00" + bytes(self.px[y * stride:(y + 1) * stride]) for y in range(self.h))
        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def draw_line_plot(ys: Sequence[float], width: int = 640, height: int = 400, title: str = "",
                   xlabel: str = "", xs: Sequence[float] | None = None) -> Canvas:
    """A canvas with ``ys`` against ``xs`` (default 0, 1, ...): grid, min/max labels, the curve."""
    ys = [float(v) for v in ys]
    if not ys:
        raise ValueError("nothing to plot: ys is empty")
    if any(not math.isfinite(v) for v in ys):
        raise ValueError(f"cannot plot non-finite values: {[v for v in ys if not math.isfinite(v)][:3]}")
    xs = list(range(len(ys))) if xs is None else [float(v) for v in xs]
    if len(xs) != len(ys):
        raise ValueError(f"xs has {len(xs)} values but ys has {len(ys)}")
    c = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 45
    if right - left < 10 or bottom - top < 10:
        raise ValueError(f"canvas {width}x{height} is too small for a plot")
    y_lo, y_hi = min(ys), max(ys)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5

    def px(x: float, y: float) -> tuple[int, int]:
        return (round(left + (x - x_lo) / (x_hi - x_lo) * (right - left)),
                round(bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)))

    for k in range(5):  # grid and tick labels
        gy = round(top + k * (bottom - top) / 4)
        c.line(left, gy, right, gy, GREY)
        c.text(4, gy - 5, _fmt(y_hi - k * (y_hi - y_lo) / 4))
        gx = round(left + k * (right - left) / 4)
        c.line(gx, top, gx, bottom, GREY)
        label = _fmt(x_lo + k * (x_hi - x_lo) / 4)
        c.text(gx - 4 * len(label), bottom + 8, label)
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    c.text(left, 12, title)
    c.text(right - 8 * len(xlabel), bottom + 26, xlabel)
    pts = [px(x, y) for x, y in zip(xs, ys)]
    if len(pts) == 1:
        c.line(*pts[0], *pts[0], BLUE, width=4)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        c.line(x0, y0, x1, y1, BLUE, width=2)
    return c


def save_line_plot(path: str, ys: Sequence[float], title: str = "", xlabel: str = "",
                   xs: Sequence[float] | None = None, backend: str = "auto") -> str:
    """Write a PNG line plot of ``ys`` to ``path``; returns the backend used ("matplotlib" or "builtin").

        save_line_plot("out/loss.png", [4.1, 3.2, 2.9], title="loss", xlabel="step")
    """
    if backend not in ("auto", "builtin", "matplotlib"):
        raise ValueError(f"backend must be 'auto', 'builtin' or 'matplotlib', got {backend!r}")
    if backend != "builtin":
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            if backend == "matplotlib":
                raise
        else:
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            ax.plot(list(range(len(ys))) if xs is None else list(xs), list(ys))
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            return "matplotlib"
    png = draw_line_plot(ys, title=title, xlabel=xlabel, xs=xs).png()
    with open(path, "wb") as f:
        f.write(png)
    return "builtin"
