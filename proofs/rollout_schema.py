"""The rollout file's pinned Parquet schema, its row type, and the value bounds every reader enforces.

One file holds one batch of one node: every row shares run id, node id, policy step, batch counter,
temperature, max new tokens, environment and prompt format. docs/protocol.md (## Rollout files) is the
written form of this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from ..p2p.environment_identity import MAX_PIN_CHARS
from ..p2p.names import MAX_LENGTH_TARGET
from ..p2p.wire import is_hex64
from .bounds import proof_size
from .errors import ProofError

FORMAT = "prime-node/rollout/v2"
FORMAT_KEY = b"prime_node.format"
FINISH_REASONS = ("eos", "length")
MAX_SEED = 2**63 - 1
MAX_PROMPT_FORMAT_CHARS = 128  # "sha256:<hex>" of the prompt mode, chat template, system prompt (prompts.py)
# Columns every row of a file shares.
SHARED_COLUMNS = (
    "run_id",
    "node_id",
    "policy_step",
    "batch_counter",
    "temperature",
    "max_new_tokens",
    "environment",
    "prompt_format",
)


def _tokens() -> pa.DataType:
    return pa.list_(pa.field("element", pa.int32(), nullable=False))


SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),  # names the RL run (operator's choice)
        pa.field("node_id", pa.string(), nullable=False),  # hex Ed25519 public key of the producer
        pa.field("policy_step", pa.int64(), nullable=False),  # checkpoint (optimizer step) used
        pa.field("batch_counter", pa.int64(), nullable=False),  # the node's batch number at that step
        pa.field("sample_index", pa.int64(), nullable=False),  # task index, assigned (proofs/assignment.py)
        pa.field("sample_seed", pa.int64(), nullable=False),  # Gumbel noise seed, assigned
        pa.field("temperature", pa.float64(), nullable=False),
        pa.field("max_new_tokens", pa.int32(), nullable=False),
        # The environment the rewards were computed with: `NAME PACKAGE==VERSION sha256:<hex>`
        # (p2p/environment_identity.py), and how prompts became token ids (node/run/validation.py).
        pa.field("environment", pa.string(), nullable=False),
        pa.field("prompt_format", pa.string(), nullable=False),
        pa.field("prompt_ids", _tokens(), nullable=False),
        pa.field("output_ids", _tokens(), nullable=False),  # EOS included when finish_reason == "eos"
        pa.field("finish_reason", pa.string(), nullable=False),  # "eos" or "length"
        pa.field("task_reward", pa.float64(), nullable=False),  # the task verifier's score in [0, 1]
        pa.field(
            "length_penalty", pa.float64(), nullable=False
        ),  # alpha * |length - target|; 0 without target
        pa.field("reward", pa.float64(), nullable=False),  # task_reward - length_penalty
        pa.field("target_length", pa.int32(), nullable=True),  # length the penalty aims at, if any
        pa.field("proof", pa.binary(), nullable=False),  # TOPLOC commitment, 258 bytes per 32 tokens
    ],
    metadata={FORMAT_KEY: FORMAT.encode()},
)
COLUMNS = tuple(SCHEMA.names)
# Found from the schema, not listed: a float column added later is checked finite before anything else too.
FLOAT_COLUMNS = tuple(f.name for f in SCHEMA if pa.types.is_floating(f.type))


class RolloutFileError(ProofError):
    """A rollout file is malformed, unsigned, too large, or violates the schema or value bounds."""

    def __init__(self, message: str, *, check: str = "schema") -> None:
        super().__init__(message)
        self.check = check  # which verifier check rejected it (signature, schema, bounds)


class RolloutLimits(BaseModel):
    """Bounds a reader enforces before trusting any value of a peer's rollout file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_file_bytes: int = Field(64 * 2**20, ge=1024, description="Largest rollout file read (bytes).")
    max_rows: int = Field(4096, ge=1, description="Most rows (samples) in one file.")
    max_decoded_bytes: int = Field(
        128 * 2**20,
        ge=1024,
        description="Most bytes a file's pages may decompress to, summed over its page headers.",
    )
    max_file_tokens: int = Field(
        4 * 2**20,
        ge=1,
        description="Most token ids (prompts and outputs, every row) in one file: what bounds "
        "the decoded rows' memory (about 40 bytes a token as Python objects).",
    )
    max_prompt_tokens: int = Field(8192, ge=1, description="Longest prompt, in tokens.")
    max_new_tokens: int = Field(8192, ge=1, description="Largest max_new_tokens a file may claim.")
    max_temperature: float = Field(10.0, gt=0, description="Highest sampling temperature accepted.")
    max_id_chars: int = Field(128, ge=1, description="Longest run id.")
    vocab_size: int | None = Field(None, ge=2, description="Token ids must be below this when known.")


@dataclass(frozen=True)
class RolloutRow:
    """One sample as stored; field comments are on SCHEMA."""

    run_id: str
    node_id: str
    policy_step: int
    batch_counter: int
    sample_index: int
    sample_seed: int
    temperature: float
    max_new_tokens: int
    environment: str
    prompt_format: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: str
    task_reward: float
    length_penalty: float
    reward: float
    target_length: int | None
    proof: bytes

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RolloutRow:
        values = dict(record)
        values["prompt_ids"] = tuple(values["prompt_ids"])
        values["output_ids"] = tuple(values["output_ids"])
        return cls(**values)

    def to_record(self) -> dict[str, Any]:
        return {name: (list(v) if isinstance(v, tuple) else v) for name, v in self.__dict__.items()}


def check_schema(schema: pa.Schema, pinned: pa.Schema = SCHEMA) -> None:
    """Exactly the pinned columns, in order, with the pinned types and nullability (`pinned`: SCHEMA, or
    another format's, such as a pipeline stage's file, proofs/pipeline/stage_file.py)."""
    fmt = (pinned.metadata or {}).get(FORMAT_KEY, b"").decode()
    columns = tuple(pinned.names)
    names = list(schema.names)
    missing = [c for c in columns if c not in names]
    extra = [c for c in names if c not in columns]
    if missing or extra:
        raise RolloutFileError(f"columns differ from {fmt}: missing {missing}, unexpected {extra}")
    for want in pinned:
        got = schema.field(want.name)
        if not got.type.equals(want.type) or got.nullable != want.nullable:
            null = lambda f: "nullable" if f.nullable else "not null"  # noqa: E731
            raise RolloutFileError(
                f"column {want.name!r} is {got.type} ({null(got)}), expected {want.type} ({null(want)})"
            )
    if names != list(columns):
        raise RolloutFileError(f"columns are out of order: {names}")
    if (schema.metadata or {}).get(FORMAT_KEY) != fmt.encode():
        raise RolloutFileError(f"schema metadata does not declare {fmt}")


def _bad(row: int, message: str) -> RolloutFileError:
    return RolloutFileError(f"row {row}: {message}", check="bounds")


def check_row(i: int, r: RolloutRow, first: RolloutRow, limits: RolloutLimits, *, proof: bool = True) -> None:
    """Value bounds of one row; `first` carries the values every row of a file must share. Without `proof` the
    row carries none (a pipeline stage's file other than the last stage's): its proof must be empty."""
    # Finiteness first: NaN differs from itself, so the shared-field comparison would misname the fault.
    for name in FLOAT_COLUMNS:
        if not math.isfinite(getattr(r, name)):
            raise _bad(i, f"{name} is not a finite number ({getattr(r, name)})")
    for name in SHARED_COLUMNS:
        if getattr(r, name) != getattr(first, name):
            raise _bad(i, f"{name} {getattr(r, name)!r} differs from row 0 ({getattr(first, name)!r})")
    if not 1 <= len(r.run_id) <= limits.max_id_chars:
        raise _bad(i, f"run id must have 1..{limits.max_id_chars} characters")
    if not is_hex64(r.node_id):
        raise _bad(i, "node id must be 64 lowercase hex digits")
    if not 1 <= len(r.environment) <= MAX_PIN_CHARS:
        raise _bad(i, f"environment must have 1..{MAX_PIN_CHARS} characters")
    if not 1 <= len(r.prompt_format) <= MAX_PROMPT_FORMAT_CHARS:
        raise _bad(i, f"prompt format must have 1..{MAX_PROMPT_FORMAT_CHARS} characters")
    for name in ("policy_step", "batch_counter", "sample_index"):
        if getattr(r, name) < 0:
            raise _bad(i, f"{name} is negative")
    if not 0 <= r.sample_seed <= MAX_SEED:
        raise _bad(i, "sample seed is negative")
    if not 0 < r.temperature <= limits.max_temperature:
        raise _bad(i, f"temperature {r.temperature} outside (0, {limits.max_temperature}]")
    if not 1 <= r.max_new_tokens <= limits.max_new_tokens:
        raise _bad(i, f"max_new_tokens {r.max_new_tokens} outside [1, {limits.max_new_tokens}]")
    if not 1 <= len(r.prompt_ids) <= limits.max_prompt_tokens:
        raise _bad(i, f"prompt has {len(r.prompt_ids)} tokens, allowed 1..{limits.max_prompt_tokens}")
    if not 1 <= len(r.output_ids) <= r.max_new_tokens:
        raise _bad(i, f"output has {len(r.output_ids)} tokens, allowed 1..{r.max_new_tokens}")
    ids = r.prompt_ids + r.output_ids
    top = limits.vocab_size if limits.vocab_size is not None else 2**31
    if min(ids) < 0 or max(ids) >= top:
        raise _bad(i, f"a token id is outside the vocabulary [0, {top})")
    if r.finish_reason not in FINISH_REASONS:
        raise _bad(i, f"finish reason {r.finish_reason!r} is not one of {FINISH_REASONS}")
    if not 0.0 <= r.task_reward <= 1.0:
        raise _bad(i, f"task reward {r.task_reward} outside [0, 1]")
    # alpha <= 1 per token (trainer/grpo/config.py), so the penalty never exceeds the largest possible distance.
    penalty_cap = max(r.max_new_tokens, r.target_length or 0)
    if not 0.0 <= r.length_penalty <= penalty_cap:
        raise _bad(i, f"length penalty {r.length_penalty} outside [0, {penalty_cap}]")
    if abs(r.reward - (r.task_reward - r.length_penalty)) > 1e-9:
        raise _bad(i, f"reward {r.reward} != task reward - length penalty")
    if r.target_length is None and r.length_penalty != 0.0:
        raise _bad(i, "a length penalty without a target length")
    # The bound the run setting and the policy record share: a run may aim at lengths beyond its max_new_tokens,
    # and which target a row must carry is the rewards check's (recomputed from its seed), not a bound's. With
    # limits.max_new_tokens here, a reader given the run's limits (stage files) refused honest rows such a run's
    # rollout files passed.
    if r.target_length is not None and not 1 <= r.target_length <= MAX_LENGTH_TARGET:
        raise _bad(i, f"target length {r.target_length} outside [1, {MAX_LENGTH_TARGET}]")
    if not proof:
        if r.proof:
            raise _bad(i, f"proof is {len(r.proof)} bytes; this file carries none")
    elif len(r.proof) != proof_size(len(r.output_ids)):
        raise _bad(
            i, f"proof is {len(r.proof)} bytes, expected {proof_size(len(r.output_ids))} (258 per 32 tokens)"
        )


def check_rows(rows: Sequence[RolloutRow], limits: RolloutLimits, *, proof: bool = True) -> None:
    if not 1 <= len(rows) <= limits.max_rows:
        raise RolloutFileError(f"{len(rows)} rows, allowed 1..{limits.max_rows}", check="bounds")
    tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in rows)
    if tokens > limits.max_file_tokens:
        raise RolloutFileError(
            f"{tokens} token ids, over the limit of {limits.max_file_tokens} per file", check="bounds"
        )
    for i, row in enumerate(rows):
        check_row(i, row, rows[0], limits, proof=proof)
