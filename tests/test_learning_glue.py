"""The glue between the engine, the verifier and the trainer: what the trainer learns from is exactly what the
engine sampled, with the advantage of the right sample, and its log-probs are the sampling distribution's.

These are the checks behind docs/trainer.md, "Does it learn?", hypothesis 1: a mismatch here (a BOS or a
suffix the engine saw but the trainer does not, EOS kept on one side only, a temperature applied on one side
only, advantages attached to the wrong rows) would make GRPO optimise the wrong objective silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_node.node.engine import HFEngine, SampleRequest, SamplingParams
from prime_node.node.environments import open_environment
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.validation import RunTasks, verify_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.proofs.rollout_file import read_rollout_file
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.grpo.advantages import group_advantages
from prime_node.trainer.grpo.packing import TrainSample, pack_samples, token_logprobs
from prime_node.trainer.service.batch_buffer import BatchBuffer
from prime_node.trainer.service.consumed import ConsumedLedger
from prime_node.trainer.service.inbox import Inbox

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RUN_ID = "glue"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_are_the_engine_sampling_logprobs(temperature: float) -> None:
    model, tokenizer = build_tiny_model(3)
    tasks = RunTasks(open_environment("arithmetic"), tokenizer, length_targets=(4, 8), length_alpha=0.01)
    engine = HFEngine(model, max_batch_size=8)
    requests = [SampleRequest(prompt_ids=tasks.prompt_ids(i, 100 + i), seed=100 + i) for i in range(12)]
    completions = engine.generate(requests, SamplingParams(10, temperature), capture_hidden=False)
    samples = [TrainSample(c.prompt_ids, c.output_ids, 1.0) for c in completions]
    seen: dict[int, list[float]] = {}
    for rows in pack_samples(samples, 128, pad_id=0):
        logp, _ = token_logprobs(model, rows, temperature)
        for value, index in zip(logp[rows.loss_mask].tolist(), rows.sample_index[rows.loss_mask].tolist()):
            seen.setdefault(index, []).append(value)
    for i, c in enumerate(completions):
        assert c.prompt_ids == requests[i].prompt_ids  # no BOS or template added by either side
        assert len(seen[i]) == len(c.output_ids)  # every sampled token is trained on, EOS included
        assert seen[i] == pytest.approx(list(c.output_logprobs), abs=1e-4)


def test_batch_samples_are_the_verified_rows_with_their_own_advantages(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(4)
    # Length targets make rewards differ inside groups even for an untrained model (its task reward is 0).
    tasks = RunTasks(open_environment("arithmetic"), tokenizer, length_targets=(2, 9), length_alpha=0.05)
    engine = HFEngine(model, max_batch_size=16)
    node = Identity.generate()
    inbox = Inbox(tmp_path / "accepted", RUN_ID)
    inbox.directory.mkdir(parents=True)
    spec = BatchSpec(
        run_id=RUN_ID,
        run_seed=0,
        policy_step=0,
        batch_counter=1,
        prompts=4,
        samples=4,
        temperature=1.0,
        max_new_tokens=10,
    )
    path = inbox.directory / "file.parquet"
    produce_rollout_file(engine, tasks, node, spec, path)
    report = verify_rollout_file(path, engine, tasks, VerifierSettings(run_id=RUN_ID, samples_per_prompt=4))
    assert report.accepted, report.reasons
    rows = read_rollout_file(path).rows
    record = inbox.read(path)
    assert record is not None
    with ConsumedLedger(tmp_path / "consumed.sqlite") as ledger:
        buffer = BatchBuffer(ledger, batch_size=4, async_level=0)
        buffer.add(record, 0)
        batch = buffer.take(0)
    assert batch is not None and batch.groups
    by_index: dict[int, list] = {}
    for r in rows:
        by_index.setdefault(r.sample_index, []).append(r)
    trained = 0
    for group in batch.groups:
        group_rows = by_index[int(group.prompt_key)]
        expected = group_advantages([r.task_reward - r.length_penalty for r in group_rows]).advantages
        for row, sample, advantage in zip(group_rows, group.train_samples(), expected, strict=True):
            assert (
                sample.prompt_ids
                == tuple(row.prompt_ids)
                == tasks.prompt_ids(row.sample_index, row.sample_seed)
            )
            assert sample.completion_ids == tuple(row.output_ids)
            assert sample.advantage == pytest.approx(advantage)
            trained += 1
    assert trained == batch.num_samples == len(batch.train_samples())
