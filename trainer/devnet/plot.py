"""Line plots written as PNG files by matplotlib on its Agg backend (no display, no pyplot state).

Every figure the project draws goes through `save(figure(...), path)`: the devnet's reward.png (report.py),
the learning curve of benchmarks/learning.py (docs/learning_curve.png) and the sensitivity plots of
benchmarks/calibrate_proofs.py (docs/proofs_sensitivity_*.png). Each gets tick values, axis labels, a legend
and a title. A missing value (None) is a gap: the line breaks there instead of bridging it, so a step with
no data is never drawn as if it had followed the trend; a point between two gaps keeps its marker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

Scale = Literal["linear", "log"]


@dataclass(frozen=True)
class Series:
    """One line of the legend: (x, y) points drawn in order; y None leaves a gap."""

    label: str
    points: Sequence[tuple[float, float | None]]
    color: str | None = None  # any matplotlib colour; None takes the next of the default cycle
    marker: str | None = "o"  # one per point, so a lone point between gaps stays visible


@dataclass(frozen=True)
class Level:
    """A horizontal reference line across the whole plot (a bound, an honest maximum), with its legend entry."""

    label: str
    y: float
    color: str | None = None
    style: str = "--"


def figure(
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    levels: Sequence[Level] = (),
    xlim: tuple[float, float] | None = None,
    ylim: tuple[float, float] | None = None,
    xscale: Scale = "linear",
    yscale: Scale = "linear",
    integer_x: bool = False,
    size: tuple[float, float] = (8.0, 4.5),
) -> Figure:
    """The figure itself, for a caller (or a test) that inspects it before or instead of saving it."""
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg renders to memory: no display is needed or touched
    ax = fig.add_subplot()
    for s in series:
        xs = [float(x) for x, _ in s.points]
        ys = [math.nan if y is None else float(y) for _, y in s.points]  # NaN: matplotlib breaks the line
        ax.plot(xs, ys, label=s.label, color=s.color, marker=s.marker, markersize=3.5, linewidth=1.6)
    for level in levels:
        ax.axhline(level.y, label=level.label, color=level.color, linestyle=level.style, linewidth=1.2)
    ax.set_xscale(xscale)
    ax.set_yscale(yscale)
    if xlim is not None:
        ax.set_xlim(*xlim)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if integer_x:  # policy steps: ticks at whole numbers only
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize="small", framealpha=0.85)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at `path` (its folder created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
