"""The slashing policy: what a verdict does to a node's score and ban state.

`decide(history, verdict)` is a pure function of the node's past (as the ledger reads it) and the new
verdict; the ledger applies the actions it returns in the same transaction that records the verdict, so a
verdict and its consequences are stored together or not at all.

Every failed check falls in one of three classes:
- excused: the node is not to blame or cannot be blamed. A bad signature means the file is not provably
  the named node's (anyone can claim a node id; the same holds for a file over the size limit, refused
  before its signature is read), and a checkpoint the validator never obtained is not
  the sender's fault. Slashing on these would let anyone frame an honest node.
- fault: the file is malformed or over the run's limits (schema, limits, decode, bounds), claims a policy step
  the run did not announce (policy_step: beyond the newest announced step plus a margin, or never announced
  by the end of its hold), or repeats samples already accepted (duplicate:
  the same work sent again in another encoding, order or file). Could be a bug; costs score, and repeated
  faults in a window escalate to a ban.
- fraud: the file is well-formed but the work is false (proofs, sampling, rewards, work assignment,
  termination, sampling settings other than the run's). Costs score and bans at once.
Ban lengths grow with every earlier ban and become permanent after a set number of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...p2p.verdicts import Verdict


class CheckClass(str, Enum):
    excused = "excused"
    fault = "fault"
    fraud = "fraud"


# Check names as the validator reports them: proofs/checks.py's CheckResult names (a hyphen becomes "_",
# trainer/validator/verify_job.check_name) and the validator service's own (checkpoint_unavailable, policy_step, banned,
# internal_error).
DEFAULT_CHECK_CLASSES: dict[str, CheckClass] = {
    "size": CheckClass.excused,
    "signature": CheckClass.excused,
    "checkpoint_unavailable": CheckClass.excused,
    "banned": CheckClass.excused,  # already refused for the ban; no second penalty for the same offence
    "internal_error": CheckClass.excused,  # the validator failed (a checkpoint that will not load, a bug)
    "schema": CheckClass.fault,
    # Over the run's limits (rows, tokens, bytes a value or a page may decode to), refused before decoding:
    # the writer every honest node uses never produces such a file (proofs/rollout_file.py).
    "limits": CheckClass.fault,
    "decode": CheckClass.fault,
    "bounds": CheckClass.fault,
    # A checkpoint the run never announced: a file that would otherwise wait in a queue place for the whole
    # hold, free (trainer/validator/policy_steps.py). An honest node generates only with
    # announced checkpoints; the validator's margin and its fresh look at the DHT cover the race.
    "policy_step": CheckClass.fault,
    # Samples accepted before (or repeated in the file): only their own node can sign them (the signer check
    # comes first), so it costs the sender; a fault, not fraud: a node that lost its batch counter (its data
    # directory) repeats work by mistake.
    "duplicate": CheckClass.fault,
    "signer": CheckClass.fraud,  # signed rows that name another node: claiming someone else's work
    # Sampled otherwise than the run's published settings: not this run's work, and a colder temperature
    # buys higher rewards. An honest node cannot drift into it: the trainer announces the run's parameters
    # with every policy and a node configured otherwise stops before working (node/run/announcement.py).
    "run_parameters": CheckClass.fraud,
    "assignment": CheckClass.fraud,
    "prompts": CheckClass.fraud,
    "termination": CheckClass.fraud,
    "rewards": CheckClass.fraud,
    "toploc": CheckClass.fraud,
    "eos_probability": CheckClass.fraud,
    "sampling": CheckClass.fraud,
    "distribution": CheckClass.fraud,
    # Pipelined groups (trainer/validator/group_job.py, docs/pipeline.md "Verdicts"): the stage verify_group
    # blames produced wrong work (or signed two streams, or forged a copy): fraud. The group's other members are
    # not to blame; the batch passed through a faulty stage, or some stage never came: excused, and not credited.
    "pipeline": CheckClass.fraud,
    "pipeline_group": CheckClass.excused,
    "pipeline_incomplete": CheckClass.excused,
    # Fraud evidence that proves nothing (the accused frame's commitment matches its tensor): a false accusation.
    "pipeline_report": CheckClass.fault,
    # Fraud evidence that was upheld: excused and not credited, so that a sybil pair cannot farm credit from it.
    "pipeline_report_upheld": CheckClass.excused,
    # A group no operator-signed group record formed (trainer/validator/formed_groups.py): its members' own
    # signed work, so not fraud, but not credited either (one operator running every stage would be paid for
    # made-up groups). Excused: a validator that did not read the record in time must not slash honest members.
    "pipeline_unformed": CheckClass.excused,
}


# Checks that run before the sender is authenticated (size limit, then the signature): a file failing them
# may come from anyone, so they are always excused and never touch the named node's record.
UNATTRIBUTED_CHECKS = frozenset({"size", "signature"})


class SlashingPolicy(BaseModel):
    """How the ledger punishes rejected files; every field is a config setting (section `slashing`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accept_credit: float = Field(1.0, ge=0, le=1e6, description="Score added for each accepted file.")
    fault_penalty: float = Field(5.0, ge=0, le=1e9, description="Score removed for a fault (schema, bounds).")
    fraud_penalty: float = Field(
        100.0, ge=0, le=1e9, description="Score removed for fraud (proofs, sampling...)."
    )
    check_classes: dict[str, CheckClass] = Field(
        default_factory=lambda: dict(DEFAULT_CHECK_CLASSES),
        description="Class of failed-check names (excused, fault or fraud); entries override the defaults.",
    )
    unknown_check_class: CheckClass = Field(
        CheckClass.fault, description="Class of a failed check missing from check_classes."
    )
    fault_ban_after: int = Field(
        5,
        ge=1,
        le=10_000,
        description="Faults within fault_window_s (since the last ban) that trigger a ban.",
    )
    fault_window_s: float = Field(3600.0, gt=0, le=1e8, description="Window in which faults are counted (s).")
    fault_ban_s: float | None = Field(
        3600.0,
        gt=0,
        le=1e9,
        description="Base length of a ban for repeated faults (s); null means permanent.",
    )
    fraud_ban_s: float | None = Field(
        86400.0, gt=0, le=1e9, description="Base length of a ban for fraud (s); null means permanent."
    )
    ban_growth: float = Field(
        4.0, ge=1, le=1000, description="Each earlier ban of the node multiplies the length of a new one."
    )
    permanent_after_bans: int | None = Field(
        2, ge=0, le=1000, description="A node with this many earlier bans is banned for good; null: never."
    )
    ban_below_score: float | None = Field(
        None,
        ge=-1e12,
        le=1e12,
        description="Also ban (fault length) when a slash takes the score below this.",
    )

    @field_validator("check_classes", mode="before")
    @classmethod
    def _merge_with_defaults(cls, value: object) -> object:
        # An operator reclassifying one check must not silently drop the classes of all the others.
        return {**DEFAULT_CHECK_CLASSES, **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _unattributed_stay_excused(self) -> SlashingPolicy:
        wrong = sorted(
            c
            for c in UNATTRIBUTED_CHECKS
            if self.check_classes.get(c, CheckClass.excused) is not CheckClass.excused
        )
        if wrong:
            raise ValueError(f"checks {wrong} run before the sender is authenticated and must stay 'excused'")
        return self

    def classify(self, failed_check: str) -> CheckClass:
        if failed_check in UNATTRIBUTED_CHECKS:
            return CheckClass.excused
        return self.check_classes.get(failed_check, self.unknown_check_class)


@dataclass(frozen=True)
class PastRejection:
    at: float
    failed_check: str


@dataclass(frozen=True)
class NodeHistory:
    """What the policy needs to know about a node before the new verdict (read by the ledger)."""

    score: float = 0.0
    # Rejections at or after now - policy.fault_window_s (older ones may be included; they are ignored).
    recent_rejections: tuple[PastRejection, ...] = ()
    bans_so_far: int = 0  # every ban the node ever received, expired or lifted included
    last_ban_at: float | None = None
    # The active ban, if any: `banned` and its end (None = permanent).
    banned: bool = False
    banned_until: float | None = None


@dataclass(frozen=True)
class Credit:
    amount: float


@dataclass(frozen=True)
class Slash:
    amount: float
    check_class: CheckClass
    failed_check: str
    reason: str


@dataclass(frozen=True)
class Ban:
    until: float | None  # None: permanent
    reason: str


Action = Credit | Slash | Ban


def decide(
    history: NodeHistory, verdict: Verdict, policy: SlashingPolicy, *, credit_share: float = 1.0
) -> tuple[Action, ...]:
    """The actions that `verdict` causes for a node with `history`; empty for an excused rejection.
    `credit_share`: the share of `accept_credit` an accepted file earns (a pipelined stage's share of the layers)."""
    now = verdict.decided_at
    if verdict.accepted:
        credit = policy.accept_credit * credit_share
        return (Credit(credit),) if credit > 0 else ()
    check = verdict.failed_check or "unknown"
    klass = policy.classify(check)
    if klass is CheckClass.excused:
        return ()
    penalty = policy.fraud_penalty if klass is CheckClass.fraud else policy.fault_penalty
    actions: list[Action] = [Slash(penalty, klass, check, verdict.reason)] if penalty > 0 else []
    ban: Ban | None = None
    if klass is CheckClass.fraud:
        ban = Ban(_ban_end(policy.fraud_ban_s, history, policy, now), f"fraud: {check} check failed")
    else:
        window_start = now - policy.fault_window_s
        settled = history.last_ban_at  # a ban settles the faults up to and including the one that caused it
        faults = 1 + sum(
            1
            for r in history.recent_rejections
            if r.at >= window_start
            and (settled is None or r.at > settled)
            and policy.classify(r.failed_check) is CheckClass.fault
        )
        if faults >= policy.fault_ban_after:
            ban = Ban(
                _ban_end(policy.fault_ban_s, history, policy, now),
                f"{faults} faults within {policy.fault_window_s:g} s",
            )
        elif policy.ban_below_score is not None and history.score - penalty < policy.ban_below_score:
            ban = Ban(
                _ban_end(policy.fault_ban_s, history, policy, now),
                f"score {history.score - penalty:g} below {policy.ban_below_score:g}",
            )
    if ban is not None and _extends(history, ban, now):
        actions.append(ban)
    return tuple(actions)


def _ban_end(base_s: float | None, history: NodeHistory, policy: SlashingPolicy, now: float) -> float | None:
    if base_s is None:
        return None
    if policy.permanent_after_bans is not None and history.bans_so_far >= policy.permanent_after_bans:
        return None
    return now + base_s * policy.ban_growth**history.bans_so_far


def _extends(history: NodeHistory, ban: Ban, now: float) -> bool:
    """A new ban is recorded only when it lasts longer than the one in force (no duplicate ban records)."""
    if not history.banned or (history.banned_until is not None and history.banned_until <= now):
        return True
    if history.banned_until is None:
        return False
    return ban.until is None or ban.until > history.banned_until
