"""Pipelined groups through the real validator service on 127.0.0.1: each member hands in its signed stage file
over the swarm, the validator collects the group, judges it with verify_group and records one verdict per file
in its ledger (credit, slash and ban as docs/pipeline.md's verdict policy says). Every group is formed by an
operator-signed group record in the DHT, as the trainer's coordinator publishes them; a group without one is not
credited."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm import HandoffBusy, RolloutEnvelope, Swarm
from prime_node.p2p.swarm.group_records import GroupRecord
from prime_node.p2p.swarm.handoff import stored_name
from prime_node.proofs.pipeline.records import GroupSpec
from prime_node.proofs.pipeline.stage_file import StageFile, read_stage_file
from prime_node.proofs.rollout_file import SIG_SUFFIX, sign_bytes, signature_path
from prime_node.proofs.work_identity import sample_ids
from prime_node.trainer.service.inbox import Inbox
from prime_node.trainer.validator import service as service_module
from prime_node.trainer.validator.spool import Spool

from support.nonces import formed_at_of, nonce_at
from support.pipeline_attacks import perturb_stage_
from support.pipeline_files import drop_a_row, fraud_report_file, group_files, partial_report_files
from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    VALIDATOR_RUN,
    bind_node_ids,
    publish_checkpoint,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
)

# Batches of 2 prompts cut in micro-batches of 2 rows: the row a broken batch's last stage drops needs 2 rows.
PIPELINED = VALIDATOR_RUN.model_copy(
    update={"pipeline": StageLayout(boundaries=[0, 2, 4], prompts=2, micro_batch_size=2)}
)
GRACE_S = 4.0


def _settings(data_dir: Path):  # noqa: ANN202
    settings = validator_settings(data_dir, group_grace_s=GRACE_S)
    return settings.model_copy(update={"run": PIPELINED})


def _envelope(path: Path) -> RolloutEnvelope:
    return RolloutEnvelope.model_validate_json(signature_path(path).read_bytes())


async def _form(operator: Swarm, *specs: GroupSpec, round_: int = 1) -> None:
    """Sign and publish each group's record with the operator's key, as the trainer's coordinator does."""
    now = time.time()
    for spec in specs:
        record = GroupRecord(
            group_id=spec.group_id,
            round=round_,
            policy_step=spec.policy_step,
            layout=spec.layout,
            members=list(spec.members),
            formed_at=formed_at_of(spec.nonce),  # the formation its files' nonce names
            signed_at=now,
            nonce=spec.nonce,
        )
        assert await operator.publish_group(record)


async def _ledger(running, node_id: str) -> tuple[list[tuple[int, str | None]], float, int, bool]:  # noqa: ANN001
    """(accepted, failed check) of the node's files, its score, its slashes, and whether it is banned."""
    ledger = running.service.ledger.ledger
    files = ledger.query("SELECT accepted, failed_check FROM contributions WHERE node_id = ?", (node_id,))
    score = ledger.query("SELECT score FROM nodes WHERE node_id = ?", (node_id,))
    slashes = ledger.query("SELECT COUNT(*) AS n FROM slashes WHERE node_id = ?", (node_id,))[0]["n"]
    banned = await running.service.ledger.active_ban(node_id) is not None
    return (
        [(r["accepted"], r["failed_check"]) for r in files],
        score[0]["score"] if score else 0.0,
        slashes,
        banned,
    )


async def test_groups_are_credited_blamed_and_timed_out_through_the_validator(
    tmp_path: Path, world, caplog
) -> None:  # noqa: ANN001
    checkpoint, engine, tasks = world
    honest = [Identity.generate() for _ in range(2)]
    cheat_group = [Identity.generate() for _ in range(2)]  # stage 0 computes with perturbed weights
    lonely = [Identity.generate() for _ in range(2)]  # stage 1 never hands its file in
    framed = [Identity.generate() for _ in range(2)]  # stage 0 sends a frame its commitment belies
    broken = [Identity.generate() for _ in range(2)]  # stage 1 drops a row: the batch breaks at stage 0
    made = {
        "honest": group_files(tmp_path / "honest", checkpoint, PIPELINED, tasks, engine, honest),
        "cheat": group_files(
            tmp_path / "cheat",
            checkpoint,
            PIPELINED,
            tasks,
            engine,
            cheat_group,
            corrupt=lambda processors: perturb_stage_(processors[0], 1e-2, seed=1),
        ),
        "lonely": group_files(tmp_path / "lonely", checkpoint, PIPELINED, tasks, engine, lonely),
    }
    framed_spec, report = fraud_report_file(tmp_path / "fraud", checkpoint, PIPELINED, tasks, engine, framed)
    _, false_report = fraud_report_file(
        tmp_path / "fraud", checkpoint, PIPELINED, tasks, engine, framed, batch=1
    )
    _swap_tensor(false_report, framed[1])  # evidence of a frame that is not the one the accused signed
    broken_spec, partials = partial_report_files(
        tmp_path / "broken", checkpoint, PIPELINED, tasks, engine, broken, drop_a_row(1, "tokens", 1)
    )
    settings = _settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as swarm:
        # The validator's key is the operator's here (support/validator.py): it signs the group records too.
        await _form(running.swarm, *(made[name].spec for name in made), framed_spec, broken_spec)
        senders = {}
        for member in honest + cheat_group + lonely[:1] + framed[1:] + broken:
            senders[member.node_id] = await swarm.add(
                member, bootstrap=running.maddrs[:1], reachability="public"
            )
        await wait_until(lambda: sees_a_validator(senders[honest[0].node_id]), 15)
        for name, members in (("honest", honest), ("cheat", cheat_group), ("lonely", lonely[:1])):
            for member, path in zip(members, made[name].paths, strict=False):
                envelope = _envelope(path)
                assert envelope.group == made[name].spec.group_id
                await senders[member.node_id].send_rollout(path, envelope)
        for path in (report, false_report):
            assert _envelope(path).kind == "fraud"
            await senders[framed[1].node_id].send_rollout(path, _envelope(path))
        # Both members of the broken batch hand in their partial records (the culprit's software reports too).
        for member, path in zip(broken, partials, strict=True):
            assert _envelope(path).kind == "partial"
            await senders[member.node_id].send_rollout(path, _envelope(path))

        def verdict(name: str, stage: int):  # noqa: ANN202
            path = made[name].paths[stage]
            return wait_verdict(running, _envelope(path).sha256, 60 + GRACE_S)

        # Honest: every member's file accepted, every member credited its stage's share of the layers (2 of 4
        # each): the group's one batch earns one unit of credit, as a monolithic node's file of it would.
        for stage in range(2):
            v = (await verdict("honest", stage)).document
            assert v.accepted and v.samples == 4, v.reason
        for member in honest:
            assert await _ledger(running, member.node_id) == ([(1, None)], 0.5, 0, False)
        shares = running.service.ledger.ledger.query(
            "SELECT credit_share FROM contributions WHERE node_id IN (?, ?)", tuple(m.node_id for m in honest)
        )
        assert [r["credit_share"] for r in shares] == [0.5, 0.5]
        # Corrupting stage 0: its file rejected as the blamed stage, slashed and banned; stage 1 is neither
        # blamed nor penalised (and not credited: the batch is unusable).
        blamed = (await verdict("cheat", 0)).document
        assert not blamed.accepted and blamed.failed_check == "pipeline", blamed.reason
        assert blamed.reason.startswith("stage 0: its activations are not the checkpoint's"), blamed.reason
        successor = (await verdict("cheat", 1)).document
        assert not successor.accepted and successor.failed_check == "pipeline_group", successor.reason
        files, score, slashes, banned = await _ledger(running, cheat_group[0].node_id)
        assert files == [(0, "pipeline")] and score < 0 and slashes == 1 and banned
        assert await _ledger(running, cheat_group[1].node_id) == ([(0, "pipeline_group")], 0.0, 0, False)
        # A missing stage: after the grace period the present member's file is rejected without penalty.
        lonely_verdict = (await verdict("lonely", 0)).document
        assert not lonely_verdict.accepted and lonely_verdict.failed_check == "pipeline_incomplete"
        assert "stages [1]" in lonely_verdict.reason and "grace period" in lonely_verdict.reason
        assert await _ledger(running, lonely[0].node_id) == ([(0, "pipeline_incomplete")], 0.0, 0, False)
        # Fraud evidence: the receiver's report blames stage 0 at once (its own signed frame), the reporter is
        # excused, not credited (a sybil pair could farm credit); evidence that proves nothing is its reporter's fault.
        sha = _envelope(report).sha256
        upheld = (await wait_verdict(running, sha, 30, node_id=framed[1].node_id)).document
        assert not upheld.accepted and upheld.failed_check == "pipeline_report_upheld", upheld.reason
        accused = (await wait_verdict(running, sha, 30, node_id=framed[0].node_id)).document
        assert not accused.accepted and accused.failed_check == "pipeline", accused.reason
        assert "belies the commitment it signed" in accused.reason
        files, score, slashes, banned = await _ledger(running, framed[0].node_id)
        assert files == [(0, "pipeline")] and slashes == 1 and banned
        false = (await wait_verdict(running, _envelope(false_report).sha256, 30)).document
        assert not false.accepted and false.failed_check == "pipeline_report", false.reason
        files, score, slashes, banned = await _ledger(running, framed[1].node_id)
        assert sorted(files, key=str) == [(0, "pipeline_report"), (0, "pipeline_report_upheld")], files
        assert score < 0 and slashes == 1 and not banned
        # A broken batch: the partial records name stage 1, which sampled fewer rows than it was given; stage 0
        # is excused.
        excused = (await wait_verdict(running, _envelope(partials[0]).sha256, 60)).document
        assert not excused.accepted and excused.failed_check == "pipeline_incomplete", excused.reason
        dropped = (await wait_verdict(running, _envelope(partials[1]).sha256, 30)).document
        assert not dropped.accepted and dropped.failed_check == "pipeline", dropped.reason
        assert dropped.reason.startswith("stage 1: frame") and "carries rows" in dropped.reason
        assert (await _ledger(running, broken[0].node_id))[1:] == (0.0, 0, False)
        files, score, slashes, banned = await _ledger(running, broken[1].node_id)
        assert files == [(0, "pipeline")] and slashes == 1 and banned
        # The accepted group's samples reach the trainer once: its last stage's file alone is in the trainer's
        # inbox (stage 0's holds the same samples under its own node id); nothing of a rejected or excused group.
        await wait_until(lambda: _spool_empty(running), 10)
        accepted = settings.resolved_data_dir() / "accepted"
        last = read_stage_file(made["honest"].paths[1])
        _trains_on_the_group_once(accepted, last)
        # After a crash between the verdict and the delivery, recovery delivers the same file again, alone.
        shutil.rmtree(accepted)
        for path, member in zip(made["honest"].paths, honest, strict=True):
            entry = running.service.spool.entry(_envelope(path).sha256, member.node_id)
            shutil.copyfile(path, entry.path)
            shutil.copyfile(signature_path(path), entry.sig_path)
        await running.service.recover()
        assert await _spool_empty(running)
        _trains_on_the_group_once(accepted, last)
        # A stage file that is not the last stage's is refused by the trainer's inbox, should one get there.
        stray = tmp_path / "stray"
        stray.mkdir()
        for suffix in ("", SIG_SUFFIX):
            shutil.copyfile(f"{made['honest'].paths[0]}{suffix}", stray / f"stage0.parquet{suffix}")
        with caplog.at_level(logging.WARNING):
            assert Inbox(stray, RUN).read(stray / "stage0.parquet") is None
        assert "the file of stage 0 of a 2-stage group" in caplog.text
        await asyncio.sleep(0)


def _trains_on_the_group_once(accepted: Path, last: StageFile) -> None:
    """The trainer's inbox offers exactly the group's last stage's file, read as the group's samples."""
    inbox = Inbox(accepted, RUN, temperature=PIPELINED.temperature)
    pending = inbox.pending()
    assert [p.name for p in pending] == [f"{stored_name(last.sha256, last.signer)}.parquet"]
    record = inbox.read(pending[0])
    assert record is not None and record.file_id == last.sha256
    assert [(s.prompt_ids, s.completion_ids) for s in record.samples] == [
        (r.prompt_ids, r.output_ids) for r in last.rows
    ]
    assert [s.task_reward for s in record.samples] == [r.task_reward for r in last.rows]
    assert [s.sample_id for s in record.samples] == [i.key() for i in sample_ids(last.rows)]


async def test_a_group_claiming_a_far_future_step_is_refused_at_once_not_held(tmp_path: Path, world) -> None:  # noqa: ANN001
    # A made-up step must not hold a group slot for the whole hold timeout: the rollout path's refusal applies.
    checkpoint, engine, tasks = world
    members = [Identity.generate() for _ in range(2)]
    far = group_files(tmp_path / "far", checkpoint, PIPELINED, tasks, engine, members, step=50)
    settings = validator_settings(tmp_path / "validator", group_grace_s=GRACE_S, hold_timeout_s=600.0)
    settings = settings.model_copy(update={"run": PIPELINED})
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as swarm:
        await _form(running.swarm, far.spec)
        sender = await swarm.add(members[0], bootstrap=running.maddrs[:1], reachability="public")
        await wait_until(lambda: sees_a_validator(sender), 15)
        await sender.send_rollout(far.paths[0], _envelope(far.paths[0]))
        verdict = (await wait_verdict(running, _envelope(far.paths[0]).sha256, 30)).document
        assert not verdict.accepted and verdict.failed_check == "policy_step", verdict.reason
        assert "beyond the newest announced step" in verdict.reason, verdict.reason


async def test_files_of_a_batch_shape_the_run_has_since_changed_are_excused_not_fraud(
    tmp_path: Path, world
) -> None:  # noqa: ANN001
    # The trainer is restarted with another batch shape under the same run id (docs/protocol.md allows it) and its
    # coordinator re-forms the same members at the same step. While the group id was the digest of run, step and
    # members only, that was the same group: the validator kept the newer round's record (the new shape) and
    # judged the members' files of the old shape by it (`run_parameters`: fraud, slashed and banned). The layout
    # is now part of the id: the new record forms another group, the old files belong to the old record, whose
    # layout is not the run's (`pipeline_unformed`: excused, neither credited nor slashed).
    checkpoint, engine, tasks = world
    members = [Identity.generate() for _ in range(2)]
    assert PIPELINED.pipeline is not None
    old_layout = PIPELINED.pipeline.model_copy(update={"micro_batch_size": 1})
    old = group_files(
        tmp_path / "old",
        checkpoint,
        PIPELINED.model_copy(update={"pipeline": old_layout}),
        tasks,
        engine,
        members,
    )
    new = GroupSpec(RUN, 0, 0, PIPELINED.pipeline, old.spec.members, old.spec.nonce)
    assert new.group_id != old.spec.group_id  # one id for both was the finding
    settings = _settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as swarm:
        await _form(running.swarm, old.spec, round_=1)
        await _form(running.swarm, new, round_=2)  # the restarted coordinator's newer round
        host = await swarm.add(Identity.generate(), bootstrap=running.maddrs[:1], reachability="public")
        await bind_node_ids(host, members)
        await wait_until(lambda: sees_a_validator(host), 15)
        for path in old.paths:
            await host.send_rollout(path, _envelope(path))
        for member, path in zip(members, old.paths, strict=True):
            v = (await wait_verdict(running, _envelope(path).sha256, 30)).document
            assert not v.accepted and v.failed_check == "pipeline_unformed", v.reason
            assert "layout is not the run's (micro_batch_size 1, the run's 2)" in v.reason, v.reason
            assert await _ledger(running, member.node_id) == ([(0, "pipeline_unformed")], 0.0, 0, False)


@pytest.mark.slow
async def test_only_formed_groups_are_credited_and_junk_starts_no_grace_period(tmp_path: Path, world) -> None:  # noqa: ANN001
    # A group of real, signed work that no operator-signed record formed (one operator running every stage under
    # its own identities) is not credited, nor slashed; a record naming the same members in another order is
    # another group's (its id is another digest), and so is one of the same members of another formation (its
    # nonce is in the digest), so for this group there is no record: the record's member and
    # step checks (`why_not_formed`) are defence in depth, which no file can reach. A stranger's junk file routed
    # to a formed group's key is refused before it is read (the record does not name its sender) and does not
    # start the group's grace period: members arriving within the grace of the first *valid* file are judged
    # together.
    checkpoint, engine, tasks = world
    members = [Identity.generate() for _ in range(2)]
    self_made = [Identity.generate() for _ in range(2)]
    stranger = Identity.generate()
    formed = group_files(tmp_path / "formed", checkpoint, PIPELINED, tasks, engine, members)
    unformed = group_files(tmp_path / "self", checkpoint, PIPELINED, tasks, engine, self_made)
    other_order = GroupSpec(RUN, 0, 0, unformed.spec.layout, unformed.spec.members[::-1], unformed.spec.nonce)
    # The same members in the same order, of another formation (another nonce): another group's record too.
    other_formation = GroupSpec(
        RUN, 0, 0, unformed.spec.layout, unformed.spec.members, nonce_at(1_700_000_001.0)
    )
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"junk" * 1000)
    signature_path(junk).write_text(
        json.dumps(sign_bytes(junk.read_bytes(), stranger, batch=(0, 0), group=formed.spec.group_id))
    )
    grace_s = 6.0
    settings = validator_settings(tmp_path / "validator", group_grace_s=grace_s)
    settings = settings.model_copy(update={"run": PIPELINED})
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as swarm:
        await _form(running.swarm, formed.spec, other_order, other_formation)
        # One host hands in every node's files (each node id bound to its peer id by a signed heartbeat).
        host = await swarm.add(stranger, bootstrap=running.maddrs[:1], reachability="public")
        await bind_node_ids(host, [*members, *self_made])
        await wait_until(lambda: sees_a_validator(host), 15)
        # The self-made group first: its verdicts also show that the validator judges groups by now.
        for path in unformed.paths:
            await host.send_rollout(path, _envelope(path))
        for member, path in zip(self_made, unformed.paths, strict=True):
            v = (await wait_verdict(running, _envelope(path).sha256, 30)).document
            assert not v.accepted and v.failed_check == "pipeline_unformed", v.reason
            assert "no operator-signed group record forms this group" in v.reason, v.reason
            assert await _ledger(running, member.node_id) == ([(0, "pipeline_unformed")], 0.0, 0, False)
        # Junk, then stage 0 4 s after it and stage 1 8 s after it: past the junk's grace period (6 s), within
        # stage 0's.
        await host.send_rollout(junk, _envelope(junk))
        t0 = time.monotonic()
        for stage, at in ((0, 4.0), (1, 8.0)):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            path = formed.paths[stage]
            await host.send_rollout(path, _envelope(path))
        # Refused unread: its own envelope names a group whose record does not name it (as the stage file's
        # reader would find of any file it could send there: `signer`, fraud).
        refused = (await wait_verdict(running, _envelope(junk).sha256, 30)).document
        assert not refused.accepted and refused.failed_check == "signer", refused.reason
        assert "not a member of group" in refused.reason, refused.reason
        files, _, slashes, banned = await _ledger(running, stranger.node_id)
        assert files == [(0, "signer")] and slashes == 1 and banned
        for stage in range(2):
            v = (await wait_verdict(running, _envelope(formed.paths[stage]).sha256, 30 + grace_s)).document
            assert v.accepted, v.reason
        assert not running.service.groups.pending and not running.service.groups.arrivals


@pytest.mark.slow
async def test_group_records_are_read_again_until_the_grace_ends_and_kept_across_a_restart(
    tmp_path: Path, world, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    # A read that does not show a group's record is not the last word: the validator reads again until the
    # file's grace period ends, and a record published after an earlier read still forms the group. Reads that all
    # fail run the grace out: the file is excused as the validator's failure. The records it saw are kept on disk:
    # after a restart, files spooled before it find their group's record although the DHT no longer has it.
    checkpoint, engine, tasks = world
    late, unread, kept = ([Identity.generate() for _ in range(2)] for _ in range(3))
    files = {
        name: group_files(tmp_path / name, checkpoint, PIPELINED, tasks, engine, members)
        for name, members in (("late", late), ("unread", unread), ("kept", kept))
    }
    grace_s = 6.0
    settings = validator_settings(tmp_path / "validator", group_grace_s=grace_s, group_records_refresh_s=0.5)
    settings = settings.model_copy(update={"run": PIPELINED})
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as swarm:
        host = await swarm.add(Identity.generate(), bootstrap=running.maddrs[:1], reachability="public")
        await bind_node_ids(host, [*late, *unread])
        await wait_until(lambda: sees_a_validator(host), 15)
        formed = running.service.formed
        dht_read, failed = formed.read, []

        async def broken_read():  # noqa: ANN202 - the DHT unreachable from the validator
            failed.append(time.monotonic())
            raise OSError("no DHT peer answered")

        formed.read = broken_read
        await _form(running.swarm, files["unread"].spec)
        path = files["unread"].paths[0]
        sent = time.monotonic()
        await host.send_rollout(path, _envelope(path))
        v = (await wait_verdict(running, _envelope(path).sha256, 30 + grace_s)).document
        assert not v.accepted and v.failed_check == "internal_error", v.reason
        assert "could not read the operator's group records" in v.reason, v.reason
        assert len(failed) >= 3 and failed[-1] - failed[0] >= grace_s / 2  # read again while the grace lasted
        assert time.monotonic() - sent >= grace_s
        formed.read = dht_read
        # The late group's files arrive; a read answers without its record; then the operator publishes it.
        sent_at = time.time()
        for path in files["late"].paths:
            await host.send_rollout(path, _envelope(path))

        async def answered_without_it() -> bool:
            return formed.answered_since(sent_at) and bool(running.service.unformed_waiting)

        await wait_until(answered_without_it, 10)
        assert formed.find(files["late"].spec.group_id) is None
        # While a sender's files wait for a record not known, its next file for an unknown group is busy beyond
        # the cap (here 1): a made-up group's files cost nothing but their wait.
        monkeypatch.setattr(service_module, "MAX_UNFORMED_WAITING", 1)
        header = _envelope(files["kept"].paths[0]).model_copy(update={"node_id": late[0].node_id})
        assert running.service.unformed_waiting[late[0].node_id] == 1
        with pytest.raises(HandoffBusy, match="wait for a group record this validator does not know"):
            await running.service.admit(header)
        monkeypatch.undo()
        await _form(running.swarm, files["late"].spec, files["kept"].spec)
        for path in files["late"].paths:
            v = (await wait_verdict(running, _envelope(path).sha256, 30 + grace_s)).document
            assert v.accepted, v.reason

        async def saved() -> bool:
            return (settings.resolved_data_dir() / "group-records.json").exists()

        await wait_until(saved, 10)
    # A restart with the kept group's files in the spool, in a swarm whose DHT never held its record.
    spool = Spool(settings.path(settings.validator.spool_dir, "spool"))
    for path, member in zip(files["kept"].paths, kept, strict=True):
        entry = spool.entry(_envelope(path).sha256, member.node_id)
        shutil.copyfile(path, entry.path)
        shutil.copyfile(signature_path(path), entry.sig_path)
    async with running_validator(settings) as running:
        # No table at all: the swarm's reader says so (None), which a read that found the table never does.
        assert await running.swarm.read_group_records() is None
        assert running.service.formed.find(files["kept"].spec.group_id) is not None
        for path in files["kept"].paths:
            v = (await wait_verdict(running, _envelope(path).sha256, 30 + grace_s)).document
            assert v.accepted, v.reason


def _swap_tensor(path: Path, reporter: Identity) -> None:
    """Replace the report's tensor by zeros of the same size and sign it again as `reporter`."""
    document = json.loads(path.read_bytes())
    document["tensor"] = base64.b64encode(bytes(len(base64.b64decode(document["tensor"])))).decode()
    data = json.dumps(document, sort_keys=True).encode()
    path.write_bytes(data)
    old = json.loads(signature_path(path).read_bytes())
    batch = (old["policy_step"], old["batch_counter"])
    signature_path(path).write_text(
        json.dumps(sign_bytes(data, reporter, batch=batch, group=old["group"], kind="fraud"))
    )


async def _spool_empty(running) -> bool:  # noqa: ANN001
    return not list(running.service.spool.directory.iterdir())


@pytest.mark.parametrize("stages", [2])
def test_group_intake_waits_for_every_stage_then_the_grace(stages: int) -> None:
    from prime_node.trainer.validator.groups import GroupIntake, GroupKey

    intake: GroupIntake[str] = GroupIntake(stages, grace_s=5.0, hold_timeout_s=60.0, max_groups=1)
    key = GroupKey("ab" * 32, 0, 0)
    intake.arrive(key, "junk", at=99.0)  # an arrival starts no group until the service admits it
    assert intake.take_arrivals() == ["junk"] and intake.arrivals == [] and len(intake) == 0
    intake.settle(key, 99.0)  # decided on its own
    assert intake.unsettled == {}
    intake.add(key, "stage 0", now=100.0)
    assert intake.due(101.0) == []  # one of two stages, within the grace period
    assert [(g.key, complete) for g, complete in intake.due(105.0)] == [(key, True)]
    intake.add(key, "stage 1", now=102.0)
    assert [(g.key, complete) for g, complete in intake.due(102.0)] == [(key, False)]  # complete: at once
    assert intake.full(GroupKey("cd" * 32, 0, 0)) and not intake.full(key)
    intake.done(key)
    assert len(intake) == 0


def test_a_group_stays_open_while_a_file_that_arrived_in_its_grace_is_still_checked() -> None:
    # The validator's own time checking a member's file (a parse in a thread, a wait for the group's record) is
    # not counted against the group: its grace period ends only once every file that arrived within it settled.
    from prime_node.trainer.validator.groups import GroupIntake, GroupKey

    intake: GroupIntake[str] = GroupIntake(2, grace_s=5.0, hold_timeout_s=60.0, max_groups=4)
    key, other = GroupKey("ab" * 32, 0, 0), GroupKey("cd" * 32, 0, 0)
    intake.add(key, "stage 0", now=100.0)
    intake.arrive(key, "stage 1", at=104.5)  # within the grace period, still being checked at its end
    intake.arrive(other, "another group's file", at=104.0)
    intake.arrive(key, "a late resend", at=106.0)  # after the grace period: keeps nothing open
    assert intake.due(105.0) == [] and intake.due(110.0) == []
    intake.settle(key, 104.5)
    intake.add(key, "stage 1", now=104.5)
    assert [(g.key, complete) for g, complete in intake.due(110.0)] == [(key, True)]
    intake.settle(key, 106.0)
    assert intake.unsettled == {other: [104.0]}
