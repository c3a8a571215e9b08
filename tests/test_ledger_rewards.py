"""The reward curve in the ledger: recomputed task rewards of accepted files per step, persisted, migrated."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import aiohttp
import pytest

from prime_node.trainer.ledger import Ledger, LedgerError
from prime_node.trainer.ledger.schema import CREATE_MIGRATIONS_TABLE, LATEST_VERSION, MIGRATIONS
from prime_node.trainer.validator.dashboard import create_app, ledger_rewards, serve

from support.ledger import T0, node_id, signed_verdict

A, B = node_id(50), node_id(51)


def test_mean_task_reward_per_step_over_accepted_samples(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        resent = signed_verdict(A, step=1, samples=4, at=T0)
        ledger.record(resent, task_reward_sum=4.0)
        assert ledger.record(resent, task_reward_sum=0.0).duplicate  # a resend changes nothing
        ledger.record(signed_verdict(B, step=1, samples=12, at=T0 + 1), task_reward_sum=3.0)
        ledger.record(signed_verdict(A, step=3, samples=8, at=T0 + 2), task_reward_sum=2.0)
        ledger.record(signed_verdict(B, step=2, samples=8, at=T0 + 3))  # no reward known: not on the curve
        ledger.record(signed_verdict(B, step=2, accepted=False, failed_check="rewards", at=T0 + 4))
        points = ledger.reward_curve()
        assert [(p.step, p.samples, p.files) for p in points] == [(1, 16, 2), (3, 8, 1)]
        assert [p.reward for p in points] == pytest.approx([7.0 / 16, 0.25])  # per sample, not per file
        assert [p.step for p in ledger.reward_curve(last_steps=1)] == [3]  # the newest steps
    with Ledger(path) as reopened:  # persisted: a restarted validator draws the same curve
        assert [p.step for p in reopened.reward_curve()] == [1, 3]


def test_rewards_only_for_accepted_files_and_within_bounds(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        with pytest.raises(LedgerError, match="task_reward_sum"):
            ledger.record(signed_verdict(A, accepted=False, failed_check="schema"), task_reward_sum=0.0)
        with pytest.raises(LedgerError, match="task_reward_sum"):
            ledger.record(signed_verdict(A, samples=4), task_reward_sum=4.5)  # rewards are in [0, 1] per row
        assert ledger.reward_curve() == []


def test_a_version_1_ledger_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for statement in MIGRATIONS[0].statements:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_migrations VALUES (1, ?, ?)", (MIGRATIONS[0].name, T0))
    old = signed_verdict(A, step=0, samples=4, at=T0).document
    conn.execute(
        "INSERT INTO contributions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (old.file_hash, A, 0, 4, 100, 1, None, "", old.validator_id, T0, T0, T0, "{}"),
    )
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        assert ledger.schema_version() == LATEST_VERSION
        assert ledger.query("SELECT task_reward_sum FROM contributions")[0]["task_reward_sum"] is None
        assert ledger.reward_curve() == []  # an unknown reward is left out, never drawn as 0
        ledger.record(signed_verdict(B, step=1, samples=2, at=T0 + 1), task_reward_sum=1.0)
        assert [(p.step, p.reward) for p in ledger.reward_curve()] == [(1, 0.5)]


async def test_rewards_endpoint_serves_the_ledger_curve(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        runner, url = await serve(create_app(ledger, rewards=ledger_rewards(ledger)), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                async with http.get(f"{url}/api/rewards") as resp:
                    assert await resp.json() == {"available": True, "points": []}
                ledger.record(signed_verdict(A, step=4, samples=10, at=T0), task_reward_sum=9.0)
                async with http.get(f"{url}/api/rewards") as resp:
                    body = await resp.json()
            point = {"step": 4, "reward": 0.9, "samples": 10, "files": 1}
            assert body == {"available": True, "points": [point]}
        finally:
            await runner.cleanup()
