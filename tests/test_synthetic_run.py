"""The synthetic run kind: typed in the run settings, announced with every policy, frozen in the policy
record, and a trainer that publishes its model and never trains."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hivemind.utils import MSGPackSerializer
from pydantic import ValidationError

from prime_node.node.run.announcement import differences, run_parameters
from prime_node.node.run.settings import RunSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.swarm.records import RecordError, RecordKind, key_id, open_record, seal, seal_payload


def _policy(run: RunSettings, frozen: bool) -> PolicyAnnouncement:
    return PolicyAnnouncement(
        step=0,
        manifest_sha256="ab" * 32,
        sources=[],
        published_at=time.time(),
        run=run_parameters(run),
        frozen=frozen,
    )


def test_run_kind_is_typed_and_announced() -> None:
    synthetic = RunSettings(run_id="syn", run_kind="synthetic", annotators=["small", "tiny"])
    assert synthetic.frozen and not RunSettings().frozen
    params = run_parameters(synthetic)
    assert params.run_kind == "synthetic" and params.annotators == ["small", "tiny"]
    with pytest.raises(ValidationError, match="run_kind = synthetic"):
        RunSettings(annotators=["small"])
    with pytest.raises(ValidationError, match="twice"):
        RunSettings(run_kind="synthetic", annotators=["a", "a"])
    with pytest.raises(ValidationError):
        RunSettings(run_kind="synthetic", annotators=["bad label"])
    # A node configured for an RL run is told which setting differs from the synthetic run's.
    found = differences(run_parameters(RunSettings(run_id="syn")), params)
    assert any(line.startswith("run.run_kind: 'rl' here, 'synthetic' in the run") for line in found)
    assert any(line.startswith("run.annotators") for line in found)


def test_policy_record_says_frozen_exactly_for_synthetic_runs() -> None:
    synthetic, rl = RunSettings(run_kind="synthetic"), RunSettings()
    assert _policy(synthetic, True).frozen and not _policy(rl, False).frozen
    with pytest.raises(ValidationError, match="frozen=True"):
        _policy(synthetic, False)
    with pytest.raises(ValidationError, match="frozen=False"):
        _policy(rl, True)


def test_a_signed_record_claiming_the_other_behaviour_is_refused() -> None:
    operator = Identity.generate()
    good = _policy(RunSettings(run_kind="synthetic"), True)
    kid, subkey = key_id("local", RecordKind.POLICY), MSGPackSerializer.dumps(operator.node_id)
    expiration = time.time() + 60
    value = seal(operator, "local", RecordKind.POLICY, operator.node_id, good, expiration)
    body = open_record(
        RecordKind.POLICY, kid, subkey, value, expiration, frozenset({operator.node_id}), time.time()
    )
    assert isinstance(body, PolicyAnnouncement) and body.frozen
    lie = {**good.model_dump(mode="json"), "frozen": False}  # signed, but a synthetic run that would train
    forged = seal_payload(
        operator, "local", RecordKind.POLICY, operator.node_id, canonical_json(lie), expiration
    )
    with pytest.raises(RecordError, match="frozen"):
        open_record(
            RecordKind.POLICY, kid, subkey, forged, expiration, frozenset({operator.node_id}), time.time()
        )


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_synthetic_trainer_publishes_once_and_never_trains(tmp_path: Path) -> None:
    from support.attack import make_checkpoint
    from support.trainer_service import deliver, make_accepted_files, read_ready, start_trainer, trainer_argv

    model = make_checkpoint(tmp_path / "model")
    key, data, log = tmp_path / "op.key", tmp_path / "data", tmp_path / "trainer.log"
    Identity.generate().save(key)
    for path in make_accepted_files(model, 0, 2, tmp_path / "stage"):
        deliver(path, data / "accepted")
    inbox = sorted(p.name for p in (data / "accepted").iterdir())
    proc = start_trainer(trainer_argv(model, key, data, "--no-dht", "--run-kind", "synthetic"), log)
    try:
        assert read_ready(proc, log)["step"] == 0
        time.sleep(3.0)  # an RL trainer trains on these two files within a second (batch size 6)
        assert not (data / "trainer" / "metrics.jsonl").exists(), log.read_text()[-2000:]
        assert sorted(p.name for p in (data / "accepted").iterdir()) == inbox  # left for dataset build
        assert [p.name for p in (data / "weights").iterdir() if p.name.startswith("step")] != []
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(40) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        end_pids([proc.pid], 10.0)
        if proc.stdout is not None:
            proc.stdout.close()
    assert "synthetic run: policy step 0 is frozen" in log.read_text()
