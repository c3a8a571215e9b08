"""Producing one batch of rollouts, exactly as a contributor does: assigned work, generation, proofs.

The node may not choose its problems or seeds (proofs/assignment.py), samples with the engine's
replayable Gumbel-max sampler, commits to the hidden states that produced each output token (TOPLOC,
258 bytes per 32 tokens), computes rewards with the run's verifiers, and writes one signed file.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ...p2p.identity import Identity
from ...proofs.assignment import assign
from ...proofs.rollout_file import write_rollout_file
from ...proofs.rollout_schema import RolloutRow
from ...proofs.toploc import build_proofs, committed_rows
from ..engine import InferenceEngine, SampleRequest, SamplingParams
from ..errors import NodeError
from .validation import RunTasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSpec:
    """Which batch to produce and how to sample it."""

    run_id: str
    run_seed: int
    policy_step: int
    batch_counter: int
    prompts: int
    samples: int
    temperature: float
    max_new_tokens: int


@dataclass(frozen=True)
class ProducedBatch:
    rows: list[RolloutRow]
    generation_seconds: float
    proof_seconds: float
    # CPU seconds of the producing thread: generation; proofs, rewards and rows; the signed file. Unlike
    # wall time, not moved by other jobs on the machine (docs/node.md's throughput profile uses them).
    generation_cpu_s: float = 0.0
    proof_cpu_s: float = 0.0
    file_cpu_s: float = 0.0


def produce_rows(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> ProducedBatch:
    """Generate, prove and score the assigned batch; rows in assignment order."""
    assignment = assign(
        spec.run_seed,
        node_id,
        spec.policy_step,
        spec.batch_counter,
        task_count=tasks.task_count,
        prompts=spec.prompts,
        samples=spec.samples,
    )
    pairs = list(assignment.rows())
    requests = [SampleRequest(prompt_ids=tasks.prompt_ids(index, seed), seed=seed) for index, seed in pairs]
    start, start_cpu = time.perf_counter(), time.thread_time()
    completions = engine.generate(requests, SamplingParams(spec.max_new_tokens, spec.temperature))
    generated, generated_cpu = time.perf_counter(), time.thread_time()
    states = []
    for c in completions:
        if c.hidden_states is None:
            raise NodeError("the engine returned no hidden states; proofs need them (capture_hidden=True)")
        states.append(c.hidden_states[committed_rows(len(c.prompt_ids), len(c.output_ids))])
    proofs = build_proofs(states)
    proved = time.perf_counter()
    rows = []
    for (index, seed), completion, proof in zip(pairs, completions, proofs, strict=True):
        task_reward, penalty, target = tasks.rewards_for(index, seed, completion.output_ids)
        rows.append(
            RolloutRow(
                run_id=spec.run_id,
                node_id=node_id,
                policy_step=spec.policy_step,
                batch_counter=spec.batch_counter,
                sample_index=index,
                sample_seed=seed,
                temperature=spec.temperature,
                max_new_tokens=spec.max_new_tokens,
                environment=tasks.environment_pin,
                prompt_format=tasks.prompt_format,
                prompt_ids=completion.prompt_ids,
                output_ids=completion.output_ids,
                finish_reason=completion.finish_reason,
                task_reward=task_reward,
                length_penalty=penalty,
                reward=task_reward - penalty,
                target_length=target,
                proof=proof,
            )
        )
    done_cpu = time.thread_time()
    logger.info(
        "batch %d: %d samples generated in %.2fs (%.3f CPU-s), proofs and rewards in %.3f CPU-s",
        spec.batch_counter,
        len(rows),
        generated - start,
        generated_cpu - start_cpu,
        done_cpu - generated_cpu,
    )
    return ProducedBatch(
        rows, generated - start, proved - generated, generated_cpu - start_cpu, done_cpu - generated_cpu
    )


def produce_rollout_file(
    engine: InferenceEngine, tasks: RunTasks, identity: Identity, spec: BatchSpec, out: Path
) -> ProducedBatch:
    """produce_rows, then write and sign `out` (and `out`.sig)."""
    batch = produce_rows(engine, tasks, identity.node_id, spec)
    started = time.thread_time()
    write_rollout_file(out, batch.rows, identity)
    return dataclasses.replace(batch, file_cpu_s=time.thread_time() - started)
