"""Each batch belongs to one validator, so the swarm credits it once. Two live validators in one real DHT.

Files are made by the node's own producer (node/run/producer.py, the tiny model), committed to a real outbox and
handed off by the daemon's own Delivery (node/contributor/delivery.py), which routes each to the validator its
batch is assigned to (p2p/swarm/routing.py). Both validators run in this process with their own keys, both
pinned operator keys:
- an honest node's files each go to their assigned validator, are accepted and credited there, and nowhere
  else; both validators get some; a file still pending from before envelopes signed the batch is signed again;
- a node that sends a copy to the other validator (the same bytes, or another encoding signed again) is
  answered busy at the door: nothing stored, judged or credited; each such header costs it a token of its rate
  bucket there, so a sprayer ends up rate-limited for its own work at that validator while the honest node's
  next file there is accepted. One that signs an envelope naming another batch than its rows, to get past
  that door, is judged `signer` (fraud): slashed and banned;
- a validator leaves mid-run holding receipted files it could not judge yet: the node never sends those
  elsewhere; its files still pending for the validator are judged once, by the validator that owns them next,
  once its heartbeat has expired. The validator comes back: it judges the files it had receipted, and takes
  batches only from two steps past the newest policy, so the batches that moved while it was away stay
  where they went (a copy of one sent to it is turned away). Nothing is judged by both.

Failing before this change: there was no owner, so the same file sent to a second validator was accepted and
credited there too (tests/test_validator_work_identity.py, the two-validator test, shows it on the old code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prime_node.node.contributor.delivery import Delivery
from prime_node.node.contributor.outbox import Outbox
from prime_node.node.contributor.state import NodeState
from prime_node.node.run.producer import produce_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffBusy, RolloutEnvelope, Swarm, ValidatorAnnouncement
from prime_node.p2p.swarm.routing import Batch, owner
from prime_node.proofs.rollout_file import SIG_FORMAT, sign_bytes, signature_path
from prime_node.trainer.validator.assignment import MISROUTED_RETRY_S
from prime_node.trainer.validator.run import RunningValidator

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    SPEC,
    announce_run,
    bind_node_ids,
    publish_checkpoint,
    running_validator,
    validator_settings,
    wait_verdict,
)

SECOND = Identity.from_seed(b"\x5b" * 32)  # the second validator's key, pinned beside the first
KEYS = [OPERATOR.node_id, SECOND.node_id]  # OPERATOR first: it signs the checkpoints
HONEST = Identity.from_seed(b"\x11" * 32)  # fixed keys: which validator owns which batch is then fixed too
CHEAT = Identity.from_seed(b"\x22" * 32)
LIAR = Identity.from_seed(b"\x33" * 32)
# Short heartbeats: a stopped validator drops out of every view in about 6 s (docs: heartbeat_ttl_s, 60 s).
SWARM = {"operator_keys": KEYS, "heartbeat_interval_s": 1.0, "heartbeat_ttl_s": 6.0}
BURST = (
    8  # the intake's default bucket; the first test refills it at one file a minute: spent tokens stay spent
)


def _settings(data_dir: Path, rate_per_minute: float = 30.0, **swarm: object):  # noqa: ANN202
    return validator_settings(
        data_dir, swarm={**SWARM, **swarm}, rate_per_minute=rate_per_minute, burst=BURST
    )


async def _both_live(peer: Swarm) -> bool:
    return len(await peer.live_validators(fresh=True)) == 2


def _commit(outbox: Outbox, engine, tasks, node: Identity, counter: int) -> str:  # noqa: ANN001
    """One batch as the rollout loop makes it: the producer writes and signs it, the outbox commits it."""
    staged = outbox.staging_path(f"step0-batch{counter}.parquet")
    produce_rollout_file(engine, tasks, node, dataclasses.replace(SPEC, batch_counter=counter), staged)
    sha256 = json.loads(signature_path(staged).read_text())["sha256"]
    outbox.commit(sha256, staged, signature_path(staged), 0)
    return sha256


def _produce(engine, tasks, node: Identity, counter: int, path: Path) -> RolloutEnvelope:  # noqa: ANN001
    produce_rollout_file(engine, tasks, node, dataclasses.replace(SPEC, batch_counter=counter), path)
    return RolloutEnvelope.model_validate_json(signature_path(path).read_bytes())


def _accepted(ledger_path: Path, node_id: str) -> dict[str, int]:
    """file hash -> samples credited, read with plain SQL (also from a stopped validator's ledger)."""
    with sqlite3.connect(ledger_path) as db:
        rows = db.execute(
            "SELECT file_hash, samples FROM contributions WHERE node_id = ? AND accepted = 1", (node_id,)
        ).fetchall()
    return dict(rows)


def _verdicts(ledger_path: Path, node_id: str) -> list[tuple[str, int, str | None]]:
    with sqlite3.connect(ledger_path) as db:
        return db.execute(
            "SELECT file_hash, accepted, failed_check FROM contributions WHERE node_id = ?", (node_id,)
        ).fetchall()


def _ledger(running: RunningValidator) -> Path:
    return running.service.ledger.ledger.path


def _receivers(outbox: Outbox) -> dict[str, str]:
    """file hash -> the validator that signed its receipt."""
    bodies = [json.loads(p.read_text())["body"] for p in outbox.sent.glob("*.receipt.json")]
    return {body["sha256"]: body["receiver"] for body in bodies}


async def _deliver_all(delivery: Delivery, outbox: Outbox, timeout: float) -> None:
    """Run the node's delivery until nothing is pending and every receipt is counted (the count follows the
    move to sent/: stopping at the move alone could cut the delivery between the two)."""
    task = asyncio.create_task(delivery.run(), name="delivery")
    try:
        await wait_until(lambda: _delivered(delivery, outbox), timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _delivered(delivery: Delivery, outbox: Outbox) -> bool:
    receipts = len(list(outbox.sent.glob("*.receipt.json")))
    return outbox.pending_count() == 0 and delivery.state.rollouts.handed_off == receipts


def _gzip(data: bytes) -> bytes:
    """The same rows in another Parquet encoding (the producer writes zstd): another file hash."""
    sink = io.BytesIO()
    pq.write_table(pq.read_table(io.BytesIO(data)), sink, compression="gzip")
    return sink.getvalue()


def _owner(validators: list[ValidatorAnnouncement], node: Identity, counter: int, step: int = 0) -> str:
    found = owner(RUN, Batch(node.node_id, step, counter), validators)
    assert found is not None
    return found.node_id


def _owners(validators: list[ValidatorAnnouncement], node: Identity, counters: range) -> dict[int, str]:
    return {k: _owner(validators, node, k) for k in counters}


def _counter_of(
    validators: list[ValidatorAnnouncement], node: Identity, validator_id: str, skip: int = 0
) -> int:
    """A batch counter of `node`'s, at step 0, that `validator_id` owns (the first one from `skip` on)."""
    return next(k for k in range(skip, skip + 64) if _owner(validators, node, k) == validator_id)


async def test_each_batch_is_credited_by_its_one_validator_and_copies_to_the_other_earn_nothing(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    first = _settings(tmp_path / "v1", rate_per_minute=1.0)
    publish_checkpoint(checkpoint, first.resolved_data_dir() / "validator-weights", 0)
    outbox = Outbox(tmp_path / "node" / "rollouts")
    counters = range(6)
    sent = {k: _commit(outbox, engine, tasks, HONEST, k) for k in counters}
    # One as a node of the version before v2 signed it (no batch in the envelope): signed again on the way.
    legacy = outbox.pending / f"{sent[0]}.sig"
    legacy.write_text(
        json.dumps(sign_bytes((outbox.pending / f"{sent[0]}.parquet").read_bytes(), HONEST, batch=None))
    )
    async with running_validator(first, announce=False) as v1:
        second = _settings(tmp_path / "v2", rate_per_minute=1.0, initial_peers=v1.maddrs[:1])
        publish_checkpoint(checkpoint, second.resolved_data_dir() / "validator-weights", 0)
        async with (
            running_validator(second, announce=False, identity=SECOND) as v2,
            fleet(RUN, OPERATOR) as group,
        ):
            await announce_run(v1.swarm, first.run)  # after both joined: both take work from step 0
            assert (v1.swarm.from_step, v2.swarm.from_step) == (0, 0)
            node = await group.add(HONEST, bootstrap=v1.maddrs[:1], reachability="public", **SWARM)
            cheat = await group.add(CHEAT, bootstrap=v1.maddrs[:1], reachability="public", **SWARM)
            await bind_node_ids(cheat, [LIAR])  # a second key on the cheat's host
            for peer in (node, cheat, v1.swarm, v2.swarm):
                await wait_until(lambda peer=peer: _both_live(peer), 20)
            validators = list((await node.live_validators()).values())
            owners = _owners(validators, HONEST, counters)
            assert set(owners.values()) == {OPERATOR.node_id, SECOND.node_id}  # both get some of the work

            # The honest node: every file to its owner, by the daemon's own delivery.
            state = NodeState(HONEST.node_id, OPERATOR.node_id)
            await _deliver_all(Delivery(node, outbox, state, retry_s=0.2, max_retry_s=1.0), outbox, 60)
            assert _receivers(outbox) == {sent[k]: owners[k] for k in counters}
            resigned = json.loads((outbox.sent / f"{sent[0]}.sig").read_text())
            assert [resigned[k] for k in ("format", "policy_step", "batch_counter")] == [SIG_FORMAT, 0, 0]
            by_id = {OPERATOR.node_id: v1, SECOND.node_id: v2}
            for k in counters:
                verdict = (await wait_verdict(by_id[owners[k]], sent[k], 60, HONEST.node_id)).document
                assert verdict.accepted, verdict.reason
            for validator_id, running in by_id.items():  # each file credited once, by its owner alone
                assert _accepted(_ledger(running), HONEST.node_id) == {
                    sent[k]: SPEC.samples for k in counters if owners[k] == validator_id
                }

            # The cheat's own batch, sent to its owner: accepted, as any honest node's.
            path = tmp_path / "cheat.parquet"
            envelope = _produce(engine, tasks, CHEAT, 0, path)
            mine = _owner(validators, CHEAT, 0)
            other = next(v for v in validators if v.node_id != mine)
            owned, elsewhere = by_id[mine], by_id[other.node_id]
            await cheat.send_rollout(path, envelope)
            assert (await wait_verdict(owned, envelope.sha256, 60, CHEAT.node_id)).document.accepted
            # Copies to the other validator: the same file, and the rows in another encoding signed again.
            # Each is turned away before its body, and spends a token of the cheat's bucket there.
            data = path.read_bytes()
            regzip = _gzip(data)
            copies = [(data, envelope), (regzip, RolloutEnvelope.sign(CHEAT, regzip, (0, 0)))]
            waits = []
            for copy, signed in copies * BURST:  # bounded: the bucket is empty after BURST of them
                with pytest.raises(HandoffBusy, match="not assigned here") as busy:
                    await cheat.send_rollout(copy, signed, other)
                assert f"validator {mine[:16]}" in busy.value.reason and "costs a token" in busy.value.reason
                waits.append(busy.value.retry_after_s)
                if busy.value.retry_after_s > MISROUTED_RETRY_S:
                    break
            assert waits[:BURST] == [MISROUTED_RETRY_S] * BURST and waits[BURST] > 30, waits
            assert _verdicts(_ledger(elsewhere), CHEAT.node_id) == []  # nothing judged
            assert not list(elsewhere.service.spool.directory.glob(f"*{CHEAT.node_id}*"))  # nor stored
            # The price: its own next batch that this validator does own now waits for the rate limit.
            k = _counter_of(validators, CHEAT, other.node_id, skip=1)
            path = tmp_path / "cheat-own.parquet"
            own = _produce(engine, tasks, CHEAT, k, path)
            with pytest.raises(HandoffBusy, match="rate limit"):
                await cheat.send_rollout(path, own)
            # The honest control, at the same validator: its next batch there is taken and accepted.
            k = _counter_of(validators, HONEST, other.node_id, skip=len(counters))
            path = tmp_path / "honest-next.parquet"
            honest = _produce(engine, tasks, HONEST, k, path)
            receipt = await node.send_rollout(path, honest)
            assert receipt.body.receiver == other.node_id
            assert (await wait_verdict(elsewhere, honest.sha256, 60, HONEST.node_id)).document.accepted

            # An envelope that names a batch the other validator owns, over rows of a batch it does not: past
            # the door, then judged by what the rows are. Fraud: slashed and banned.
            rows_owner = _owner(validators, LIAR, 0)
            target = by_id[next(v for v in by_id if v != rows_owner)]
            wanted = _counter_of(validators, LIAR, target.swarm.node_id, skip=1)
            path = tmp_path / "liar.parquet"
            _produce(engine, tasks, LIAR, 0, path)
            lying = RolloutEnvelope.sign(LIAR, path.read_bytes(), (0, wanted))
            await cheat.send_rollout(path, lying)  # routed by the lie, to the target
            lie = (await wait_verdict(target, lying.sha256, 60, LIAR.node_id)).document
            assert not lie.accepted and lie.failed_check == "signer", lie.reason
            assert f"envelope signs batch {wanted} of policy step 0" in lie.reason
            assert await target.service.ledger.active_ban(LIAR.node_id) is not None
            slashes = await target.service.ledger.query(
                "SELECT check_class FROM slashes WHERE node_id = ?", (LIAR.node_id,)
            )
            assert [s["check_class"] for s in slashes] == ["fraud"]
            # The cheat's work is credited once in the swarm: the file at its owner, nothing anywhere else.
            assert _accepted(_ledger(owned), CHEAT.node_id) == {envelope.sha256: SPEC.prompts * SPEC.samples}
            assert _accepted(_ledger(elsewhere), CHEAT.node_id) == {}
            # The honest node is untouched by any of it.
            for running in (v1, v2):
                assert await running.service.ledger.active_ban(HONEST.node_id) is None
            assert state.rollouts.rejected == 0 and state.rollouts.handed_off == len(counters)


@pytest.mark.slow  # waits for a validator's heartbeat to expire, and restarts it
async def test_a_validator_that_leaves_and_comes_back_costs_the_honest_node_nothing_and_judges_nothing_twice(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    first = _settings(tmp_path / "v1")
    publish_checkpoint(checkpoint, first.resolved_data_dir() / "validator-weights", 0)
    outbox = Outbox(tmp_path / "node" / "rollouts")
    state = NodeState(HONEST.node_id, OPERATOR.node_id)
    early, late = range(0, 4), range(4, 10)
    sent = {k: _commit(outbox, engine, tasks, HONEST, k) for k in early}
    async with running_validator(first, announce=False) as v1, fleet(RUN, OPERATOR) as group:
        second = _settings(tmp_path / "v2", initial_peers=v1.maddrs[:1])  # no checkpoint: it holds files
        node = await group.add(HONEST, bootstrap=v1.maddrs[:1], reachability="public", **SWARM)
        delivery = Delivery(node, outbox, state, retry_s=0.2, max_retry_s=1.0)
        async with running_validator(second, announce=False, identity=SECOND) as v2:
            await announce_run(v1.swarm, first.run)
            for peer in (node, v1.swarm, v2.swarm):
                await wait_until(lambda peer=peer: _both_live(peer), 20)
            both = list((await node.live_validators()).values())
            owners = _owners(both, HONEST, range(10))
            receipted_by_second = {sent[k] for k in early if owners[k] == SECOND.node_id}
            left_behind = [k for k in late if owners[k] == SECOND.node_id]
            assert receipted_by_second and left_behind  # the second validator has work of both kinds
            await _deliver_all(delivery, outbox, 60)  # the early batches, each to its owner
            assert _receivers(outbox) == {sent[k]: owners[k] for k in early}
            for k in early:
                if owners[k] == OPERATOR.node_id:
                    assert (await wait_verdict(v1, sent[k], 60, HONEST.node_id)).document.accepted
            await wait_until(
                lambda: _held(v2, len(receipted_by_second)), 30
            )  # receipted, waiting to be judged
        # The second validator has left, holding receipted work. The node goes on producing; the batches the
        # second one would have owned wait for it, then go to their runner-up once its heartbeat has expired.
        sent |= {k: _commit(outbox, engine, tasks, HONEST, k) for k in late}
        await _deliver_all(delivery, outbox, 90)
        for k in late:
            verdict = (await wait_verdict(v1, sent[k], 60, HONEST.node_id)).document
            assert verdict.accepted, verdict.reason
        receivers = _receivers(outbox)
        assert all(receivers[sent[k]] == OPERATOR.node_id for k in late)
        assert {h for h, r in receivers.items() if r == SECOND.node_id} == receipted_by_second  # never resent

        # It comes back (its checkpoint fetched meanwhile), after its batches moved: it judges what it receipted,
        # and takes batches only from two steps past the newest policy, so what moved stays where it went.
        publish_checkpoint(checkpoint, second.resolved_data_dir() / "validator-weights", 0)
        async with running_validator(second, announce=False, identity=SECOND) as v2:
            assert v2.swarm.from_step == 2  # the newest policy is step 0; it started at 0
            for h in receipted_by_second:
                assert (await wait_verdict(v2, h, 60, HONEST.node_id)).document.accepted
            await wait_until(lambda: _second_from_step(node, 2), 20)
            for k in range(32):
                assert (await node.owner_of(Batch(HONEST.node_id, 0, k))).node_id == OPERATOR.node_id
            later = {(await node.owner_of(Batch(HONEST.node_id, 2, k))).node_id for k in range(32)}
            assert later == {OPERATOR.node_id, SECOND.node_id}  # from step 2 on, the work is shared again
            moved = left_behind[0]  # judged by the first validator while the second was away
            path = outbox.sent / f"{sent[moved]}.parquet"
            envelope = RolloutEnvelope.model_validate_json((outbox.sent / f"{sent[moved]}.sig").read_bytes())
            returned = (await node.live_validators())[SECOND.node_id]
            with pytest.raises(HandoffBusy, match=f"not assigned here.*validator {OPERATOR.node_id[:16]}"):
                await node.send_rollout(path, envelope, returned)
            second_ledger = _ledger(v2)
        # Judged once: every batch has one verdict, in one of the two ledgers, and each was accepted.
        judged_first = {h for h, *_ in _verdicts(_ledger(v1), HONEST.node_id)}
        judged_second = {h for h, *_ in _verdicts(second_ledger, HONEST.node_id)}
        assert not judged_first & judged_second
        assert judged_first | judged_second == set(sent.values())
        assert judged_second == receipted_by_second
        assert state.rollouts.handed_off == len(sent) and state.rollouts.rejected == 0


async def _held(running: RunningValidator, n: int) -> bool:
    return len(running.service.held) == n


async def _second_from_step(peer: Swarm, step: int) -> bool:
    found = (await peer.live_validators(fresh=True)).get(SECOND.node_id)
    return found is not None and found.from_step == step
