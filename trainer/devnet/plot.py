"""A small PNG line-plot writer with no dependency beyond the standard library (zlib, struct).

`line_plot(path, [Series(...)], ...)` draws each series as a polyline over a light grid with axes, in an
RGB image; good enough to see a reward curve rise, with no matplotlib in the install. Labels are not
drawn (no font): the caller prints the numbers next to the file name.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
GRID: RGB = (225, 225, 225)
AXIS: RGB = (60, 60, 60)
PALETTE: tuple[RGB, ...] = ((30, 90, 200), (200, 60, 30), (40, 150, 60), (140, 60, 170))


@dataclass(frozen=True)
class Series:
    points: Sequence[tuple[float, float]]  # (x, y), drawn in order
    color: RGB = PALETTE[0]


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB, thick: int = 1) -> None:
        """Bresenham, thickened by stamping a small square at every point."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = thick // 2
        while True:
            for ox in range(-half, thick - half):
                for oy in range(-half, thick - half):
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

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * self.width * y : 3 * self.width * (y + 1)])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def line_plot(
    path: Path,
    series: Sequence[Series],
    *,
    x_range: tuple[float, float] | None = None,
    y_range: tuple[float, float] = (0.0, 1.0),
    width: int = 640,
    height: int = 360,
    grid: int = 10,
) -> Path:
    """Write a PNG of `series` (y clipped to `y_range`); the x range defaults to the data's."""
    xs = [x for s in series for x, _ in s.points]
    x0, x1 = x_range or ((min(xs), max(xs)) if xs else (0.0, 1.0))
    if x1 <= x0:
        x1 = x0 + 1.0
    y0, y1 = y_range
    margin = 24
    canvas = Canvas(width, height)
    left, right, top, bottom = margin, width - margin, margin, height - margin

    def px(x: float, y: float) -> tuple[int, int]:
        y = min(max(y, y0), y1)
        return (
            round(left + (x - x0) / (x1 - x0) * (right - left)),
            round(bottom - (y - y0) / (y1 - y0) * (bottom - top)),
        )

    for k in range(grid + 1):
        gy = round(bottom - k * (bottom - top) / grid)
        gx = round(left + k * (right - left) / grid)
        canvas.line(left, gy, right, gy, GRID)
        canvas.line(gx, top, gx, bottom, GRID)
    canvas.line(left, bottom, right, bottom, AXIS, 2)
    canvas.line(left, top, left, bottom, AXIS, 2)
    for s in series:
        points = [px(x, y) for x, y in s.points]
        for (ax, ay), (bx, by) in zip(points, points[1:]):
            canvas.line(ax, ay, bx, by, s.color, 3)
        for ax, ay in points:  # a dot per point, so a one-point series is visible too
            canvas.line(ax - 2, ay, ax + 2, ay, s.color, 5)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.png())
    return path
