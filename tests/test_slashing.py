"""The slashing policy: every branch of decide(), escalation, and the policy's own validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prime_node.trainer.ledger.slashing import (
    DEFAULT_CHECK_CLASSES,
    Ban,
    CheckClass,
    Credit,
    NodeHistory,
    PastRejection,
    Slash,
    SlashingPolicy,
    decide,
)

from support.ledger import T0, make_verdict, node_id

NODE = node_id(0)
POLICY = SlashingPolicy()


def _rejected(check: str, at: float = T0):
    return make_verdict(NODE, accepted=False, failed_check=check, at=at)


def test_accepted_file_credits_the_score():
    assert decide(NodeHistory(), make_verdict(NODE), POLICY) == (Credit(POLICY.accept_credit),)
    assert decide(NodeHistory(), make_verdict(NODE), SlashingPolicy(accept_credit=0)) == ()
    # A pipelined stage file earns its stage's share of the layers.
    assert decide(NodeHistory(), make_verdict(NODE), POLICY, credit_share=0.25) == (
        Credit(POLICY.accept_credit * 0.25),
    )


@pytest.mark.parametrize(
    "check",
    [
        "signature",
        "size",
        "checkpoint_unavailable",
        "internal_error",
        "banned",
        "pipeline_group",
        "pipeline_incomplete",
        "pipeline_unformed",
    ],
)
def test_excused_checks_cost_nothing(check):
    many_faults = NodeHistory(recent_rejections=tuple(PastRejection(T0 - i, "schema") for i in range(1, 20)))
    assert decide(many_faults, _rejected(check), POLICY) == ()


@pytest.mark.parametrize("check", ["schema", "bounds", "pipeline_report"])
def test_a_fault_slashes_the_score_without_a_ban(check):
    actions = decide(NodeHistory(score=10.0), _rejected(check), POLICY)
    assert actions == (Slash(POLICY.fault_penalty, CheckClass.fault, check, f"{check} check failed"),)


@pytest.mark.parametrize(
    "check",
    [
        "toploc",
        "sampling",
        "termination",
        "rewards",
        "assignment",
        "prompts",
        "signer",
        "eos_probability",
        "distribution",
        "pipeline",
    ],
)
def test_fraud_slashes_and_bans_at_once(check):
    slash, ban = decide(NodeHistory(score=10.0), _rejected(check), POLICY)
    assert slash == Slash(POLICY.fraud_penalty, CheckClass.fraud, check, f"{check} check failed")
    assert isinstance(ban, Ban) and ban.until == T0 + POLICY.fraud_ban_s and check in ban.reason


def test_unknown_check_uses_the_configured_class():
    assert decide(NodeHistory(), _rejected("novel_check"), POLICY)[0].check_class is CheckClass.fault
    strict = SlashingPolicy(unknown_check_class=CheckClass.fraud)
    assert isinstance(decide(NodeHistory(), _rejected("novel_check"), strict)[-1], Ban)


def test_repeated_faults_in_the_window_escalate_to_a_ban():
    policy = SlashingPolicy(fault_ban_after=3, fault_window_s=100.0)
    two_recent = NodeHistory(
        recent_rejections=(PastRejection(T0 - 50, "schema"), PastRejection(T0 - 10, "bounds"))
    )
    *_, ban = decide(two_recent, _rejected("schema"), policy)
    assert ban == Ban(T0 + policy.fault_ban_s, "3 faults within 100 s")
    # One of the two is outside the window: no ban yet.
    one_recent = NodeHistory(
        recent_rejections=(PastRejection(T0 - 150, "schema"), PastRejection(T0 - 10, "bounds"))
    )
    assert not any(isinstance(a, Ban) for a in decide(one_recent, _rejected("schema"), policy))
    # Excused and fraud rejections are not faults.
    others = NodeHistory(
        recent_rejections=(PastRejection(T0 - 5, "signature"), PastRejection(T0 - 4, "toploc"))
    )
    assert not any(isinstance(a, Ban) for a in decide(others, _rejected("schema"), policy))


def test_a_ban_settles_the_faults_before_it():
    policy = SlashingPolicy(fault_ban_after=3, fault_window_s=1000.0)
    faults = tuple(
        PastRejection(T0 - d, "schema") for d in (300, 200, 150, 100)
    )  # the one at 150 caused the ban
    after_ban = NodeHistory(recent_rejections=faults, bans_so_far=1, last_ban_at=T0 - 150)
    assert not any(isinstance(a, Ban) for a in decide(after_ban, _rejected("schema"), policy))


def test_ban_length_grows_with_earlier_bans_then_becomes_permanent():
    policy = SlashingPolicy(fraud_ban_s=100.0, ban_growth=3.0, permanent_after_bans=2)
    ends = [decide(NodeHistory(bans_so_far=n), _rejected("toploc"), policy)[-1].until for n in range(3)]
    assert ends == [T0 + 100.0, T0 + 300.0, None]
    never = SlashingPolicy(fraud_ban_s=100.0, permanent_after_bans=None)
    assert decide(NodeHistory(bans_so_far=50), _rejected("toploc"), never)[-1].until is not None


def test_permanent_ban_configured_directly():
    assert decide(NodeHistory(), _rejected("sampling"), SlashingPolicy(fraud_ban_s=None))[-1] == Ban(
        None, "fraud: sampling check failed"
    )


def test_score_floor_bans():
    policy = SlashingPolicy(ban_below_score=-7.0, fault_penalty=5.0)
    assert not any(isinstance(a, Ban) for a in decide(NodeHistory(score=0.0), _rejected("schema"), policy))
    *_, ban = decide(NodeHistory(score=-4.0), _rejected("schema"), policy)
    assert isinstance(ban, Ban) and "below -7" in ban.reason


def test_no_ban_when_a_longer_one_is_in_force():
    policy = SlashingPolicy(fraud_ban_s=100.0, ban_growth=1.0, permanent_after_bans=None)
    longer = NodeHistory(bans_so_far=1, banned=True, banned_until=T0 + 1000)
    assert decide(longer, _rejected("toploc"), policy) == (
        Slash(100.0, CheckClass.fraud, "toploc", "toploc check failed"),
    )
    forever = NodeHistory(bans_so_far=1, banned=True, banned_until=None)
    assert not any(isinstance(a, Ban) for a in decide(forever, _rejected("toploc"), policy))
    shorter = NodeHistory(bans_so_far=1, banned=True, banned_until=T0 + 10)
    assert decide(shorter, _rejected("toploc"), policy)[-1] == Ban(T0 + 100.0, "fraud: toploc check failed")


def test_policy_fields_are_bounded_and_documented():
    for bad in (
        {"fault_penalty": -1},
        {"ban_growth": 0.5},
        {"fault_ban_after": 0},
        {"fraud_ban_s": 0},
        {"typo": 1},
    ):
        with pytest.raises(ValidationError):
            SlashingPolicy(**bad)
    with pytest.raises(ValidationError, match="must stay 'excused'"):
        SlashingPolicy(check_classes={"signature": CheckClass.fraud})
    assert all(field.description for field in SlashingPolicy.model_fields.values())
    # Loads from a TOML-like table with string classes.
    policy = SlashingPolicy.model_validate({"check_classes": {"schema": "fraud"}, "fraud_ban_s": None})
    assert policy.classify("schema") is CheckClass.fraud and policy.fraud_ban_s is None
    assert policy.classify("toploc") is CheckClass.fraud and policy.classify("bounds") is CheckClass.fault


def test_every_check_of_the_verifier_has_a_class_of_its_own():
    # A new check must be classed on purpose, not fall into unknown_check_class by omission.
    from prime_node.proofs.checks import default_checks
    from prime_node.trainer.validator.verify_job import check_name

    names = {check_name(check.name) for check in default_checks()}
    assert names <= set(DEFAULT_CHECK_CLASSES), names - set(DEFAULT_CHECK_CLASSES)
