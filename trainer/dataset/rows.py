"""Dataset rows: one per verified sample of an accepted file, with its text, ids, reward and provenance.

The schema (ROW_SCHEMA) is the dataset's contract, described column by column in docs/synthetic.md. Two
columns are kept apart on purpose: `verified` says the computation was checked (the row's file passed every
check of a trusted validator: TOPLOC commitments and sampling on the validator's random rows, assignment,
termination and rewards on every row), `correct` says the answer is right (the validator's recomputed task
reward reached the correctness threshold). Every row here is verified, since only accepted files are read;
a consumer filtering on `correct` alone would otherwise mistake "a real sample of the model" for "a right one".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

from ...node.environments import Environment
from ...node.environments.filtered import FilteredEnvironment
from ...proofs.work_identity import sample_id
from .errors import DatasetError
from .sources import AcceptedFile


def _ids() -> pa.DataType:
    return pa.list_(pa.int32())


ROW_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # run/node/step/batch/index/seed: unique per row
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),  # the generating model's label
        pa.field("checkpoint_step", pa.int64(), nullable=False),  # the policy step the rows were sampled from
        pa.field("checkpoint_digest", pa.string(), nullable=False),  # SHA-256 of its signed manifest
        pa.field("environment", pa.string(), nullable=False),  # NAME PACKAGE==VERSION sha256:<hex>
        pa.field("prompt_format", pa.string(), nullable=False),
        pa.field("task_index", pa.int64(), nullable=False),  # index in the run's environment
        pa.field("source_index", pa.int64(), nullable=False),  # index in the unfiltered environment
        pa.field("sample_seed", pa.int64(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),  # the task's text
        pa.field("answer", pa.string(), nullable=False),  # its reference answer
        pa.field("prompt_ids", _ids(), nullable=False),  # the tokens the model saw (template included)
        pa.field("completion", pa.string(), nullable=False),  # the completion as the scorer read it
        pa.field("completion_ids", _ids(), nullable=False),  # EOS included when finish_reason == "eos"
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("temperature", pa.float64(), nullable=False),
        pa.field("task_reward", pa.float64(), nullable=False),  # the validator's recomputed reward
        pa.field("length_penalty", pa.float64(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("verified", pa.bool_(), nullable=False),
        pa.field("correct", pa.bool_(), nullable=False),
        pa.field("producer", pa.string(), nullable=False),  # node id that generated and signed it
        pa.field("file_sha256", pa.string(), nullable=False),
        pa.field("verdict_id", pa.string(), nullable=False),  # a row of verdicts.parquet
        pa.field("validator_id", pa.string(), nullable=False),  # who signed that verdict
    ]
)


def source_index_of(environment: Environment) -> Callable[[int], int]:
    if isinstance(environment, FilteredEnvironment):
        return environment.source_index
    return lambda index: index


def dataset_rows(
    files: Iterable[AcceptedFile],
    environment: Environment,
    decode: Callable[[list[int]], str],
    digest_of_step: Callable[[int], str],
    *,
    model: str,
    correct_threshold: float,
) -> tuple[list[dict[str, Any]], int]:
    """(rows, duplicates left out): every sample of `files` once (two validators may accept the same work)."""
    pin = environment.identity.pin
    source_index = source_index_of(environment)
    seen: set[str] = set()
    duplicates = 0
    rows: list[dict[str, Any]] = []
    for accepted in files:
        v = accepted.verdict.document
        for r in accepted.file.rows:
            if r.environment != pin:
                raise DatasetError(
                    f"file {v.file_hash[:16]}… was generated with environment {r.environment!r}, not the "
                    f"configured {pin!r}: set --env (and --task-seed) as the run does"
                )
            if not math.isfinite(r.task_reward):  # the reader refuses these already: never compare a NaN
                raise DatasetError(f"file {v.file_hash[:16]}…: non-finite task reward")
            key = sample_id(r).key()
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            task = environment.get(r.sample_index)
            rows.append(
                {
                    "sample_id": key,
                    "run_id": r.run_id,
                    "model": model,
                    "checkpoint_step": r.policy_step,
                    "checkpoint_digest": digest_of_step(r.policy_step),
                    "environment": r.environment,
                    "prompt_format": r.prompt_format,
                    "task_index": r.sample_index,
                    "source_index": source_index(r.sample_index),
                    "sample_seed": r.sample_seed,
                    "prompt": task.prompt,
                    "answer": task.answer,
                    "prompt_ids": list(r.prompt_ids),
                    "completion": decode(list(r.output_ids)),
                    "completion_ids": list(r.output_ids),
                    "completion_tokens": len(r.output_ids),
                    "finish_reason": r.finish_reason,
                    "temperature": r.temperature,
                    "task_reward": r.task_reward,
                    "length_penalty": r.length_penalty,
                    "reward": r.reward,
                    "verified": True,
                    "correct": r.task_reward >= correct_threshold,
                    "producer": r.node_id,
                    "file_sha256": v.file_hash,
                    "verdict_id": accepted.verdict_id,
                    "validator_id": v.validator_id,
                }
            )
    return rows, duplicates
