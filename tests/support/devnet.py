"""Helpers of the devnet tests: a small devnet on the untrained tiny model, run in the test process."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.processes import still_running
from prime_node.trainer.devnet.runner import Devnet, DevnetOptions
from prime_node.trainer.devnet.synthetic import SyntheticOptions
from prime_node.trainer.devnet.tasks import TaskFilter
from prime_node.trainer.devnet.view import LiveView

# Small work so a step needs a few files: 2 prompts x 2 samples per file, 8 samples per step. Length targets
# give the untrained model's completions different rewards within a group (none is correct), so groups
# carry signal and the trainer's online filter keeps them (as in tests/support/trainer_service.py).
SMALL = Sizing(batch_size=8, prompts=2, samples=2, max_new_tokens=16, length_targets=(3, 9, 17))


def tiny_model(directory: Path) -> Path:
    model, tokenizer = build_tiny_model(0)
    save_model_dir(model, tokenizer, directory)
    return directory


def run_devnet(
    tmp_path: Path,
    *,
    nodes: int,
    attacks: list[str],
    steps: int,
    model: Path | None = None,
    sizing: Sizing = SMALL,
    task_filter: TaskFilter | None = None,
    env: str = "arithmetic",
    synthetic: SyntheticOptions | None = None,
) -> tuple[dict[str, Any], Devnet, str]:
    """Run a devnet to completion; returns its report, the Devnet (for its PIDs) and the view's output."""
    out = io.StringIO()
    options = DevnetOptions(
        root=tmp_path / "run",
        model_dir=model or tiny_model(tmp_path / "model"),
        nodes=nodes,
        attacks=attacks,
        steps=steps,
        sizing=sizing,
        stall_timeout_s=240.0,
        task_filter=task_filter,
        env=env,
        synthetic=synthetic,
    )
    devnet = Devnet(options, LiveView(steps, Console(file=out, width=120), live=False))
    report = devnet.run()
    return report, devnet, out.getvalue()


def assert_all_gone(devnet: Devnet, report: dict[str, Any]) -> None:
    """Every process the devnet started, and every process below them (DHT children, p2pd), has exited."""
    assert devnet.seen, "the devnet saw no processes"
    assert len(devnet.seen) > len(devnet.group.children), (
        "no DHT child or p2pd daemon was seen below the children"
    )
    alive = [pid for pid, started in devnet.seen.items() if still_running(pid, started)]
    assert not alive, f"still running after the devnet stopped: {alive}"
    assert not report["processes"]["alive"]
    assert all(c.process.poll() is not None for c in devnet.group.children)
