"""A node's rollout files on real environments, checked by the real verifier as a validator checks them: on three
reasoning-gym families and on a code task file (its programs run in the sandbox on both sides), the honest file
is accepted, a file claiming inflated rewards is rejected by the rewards check, and every reward a validator
recomputes, with the environment opened afresh from the run's spec, equals the node's claim exactly. A file of
another family configuration is rejected naming it. (The same on a whole swarm: tests/test_devnet_environments.py.)
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_node.node.environments import open_environment
from prime_node.node.run.producer import BatchSpec, produce_rows
from prime_node.node.run.validation import RunTasks, verify_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.proofs.rollout_file import read_rollout_file, write_rollout_file
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.devnet.attacks import attack_producer

from support.attack import checkpoint_engine, make_checkpoint
from support.env_runs import CODE_MAX_NEW_TOKENS, FAMILIES, code_model, write_code_tasks
from support.sandbox import sandbox_skip_reason

NODE = Identity.from_seed(b"\x19" * 32)
LENGTH_TARGETS = (3, 9, 17)


def _spec(max_new_tokens: int, prompts: int = 4, samples: int = 2) -> BatchSpec:
    return BatchSpec(
        run_id="env-runs",
        run_seed=19,
        policy_step=0,
        batch_counter=0,
        prompts=prompts,
        samples=samples,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
    )


def _run_tasks(spec: str, checkpoint: Path, length_targets: tuple[int, ...]) -> RunTasks:
    """The run's task rules as a party of the run builds them: the environment opened from the spec."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    return RunTasks(open_environment(spec), tokenizer, length_targets=length_targets, length_alpha=0.01)


def _verify(path: Path, checkpoint: Path, tasks: RunTasks, batch: BatchSpec):
    settings = VerifierSettings(
        run_seed=batch.run_seed,
        samples_per_prompt=batch.samples,
        temperature=batch.temperature,
        max_new_tokens=batch.max_new_tokens,
    )
    return verify_rollout_file(path, checkpoint_engine(checkpoint), tasks, settings, rng=random.Random(0))


def _check_a_run(
    tmp_path: Path, spec: str, checkpoint: Path, batch: BatchSpec, length_targets: tuple[int, ...]
) -> list[float]:
    """Honest file accepted with every reward recomputed equal, inflated one rejected; the task rewards."""
    node_tasks = _run_tasks(spec, checkpoint, length_targets)
    engine = checkpoint_engine(checkpoint)
    honest = tmp_path / "honest.parquet"
    write_rollout_file(honest, produce_rows(engine, node_tasks, NODE.node_id, batch).rows, NODE)
    validator_tasks = _run_tasks(spec, checkpoint, length_targets)  # its own environment, opened afresh
    report = _verify(honest, checkpoint, validator_tasks, batch)
    assert report.accepted, report.reasons
    rows = read_rollout_file(honest).rows
    assert rows and {r.environment for r in rows} == {validator_tasks.environment_pin}
    for row in rows:  # per rollout, exactly: the validator's tolerance is not needed
        task_reward, penalty, target = validator_tasks.rewards(row)
        assert (row.task_reward, row.length_penalty, row.target_length) == (task_reward, penalty, target)
        assert row.reward == task_reward - penalty
    inflated = tmp_path / "inflated.parquet"
    attack_producer("inflated-rewards")(engine, node_tasks, NODE, batch, inflated)
    report = _verify(inflated, checkpoint, validator_tasks, batch)
    failed = [c for c in report.checks if c.status == "failed"]
    if all(r.task_reward == 1.0 for r in rows):  # nothing to inflate: then the file is honest
        assert report.accepted, report.reasons
    else:
        assert failed and failed[0].name == "rewards" and "recomputed" in failed[0].detail, report.reasons
    return [r.task_reward for r in rows]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("env-runs") / "model")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_reasoning_gym_family_file_is_accepted_with_equal_rewards_and_inflation_rejected(
    tmp_path: Path, tiny: Path, family: str
) -> None:
    rewards = _check_a_run(tmp_path, FAMILIES[family], tiny, _spec(16), LENGTH_TARGETS)
    assert all(0.0 <= r <= 1.0 for r in rewards)


def test_a_file_of_another_family_configuration_is_rejected_naming_it(tmp_path: Path, tiny: Path) -> None:
    batch = _spec(8, prompts=2)
    run_spec = FAMILIES["spell_backward"]
    node_tasks = _run_tasks(run_spec.replace("max_word_len=5", "max_word_len=6"), tiny, LENGTH_TARGETS)
    path = tmp_path / "other.parquet"
    write_rollout_file(
        path, produce_rows(checkpoint_engine(tiny), node_tasks, NODE.node_id, batch).rows, NODE
    )
    report = _verify(path, tiny, _run_tasks(run_spec, tiny, LENGTH_TARGETS), batch)
    failed = [c for c in report.checks if c.status == "failed"]
    assert not report.accepted and failed[0].name == "run-parameters", report.reasons
    assert "another configuration of environment 'reasoning_gym'" in failed[0].detail, failed[0].detail


@pytest.mark.slow  # the warm start: about 30 s of CPU
@pytest.mark.skipif(sandbox_skip_reason() is not None, reason=sandbox_skip_reason() or "")
def test_a_code_file_runs_its_programs_in_the_sandbox_on_both_sides(tmp_path: Path) -> None:
    spec = f"code:{write_code_tasks(tmp_path / 'code.jsonl')}"
    checkpoint = code_model(tmp_path / "model", spec)
    # No length targets: their instruction would change the prompts the model was trained on.
    rewards = _check_a_run(tmp_path, spec, checkpoint, _spec(CODE_MAX_NEW_TOKENS, prompts=6, samples=2), ())
    assert any(r == 1.0 for r in rewards), rewards  # passing programs: the sandbox ran them, on both sides
    # A program that passes on the node but is refused on the validator would show as a rewards rejection;
    # the rejection of one claimed 1.0 over a failing program is the inflated file's (checked above).
    assert all(r in (0.0, 1.0) for r in rewards)
