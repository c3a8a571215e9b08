"""The validator service end to end on 127.0.0.1: real swarm peers, hand-off, tiny model, ledger, DHT bans."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request
from pathlib import Path

import pytest

from prime_node.node.engine import HFEngine
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.run.validation import RunTasks
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffRefused, RolloutEnvelope, ValidatorAnnouncement
from prime_node.p2p.verdicts import Verdict, open_signed

from support.attack import engine_from
from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    envelope_for,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)


def _contributions(running, node_id: str) -> list:  # noqa: ANN001
    return running.service.ledger.ledger.query(
        "SELECT file_hash, accepted, samples, tokens FROM contributions WHERE node_id = ?", (node_id,)
    )


async def test_honest_file_is_accepted_delivered_and_credited_once(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    node = Identity.generate()
    produced = rows_for(engine, tasks, node)
    path, envelope = write_file(tmp_path / "honest.parquet", produced, node)
    settings = validator_settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        receipt = await sender.send_rollout(path, envelope)
        assert receipt.body.sha256 == envelope.sha256
        verdict = (await wait_verdict(running, envelope.sha256, 30)).document
        assert verdict.accepted and verdict.failed_check is None, verdict.reason
        assert verdict.validator_id == OPERATOR.node_id and verdict.samples == 2 and verdict.tokens > 0
        inbox = settings.resolved_data_dir() / "accepted"
        await wait_until(lambda: _spool_empty(running), 10)  # the verdict is recorded first, then delivered
        name = f"{envelope.sha256}-{node.node_id}"  # one sender's delivery of these bytes
        assert (inbox / f"{name}.parquet").read_bytes() == path.read_bytes()
        assert (inbox / f"{name}.parquet.sig").is_file()

        again = await sender.send_rollout(path, envelope)  # a resend is acknowledged, credited once
        assert again.body.sha256 == envelope.sha256
        await asyncio.sleep(0.5)
        rows = _contributions(running, node.node_id)
        assert [(r["accepted"], r["samples"]) for r in rows] == [(1, 2)]
        assert running.service.verdicts == 1
        # /metrics counts the file once too: one receipt-to-verdict latency, one verification (the resend's
        # receipt is not a new file).
        url = f"{running.dashboard_url}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        for line in (
            "prime_node_validator_files_received_total 1.0",
            "prime_node_validator_files_accepted_total 1.0",
            "prime_node_validator_verdict_latency_seconds_count 1.0",
            "prime_node_validator_verification_seconds_count 1.0",
            "prime_node_validator_queue_depth 0.0",
        ):
            assert line in text.splitlines(), line

        url = f"{running.dashboard_url}/api/leaderboard"
        raw = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        board = json.loads(raw)
        assert board["nodes"][0]["node_id"] == node.node_id
        # The reward curve comes from the rewards the validator recomputed for the accepted file.
        url = f"{running.dashboard_url}/api/rewards"
        curve = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read()))
        mean = sum(r.task_reward for r in produced) / len(produced)
        assert curve["available"] and [(p["step"], p["samples"]) for p in curve["points"]] == [(0, 2)]
        assert abs(curve["points"][0]["reward"] - mean) < 1e-9


async def _spool_empty(running) -> bool:  # noqa: ANN001
    return not list(running.service.spool.directory.iterdir())


def _attacks(engine: HFEngine, tasks: RunTasks, nodes: list[Identity]) -> dict[str, list]:
    """Three cheats, each by its own node: tampered reward, another checkpoint, unassigned samples."""
    honest = rows_for(engine, tasks, nodes[0])
    tampered = [
        dataclasses.replace(
            honest[0],
            task_reward=1.0 - honest[0].task_reward,
            reward=1.0 - honest[0].task_reward - honest[0].length_penalty,
        ),
        *honest[1:],
    ]
    other_model = rows_for(engine_from(build_tiny_model(1)[0]), tasks, nodes[1])
    shifted = [
        dataclasses.replace(r, sample_index=(r.sample_index + 1) % tasks.task_count)
        for r in rows_for(engine, tasks, nodes[2])
    ]
    return {"rewards": tampered, "toploc": other_model, "assignment": shifted}


@pytest.mark.slow
async def test_attacks_are_rejected_slashed_and_banned_through_the_dht(tmp_path: Path, world) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    cheats = [Identity.generate() for _ in range(3)]
    attacks = _attacks(engine, tasks, cheats)
    settings = validator_settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        witness = await group.add(bootstrap=running.maddrs[:1], reachability="public")
        await witness.serve_rollouts(tmp_path / "witness", lambda received: None)
        for cheat, (expected, rows) in zip(cheats, attacks.items(), strict=True):
            path, envelope = write_file(tmp_path / f"{expected}.parquet", rows, cheat)
            sender = await group.add(cheat, bootstrap=running.maddrs[:1], reachability="public")
            await wait_until(lambda s=sender: sees_a_validator(s), 15)
            await sender.send_rollout(path, envelope)
            verdict = (await wait_verdict(running, envelope.sha256, 30)).document
            assert not verdict.accepted and verdict.failed_check == expected, verdict.reason
            assert verdict.reason and not verdict.reason.startswith(expected)  # the check is failed_check
            # The sender can fetch the signed verdict and check it against the validator's key.
            url = f"{running.dashboard_url}/api/verdict/{envelope.sha256}/{cheat.node_id}"
            raw = await asyncio.to_thread(lambda u=url: urllib.request.urlopen(u, timeout=5).read())
            assert open_signed(raw, Verdict, {OPERATOR.node_id}).document == verdict
            assert (await running.service.ledger.active_ban(cheat.node_id)) is not None
            score = running.service.ledger.ledger.query(
                "SELECT score FROM nodes WHERE node_id = ?", (cheat.node_id,)
            )
            assert score[0]["score"] < 0  # slashed
            # Another peer sees the operator-signed ban in the DHT and refuses the cheat's hand-off.
            await wait_until(lambda c=cheat: _banned_in_dht(witness, c.node_id), 15)
            target = ValidatorAnnouncement(
                node_id=witness.node_id,
                peer_id=witness.peer_id,
                addresses=(await witness.maddrs())[:8],
                max_rollout_bytes=1 << 20,
                published_at=time.time(),
            )
            with pytest.raises(HandoffRefused, match="banned"):
                await sender.send_rollout(path, envelope, validator=target)
            with pytest.raises(HandoffRefused, match="banned"):  # and the validator refuses it too
                await sender.send_rollout(path.read_bytes() + b"x", _resigned(path, cheat))
        await wait_until(lambda: _spool_empty(running), 10)
        assert not list((settings.resolved_data_dir() / "accepted").glob("*.parquet"))


async def _banned_in_dht(swarm, node_id: str) -> bool:  # noqa: ANN001
    return node_id in await swarm.read_bans()


def _resigned(path: Path, node: Identity) -> RolloutEnvelope:
    return envelope_for(node, path.read_bytes() + b"x", (0, 0))
