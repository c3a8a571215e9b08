"""The devnet with its default settings makes the reward rise (read from the trainer's own metrics).

Long (the warm start, the task filter and 50 policy steps: 10-20 minutes on 2 cores), so it runs only when
PRIME_NODE_LONG_TESTS=1 is set. It uses the default model (created by the devnet exactly as for a user,
unless PRIME_NODE_DEVNET_MODEL points at one) and every RL default of the trainer and the nodes.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.tasks import TaskFilter

from support.devnet import assert_all_gone, run_devnet

STEPS = 50  # the devnet's default
WINDOW = (
    16  # steps averaged at each end (a third of the run, as the report's trend): single batches are noisy
)
RISE = 0.05  # absolute rollout-reward gain required between the first and the last window


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(
    os.environ.get("PRIME_NODE_LONG_TESTS") != "1", reason="long: set PRIME_NODE_LONG_TESTS=1"
)
def test_devnet_reward_rises_with_default_settings(tmp_path: Path) -> None:
    model = Path(os.environ.get("PRIME_NODE_DEVNET_MODEL", tmp_path / "model"))
    report, devnet, _ = run_devnet(
        tmp_path,
        nodes=3,
        attacks=["inflated-rewards"],
        steps=STEPS,
        model=model,
        sizing=Sizing(),
        task_filter=TaskFilter(),
    )
    assert report["error"] is None, report["error"]
    assert_all_gone(devnet, report)
    records = [
        json.loads(line) for line in devnet.layout.metrics_path.read_text().splitlines() if line.strip()
    ]
    # The rollout reward (every sample read, filtered groups too): the batch's own reward only averages groups
    # whose rewards differ, so it sits near 0.5 whatever the policy's skill.
    rewards = [float(r["rollout_reward"]) for r in records if "rollout_reward" in r]
    assert len(rewards) >= STEPS
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    assert last >= first + RISE, (
        f"rollout reward {first:.3f} over the first {WINDOW} steps, {last:.3f} over the last"
    )
