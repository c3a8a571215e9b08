"""The contributor daemon's parts with real components: checkpoint bookkeeping against a real weights server,
the start-up checks and the status command of `prime-node` (the whole daemon: test_node_daemon_e2e.py)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from prime_node.node.cli.main import main
from prime_node.node.config import load_config
from prime_node.node.contributor.checkpoints import CheckpointKeeper
from prime_node.node.contributor.delivery import Delivery
from prime_node.node.contributor.outbox import Outbox
from prime_node.node.contributor.settings import NODE_UPLOAD_SLOTS, StartSettings
from prime_node.node.contributor.state import NodeState
from prime_node.node.errors import ConfigError
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import HandoffRefused, PolicyAnnouncement, ReceivedRollout
from prime_node.p2p.weights.fetch import FetchSettings
from prime_node.p2p.weights.store import Store
from prime_node.proofs.rollout_file import sign_bytes

from support.swarm import RUN_PARAMETERS, fleet
from support.weights import operator, publish_steps, serving


def policy(step: int, digest: str, url: str) -> PolicyAnnouncement:
    return PolicyAnnouncement(
        step=step, manifest_sha256=digest, sources=[url], published_at=time.time(), run=RUN_PARAMETERS
    )


def keeper_for(tmp_path: Path, key: str, state: NodeState) -> CheckpointKeeper:
    fetch = FetchSettings(max_attempts_per_shard=2, durable=False)
    return CheckpointKeeper(
        Store(tmp_path / "node"),
        key,
        state,
        async_level=2,
        fetch_settings=fetch,
        retry_s=60.0,
        max_retry_s=120.0,
    )


async def test_checkpoints_verified_refused_and_kept_within_the_window(tmp_path: Path) -> None:
    key = operator()
    manifests = publish_steps(tmp_path, key, [0, 1, 3], megabytes=0.3)
    state = NodeState(node_id=Identity.generate().node_id, operator_key=key.node_id)
    keeper = keeper_for(tmp_path, key.node_id, state)
    async with serving(tmp_path / "origin", key.node_id) as server:
        assert keeper.usable_step() is None  # nothing announced: wait
        keeper.announce(policy(0, manifests[0].digest, server.url))
        assert await keeper.try_fetch(keeper.announced)
        assert (keeper.usable_step(), state.local_step, keeper.verified_steps()) == (0, 0, [0])
        assert (keeper.store.checkpoint_dir(0) / "model.safetensors").is_file()

        # The sources serve a validly signed manifest, but not the one the operator announced: refused.
        keeper.announce(policy(1, manifests[0].digest, server.url))
        assert not await keeper.try_fetch(keeper.announced)
        assert "step 1 refused" in (state.last_error or "") and "announced" in state.last_error
        assert state.metrics.verification_failures._value.get() == 1
        assert (keeper.usable_step(), keeper.verified_steps()) == (0, [0])  # work goes on with step 0
        assert not Store(tmp_path / "node").version_dir(1).exists()

        # Step 3 leaves step 0 behind the window (3 - 2 > 0): the node waits for 3, then deletes 0.
        keeper.announce(policy(3, manifests[3].digest, server.url))
        assert keeper.usable_step() is None
        assert await keeper.try_fetch(keeper.announced)
        assert (keeper.usable_step(), keeper.verified_steps(), Store(tmp_path / "node").versions()) == (
            3,
            [3],
            [3],
        )
        keeper.discard(3, "cannot load it: not a model")  # e.g. the engine refused the verified files
        assert keeper.usable_step() is None and "step 3 unusable" in (state.last_error or "")

    # A restart reuses what verified before; a version whose manifest no longer verifies is ignored.
    again = keeper_for(tmp_path, key.node_id, NodeState(node_id=state.node_id, operator_key=key.node_id))
    await again.load_local()
    assert again.verified_steps() == [3]
    stranger = keeper_for(
        tmp_path, Identity.generate().node_id, NodeState(node_id=state.node_id, operator_key=None)
    )
    await stranger.load_local()
    assert stranger.verified_steps() == []


def test_start_settings_pin_the_operator_and_run_in_the_swarm_section() -> None:
    key = Identity.generate().node_id
    settings = load_config(StartSettings, cli_overrides={"operator_key": key, "run.run_id": "run-7"}, env={})
    swarm = settings.swarm_config()
    assert (swarm.run_id, swarm.operator_keys, settings.async_level) == ("run-7", [key], 2)
    with pytest.raises(ConfigError, match="--operator-key: must be the operator's node id"):
        load_config(StartSettings, cli_overrides={"operator_key": "not-hex"}, env={})
    with pytest.raises(ConfigError, match="--run-id: String should match pattern"):
        load_config(StartSettings, cli_overrides={"run.run_id": "has space"}, env={})


def test_a_nodes_serve_defaults_hold_when_some_serve_keys_are_set(tmp_path: Path) -> None:
    # The node's own defaults (a free port, NODE_UPLOAD_SLOTS upload slots) used to come from a default_factory,
    # which pydantic drops as soon as any `serve.*` key is given: a reachable node setting its port or public
    # URL served with no upload-slot limit, and one setting serve.shard_wait_s bound port 8470.
    plain = load_config(StartSettings, env={})
    assert (plain.serve.port, plain.serve.upload_slots) == (0, NODE_UPLOAD_SLOTS)
    port_set = load_config(StartSettings, env={"PRIME_NODE_SERVE__PORT": "9000"})
    assert (port_set.serve.port, port_set.serve.upload_slots) == (9000, NODE_UPLOAD_SLOTS)
    config = tmp_path / "node.toml"
    config.write_text('[serve]\nshard_wait_s = 2.5\npublic_urls = ["http://203.0.113.7:8470"]\n')
    from_file = load_config(StartSettings, toml_path=config, env={})
    assert (from_file.serve.port, from_file.serve.upload_slots, from_file.serve.shard_wait_s) == (
        0,
        NODE_UPLOAD_SLOTS,
        2.5,
    )
    unlimited = load_config(StartSettings, cli_overrides={"serve.upload_slots": 0}, env={})
    assert unlimited.serve.upload_slots == 0  # an operator may still lift the limit


def test_start_refuses_clearly_and_status_says_no_node_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path = tmp_path / "node.key"
    Identity.generate().save(key_path)
    os.chmod(key_path, 0o644)  # readable by others: a leaked key
    operator_key = Identity.generate().node_id
    assert main(["start", "--data-dir", str(tmp_path), "--operator-key", operator_key]) == 1
    err = capsys.readouterr().err
    assert "cannot start" in err and "key file" in err and "Traceback" not in err
    assert not (tmp_path / "status.json").exists()

    os.chmod(key_path, 0o600)
    assert main(["start", "--data-dir", str(tmp_path)]) == 1
    assert "--operator-key" in capsys.readouterr().err

    assert main(["status", "--json", "--data-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    # One line on stderr, and for a script reading stdout the same error as JSON (tests/test_cli_errors.py).
    assert "no node is running" in err and json.loads(out)["error"] in err


async def test_delivery_keeps_receipts_and_sets_refused_files_aside(tmp_path: Path) -> None:
    op = operator()
    outbox = Outbox(tmp_path / "rollouts")
    entries = []
    for size in (3000, 4000):  # opaque bytes: the hand-off layer checks signature and hash, not Parquet
        data = os.urandom(size)
        staged = outbox.staging_path(f"{size}.parquet")
        staged.write_bytes(data)
        node_key = Identity.from_seed(b"n" * 32)
        sig = Path(f"{staged}.sig")
        sig.write_text(json.dumps(sign_bytes(data, node_key, batch=(0, len(entries)))))
        entries.append(outbox.commit(hashlib.sha256(data).hexdigest(), staged, sig))

    def accept(rollout: ReceivedRollout) -> None:
        if rollout.size == 4000:  # stands in for a validator's failed checks
            raise HandoffRefused("sampling check failed")

    async with fleet("delivery", op) as group:
        validator = await group.add(op, roles=("validator",))
        await validator.serve_rollouts(tmp_path / "incoming", accept)
        await validator.publish_validator()
        sender = await group.add(Identity.from_seed(b"n" * 32))
        state = NodeState(node_id=sender.node_id, operator_key=op.node_id)
        delivery = Delivery(sender, outbox, state, retry_s=0.5, max_retry_s=1.0)
        for entry in outbox.pending_entries():
            await delivery.deliver(entry)
    assert outbox.pending_entries() == []
    assert [r["body"]["sha256"] for r in outbox.receipts()] == [entries[0].sha256]
    assert (outbox.rejected / f"{entries[1].sha256}.parquet").exists()
    assert (state.rollouts.handed_off, state.rollouts.rejected) == (1, 1)
    assert "sampling check failed" in (state.last_error or "")
