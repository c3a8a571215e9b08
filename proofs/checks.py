"""The checks a validator runs on a rollout file, cheapest first (see verifier.py for the framework).

signature -> schema -> limits   (the file's bytes, its footer and page headers, one small column: nothing is
    decoded in bulk before the file's layout is verified and held to the run's limits)
decode -> signer -> bounds -> run-parameters -> assignment -> prompts -> termination -> rewards
    (every row, cheap)
toploc -> eos-probability -> sampling -> distribution   (selected rows: what one prefill each gives,
    reduced call by call so that memory does not grow with the file, proofs/evidence.py)

eos-probability runs before sampling so that a forced, improbable EOS is named as such; sampling would
reject it too (EOS is then rarely the Gumbel argmax).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import groupby

from ..p2p.environment_identity import pin_difference
from .assignment import AssignmentError, check_assignment
from .errors import ProofError
from .rollout_decode import decode_layout, read_policy_step
from .rollout_file import (
    MAX_SIG_BYTES,
    check_signer,
    envelope_batch,
    parse_envelope,
    read_bounded,
    signature_path,
    verify_envelope,
)
from .rollout_layout import TOKEN_COLUMNS, check_layout, read_layout
from .rollout_schema import MAX_PROMPT_FORMAT_CHARS, RolloutFileError, check_rows
from .sampling import (
    distribution_failure,
    distribution_z,
    eos_logprob_failure,
    sampling_failure,
    termination_failure,
)
from .toploc import ChunkStats, typical_mant_err_mean, worst_failure
from .verifier import Check, CheckFailed, VerificationContext

REWARD_TOLERANCE = 1e-9


@contextmanager
def _rejects(*errors: type[Exception]) -> Iterator[None]:
    """Turn the expected errors of the wrapped reader into this check's failure."""
    try:
        yield
    except errors as exc:
        raise CheckFailed(str(exc)) from None


class SignatureCheck:
    name = "signature"

    def run(self, ctx: VerificationContext) -> str:
        with _rejects(RolloutFileError):
            ctx.envelope = parse_envelope(
                read_bounded(signature_path(ctx.path), MAX_SIG_BYTES, "signature file")
            )
            ctx.data = read_bounded(ctx.path, ctx.settings.limits.max_file_bytes, "rollout file")
            ctx.signer = verify_envelope(ctx.data, ctx.envelope)
        return f"{len(ctx.data)} bytes signed by {ctx.signer[:16]}…"


class SchemaCheck:
    """The footer and every page header, verified against each other: what decoding will cost, before any of it."""

    name = "schema"

    def run(self, ctx: VerificationContext) -> str:
        with _rejects(RolloutFileError):
            ctx.parquet, ctx.layout = read_layout(ctx.data)
        pages = sum(len(c.pages) for c in ctx.layout.chunks)
        return f"{ctx.layout.rows} rows in {ctx.layout.row_groups} row groups and {pages} pages, schema exact"


class LimitsCheck:
    """The verified layout against the run's limits, then the policy step alone: a file over them is refused
    before it is decoded, and the checkpoint it claims is known before the bulk of it is read."""

    name = "limits"

    def run(self, ctx: VerificationContext) -> str:
        assert ctx.parquet is not None and ctx.layout is not None
        with _rejects(RolloutFileError):
            check_layout(ctx.layout, ctx.settings.file_limits())
            ctx.step = read_policy_step(ctx.parquet)
        tokens = sum(ctx.layout.values(c) for c in TOKEN_COLUMNS)
        return (
            f"{tokens} token ids, {ctx.layout.uncompressed} bytes decompressed, within the run's limits; "
            f"policy step {ctx.step}"
        )


class DecodeCheck:
    """The rows, column by column within the bounds the limits check allowed (proofs/rollout_decode.py)."""

    name = "decode"

    def run(self, ctx: VerificationContext) -> str:
        assert ctx.parquet is not None and ctx.layout is not None
        with _rejects(RolloutFileError):
            ctx.rows = decode_layout(ctx.parquet, ctx.layout, ctx.settings.file_limits())
        # The file's bytes and Arrow's view of them are not read again: not held through the prefill.
        ctx.parquet, ctx.data = None, b""
        return f"{len(ctx.rows)} rows decoded"


class SignerCheck:
    name = "signer"

    def run(self, ctx: VerificationContext) -> str:
        with _rejects(RolloutFileError):
            check_signer(ctx.rows, ctx.signer, envelope_batch(ctx.envelope))
        batch = envelope_batch(ctx.envelope)
        return "rows name the signing node" + (
            f" and the signed batch {batch[1]} of step {batch[0]}" if batch is not None else ""
        )


class BoundsCheck:
    name = "bounds"

    def run(self, ctx: VerificationContext) -> str:
        limits = ctx.settings.limits.model_copy(update={"vocab_size": ctx.model.vocab_size})
        with _rejects(RolloutFileError):
            check_rows(ctx.rows, limits)
        return "all values in bounds"


class RunParametersCheck:
    """The sampling the run fixed: a node that honestly declares a cooler temperature (higher rewards; every
    proof still holds at the declared one) or fewer new tokens (cheaper work) is not doing the run's work.
    And the run's environment and prompt format: a reward computed with another environment (another
    version, another configuration) or prompts built otherwise (another chat template or system prompt) is
    not the run's reward, whatever the prompts and rewards checks would find. Rows share both (bounds)."""

    name = "run-parameters"

    def run(self, ctx: VerificationContext) -> str:
        pinned = ctx.settings
        first = ctx.rows[0]
        if first.environment != ctx.tasks.environment_pin:
            raise CheckFailed(
                f"reward computed with {pin_difference(first.environment, ctx.tasks.environment_pin)}", 0
            )
        if first.prompt_format != ctx.tasks.prompt_format:
            raise CheckFailed(
                f"prompts in format {first.prompt_format[:MAX_PROMPT_FORMAT_CHARS]!r}; the run's prompt format "
                f"is {ctx.tasks.prompt_format!r} (another chat template or system prompt)",
                0,
            )
        for i, row in enumerate(ctx.rows):
            if pinned.temperature is not None and row.temperature != pinned.temperature:
                raise CheckFailed(
                    f"sampled at temperature {row.temperature!r}; the run samples at {pinned.temperature!r}",
                    i,
                )
            if pinned.max_new_tokens is not None and row.max_new_tokens != pinned.max_new_tokens:
                raise CheckFailed(
                    f"max_new_tokens {row.max_new_tokens}; the run's is {pinned.max_new_tokens}", i
                )
        loose = [name for name in ("temperature", "max_new_tokens") if getattr(pinned, name) is None]
        return f"temperature {first.temperature!r}, max_new_tokens {first.max_new_tokens}" + (
            f" ({' and '.join(loose)} not pinned)" if loose else ""
        )


class AssignmentCheck:
    name = "assignment"

    def run(self, ctx: VerificationContext) -> str:
        first = ctx.rows[0]
        if ctx.settings.run_id is not None and first.run_id != ctx.settings.run_id:
            raise CheckFailed(f"file belongs to run {first.run_id!r}, not {ctx.settings.run_id!r}")
        samples = ctx.settings.samples_per_prompt
        if samples is None:  # infer G from the file: every prompt must carry the same number of rows
            samples = len(list(next(groupby(ctx.rows, key=lambda r: r.sample_index))[1]))
        with _rejects(AssignmentError):
            check_assignment(
                [(r.sample_index, r.sample_seed) for r in ctx.rows],
                ctx.settings.run_seed,
                first.node_id,
                first.policy_step,
                first.batch_counter,
                task_count=ctx.tasks.task_count,
                samples=samples,
                prompts=ctx.settings.prompts_per_batch,
            )
        return f"{len(ctx.rows) // samples} prompts x {samples} samples as assigned"


class PromptCheck:
    name = "prompts"

    def run(self, ctx: VerificationContext) -> str:
        for i, row in enumerate(ctx.rows):
            if row.prompt_ids != ctx.tasks.prompt_ids(row.sample_index, row.sample_seed):
                raise CheckFailed(f"prompt tokens differ from task {row.sample_index}'s prompt", i)
        return "every prompt is its task's"


class TerminationCheck:
    name = "termination"

    def run(self, ctx: VerificationContext) -> str:
        for i, row in enumerate(ctx.rows):
            reason = termination_failure(
                row.output_ids, row.finish_reason, row.max_new_tokens, ctx.model.eos_token_id
            )
            if reason:
                raise CheckFailed(reason, i)
        return "finish reasons consistent"


class RewardCheck:
    name = "rewards"

    def run(self, ctx: VerificationContext) -> str:
        for i, row in enumerate(ctx.rows):
            task_reward, penalty, target = ctx.tasks.rewards(row)
            if row.target_length != target:
                raise CheckFailed(f"target length {row.target_length}, recomputed {target}", i)
            if abs(row.task_reward - task_reward) > REWARD_TOLERANCE:
                raise CheckFailed(f"task reward {row.task_reward}, recomputed {task_reward}", i)
            if abs(row.length_penalty - penalty) > REWARD_TOLERANCE:
                raise CheckFailed(f"length penalty {row.length_penalty}, recomputed {penalty}", i)
        return f"mean reward {sum(r.reward for r in ctx.rows) / len(ctx.rows):.3f} recomputed"


class ToplocCheck:
    name = "toploc"

    def run(self, ctx: VerificationContext) -> str:
        thresholds = ctx.settings.toploc_thresholds()
        pooled: dict[int, list[ChunkStats]] = {}

        def check(members: list[int]) -> None:
            for i in sorted(set(members) - set(pooled)):
                stats = ctx.evidence[i].toploc
                if isinstance(stats, ProofError):
                    raise CheckFailed(f"malformed proof: {stats}", i)
                for chunk, s in enumerate(stats):
                    reason = s.failure(thresholds)
                    if reason:
                        raise CheckFailed(f"proof chunk {chunk}: {reason}", i)
                pooled[i] = stats

        # The per-chunk caps as each prefill call lands: forged proofs cost a node nothing, so a file of
        # them is rejected after one call, not after a prefill of every row.
        for members in ctx.evidence_calls():
            check(members)
        check(list(ctx.evidence))  # rows whose evidence an earlier check had computed
        all_chunks = [s for i in sorted(pooled) for s in pooled[i]]
        reason = worst_failure(all_chunks, thresholds)
        if reason:  # the per-chunk caps passed above, so this is the file-level typical error
            raise CheckFailed(reason)
        worst = max(s.exp_mismatches for s in all_chunks)
        return (
            f"{len(ctx.selected)} rows by prefill, typical mantissa error {typical_mant_err_mean(all_chunks):.2f}, "
            f"worst chunk {worst} exponent mismatches"
        )


class SamplingCheck:
    name = "sampling"

    def run(self, ctx: VerificationContext) -> str:
        thresholds = ctx.settings.sampling_thresholds()
        evidence = sorted(ctx.row_evidence().items())
        for i, row in evidence:  # the first failing row, in file order
            reason = sampling_failure(row.sampling, thresholds)
            if reason:
                raise CheckFailed(reason, i)
        near_ties = sum(row.sampling.near_ties for _, row in evidence)
        return f"every token is the Gumbel argmax ({near_ties} tolerated near-ties)"


class EosProbabilityCheck:
    name = "eos-probability"

    def run(self, ctx: VerificationContext) -> str:
        checked = 0
        for i, evidence in sorted(ctx.row_evidence().items()):
            if evidence.eos_logprob is None:  # a `length` ending
                continue
            reason = eos_logprob_failure(evidence.eos_logprob, ctx.settings.sampling_thresholds())
            if reason:
                raise CheckFailed(reason, i)
            checked += 1
        return f"{checked} EOS endings plausible"


class DistributionCheck:
    name = "distribution"

    def run(self, ctx: VerificationContext) -> str:
        stats = [evidence.sampling for _, evidence in sorted(ctx.row_evidence().items())]
        reason = distribution_failure(stats, ctx.settings.sampling_thresholds())
        if reason:
            raise CheckFailed(reason)
        z, tokens = distribution_z(stats)
        return f"log-probability z-score {z:.2f} over {tokens} tokens"


def default_checks() -> list[Check]:
    """Every check, cheapest first."""
    return [
        SignatureCheck(),
        SchemaCheck(),
        LimitsCheck(),
        DecodeCheck(),
        SignerCheck(),
        BoundsCheck(),
        RunParametersCheck(),
        AssignmentCheck(),
        PromptCheck(),
        TerminationCheck(),
        RewardCheck(),
        ToplocCheck(),
        EosProbabilityCheck(),
        SamplingCheck(),
        DistributionCheck(),
    ]
