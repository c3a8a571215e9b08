"""Every attack of the threat list through the real validator hand-off, in one devnet.

Fourteen cheating contributors (one per attack kind) and one honest node join a devnet on the untrained tiny
model: each cheater's files travel over the swarm like any node's, are verified by the validator, rejected
by the check the attack targets, slashed as fraud and banned, while the honest node's files are accepted
and the trainer keeps stepping.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_node.trainer.devnet.attacks import ATTACKS, EXPECTED_CHECKS
from prime_node.trainer.devnet.report import format_report

from support.devnet import assert_all_gone, run_devnet


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~4 min on 2 idle cores (9 processes with torch); far longer on a loaded machine
def test_every_attack_is_caught_through_the_handoff(tmp_path: Path) -> None:
    report, devnet, _ = run_devnet(tmp_path, nodes=1, attacks=list(ATTACKS), steps=1)
    text = format_report(report)
    assert report["error"] is None, text
    assert report["steps"] >= 1
    assert report["honest"]["accepted_files"] >= 1 and report["honest"]["rejected_files"] == 0, text
    slashes = {s["attack"]: s for s in report["slashed"]}
    for adversary in report["adversaries"]:
        kind = adversary["attack"]
        assert adversary["banned"] and adversary["accepted_files"] == 0, (kind, text)
        assert slashes[kind]["failed_check"] in EXPECTED_CHECKS[kind], (kind, slashes[kind])
        assert slashes[kind]["class"] == "fraud"
    assert None not in slashes, "an honest node was slashed"
    assert_all_gone(devnet, report)
