"""Every figure the project draws (trainer/devnet/plot.py, matplotlib on Agg): tick values, axis labels, a
legend and a title, read back from matplotlib's own objects rather than from pixels; a gap in the data is a
NaN that breaks the line; the PNG file written is valid and of the figure's size.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import matplotlib.image
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from prime_node.trainer.devnet.plot import save
from prime_node.trainer.devnet.report import reward_figure

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark(name: str) -> ModuleType:
    """A benchmark script imported as a module (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def legend_of(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, "no legend"
    return [t.get_text() for t in legend.get_texts()]


def ticks(fig: Figure) -> tuple[list[str], list[str]]:
    fig.canvas.draw()  # tick labels get their text when drawn
    (ax,) = fig.axes
    return [t.get_text() for t in ax.get_xticklabels()], [t.get_text() for t in ax.get_yticklabels()]


def assert_png_of(fig: Figure, path: Path) -> None:
    assert save(fig, path) == path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = fig.get_size_inches() * fig.dpi
    assert matplotlib.image.imread(path).shape[:2] == (round(height), round(width))


def test_reward_figure_has_axes_labels_legend_title_and_shows_gaps_as_gaps(tmp_path: Path) -> None:
    rewards = [
        {"step": 1, "rollout_reward": 0.20, "task_reward": 0.30},
        {"step": 2, "rollout_reward": 0.25, "task_reward": 0.35},
        # step 3: no record at all; step 4: read nothing new, so no rollout reward
        {"step": 4, "rollout_reward": None, "task_reward": 0.40},
        {"step": 5, "rollout_reward": 0.45, "task_reward": 0.50},
    ]
    fig = reward_figure(rewards)
    assert fig is not None
    (ax,) = fig.axes
    assert ax.get_title().startswith("devnet: mean task reward per policy step")
    assert ax.get_xlabel() == "policy step" and ax.get_ylabel() == "mean task reward"
    assert legend_of(ax) == [
        "rollout reward (every sample read for the step)",
        "batch reward (the samples trained on)",
    ]
    xs, ys = ticks(fig)
    assert {"1", "2", "3", "4", "5"} <= set(xs) and ys[:2] == ["0.0", "0.2"]  # whole steps only on x
    rollout, batch = ax.get_lines()
    assert list(rollout.get_xdata()) == [1, 2, 3, 4, 5]
    gaps = [math.isnan(y) for y in rollout.get_ydata()]
    assert gaps == [False, False, True, True, False]  # the line breaks at 3 and 4, it does not bridge them
    assert [math.isnan(y) for y in batch.get_ydata()] == [False, False, True, False, False]
    assert_png_of(fig, tmp_path / "out" / "reward.png")
    # Nothing to draw: no figure (and no empty file).
    assert reward_figure([]) is None and reward_figure([{"step": 1, "rollout_reward": None}]) is None


def test_learning_curve_names_every_held_out_set_and_redraws_from_a_summary(tmp_path: Path) -> None:
    learning = benchmark("learning")
    rewards = [(float(s), 0.3 + 0.01 * s) for s in range(1, 41)]
    accuracy = {
        "band": [(0.0, 0.46), (20.0, 0.6), (40.0, 0.79)],
        "mix": [(0.0, 0.2), (20.0, 0.3), (40.0, 0.34)],
    }
    fig = learning.learning_figure(rewards, accuracy, {"band": 652, "mix": 1000})
    (ax,) = fig.axes
    assert ax.get_title() and ax.get_xlabel() == "policy step" and ax.get_ylabel()
    assert legend_of(ax) == [
        "rollout reward (T = 1, before filtering)",
        "held-out band accuracy (652 problems)",
        "held-out mix accuracy (1000 problems)",
    ]
    xs, ys = ticks(fig)
    assert "40" in xs and "0.0" in ys and "1.0" in ys
    assert_png_of(fig, tmp_path / "curve.png")
    # --replot draws the same curve from the data a --summary file keeps (no model, no run).
    summary = tmp_path / "summary.json"
    curves = {"rollout_reward": rewards, "heldout": accuracy, "problems": {"band": 652, "mix": 1000}}
    summary.write_text(json.dumps({"steps": 40, "curves": curves}))
    learning.replot(summary, tmp_path / "again.png")
    assert (
        matplotlib.image.imread(tmp_path / "again.png").shape
        == matplotlib.image.imread(tmp_path / "curve.png").shape
    )


def test_sensitivity_plots_show_the_bounds_and_the_honest_maxima(tmp_path: Path) -> None:
    calibrate = benchmark("calibrate_proofs")

    def row(kind: str, config: str, low: float, high: float) -> dict:
        return {"kind": kind, "config": config, "typical": [low, high], "files": 6}

    results = [
        row("honest", "float32", 0.0, 0.0),
        row("honest", "bfloat16", 0.638, 0.719),
        *(row("noise", c, v, 1.5 * v) for c, v in (("1e-4", 0.0), ("1e-3", 0.016), ("1e-2", 0.157))),
        *(row("quant", f"int{b}", v, 1.4 * v) for b, v in ((16, 0.0), (8, 0.165), (4, 3.1))),
    ]
    paths = calibrate.plot_sweep(results, tmp_path)
    assert [p.name for p in paths] == ["proofs_sensitivity_noise.png", "proofs_sensitivity_quantization.png"]
    for kind, xlabel in (("noise", "relative noise"), ("quant", "weight bits")):
        fig = calibrate.sensitivity_figure(results, kind)
        (ax,) = fig.axes
        assert ax.get_xlabel().startswith(xlabel) and ax.get_yscale() == "log" and ax.get_title()
        assert legend_of(ax) == [
            "largest of 6 files",
            "smallest of 6 files",
            "float32 bound (0.04)",
            "bfloat16 bound (1.1)",
            "honest float32 maximum (0.000)",  # its real value, though drawn on the floor of the log axis
            "honest bfloat16 maximum (0.719)",
        ]
        xs, ys = ticks(fig)
        assert any(xs) and any(ys)
        assert_png_of(fig, tmp_path / f"{kind}.png")
