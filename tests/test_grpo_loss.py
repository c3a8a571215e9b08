"""The INTELLECT-2 GRPO loss against hand-computed values, branch by branch."""

from __future__ import annotations

import math

import pytest
import torch

from prime_node.node.models.tiny import build_tiny_model
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.grpo.loss import LossParams, grpo_loss, k3_kl
from prime_node.trainer.grpo.packing import TrainSample, pack_samples, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = LossParams(eps_low=0.2, eps_high=0.28, delta=4.0)

# (advantage, ratio, expected per-token loss -J, expected d(-J)/d(logp_new), branch)
# J = min(min(r, 4) * A, clip(r, 0.8, 1.28) * A); where J follows r * A its derivative in logp is r * A.
CASES = [
    (+2.0, 0.5, -1.0, -1.0, None),  # A>0, below range: min(1.0, 1.6) = 1.0, unclipped, gradient flows
    (+2.0, 1.1, -2.2, -2.2, None),  # A>0, inside: 2.2
    (+2.0, 1.5, -2.56, 0.0, "high"),  # A>0, above: min(3.0, 2.56) = 2.56 (clipped, flat)
    (-0.5, 0.5, 0.4, 0.0, "low"),  # A<0, below: min(-0.25, -0.4) = -0.4 (clipped, flat)
    (-0.5, 1.1, 0.55, 0.55, None),  # A<0, inside: -0.55
    (-0.5, 2.0, 1.0, 1.0, None),  # A<0, above range, below delta: min(-1.0, -0.64) = -1.0, unclipped
    (-0.5, 5.0, 2.0, 0.0, "delta"),  # A<0, above delta: min(4 * -0.5, -0.64) = -2.0 (bounded, flat)
    (+2.0, 5.0, -2.56, 0.0, "high"),  # A>0 far above: delta never binds, 1.28 * 2 = 2.56
    (0.0, 3.0, 0.0, 0.0, None),  # zero advantage: nothing
]


def _tensors(cases: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    adv = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    logp_new = torch.tensor([math.log(c[1]) for c in cases], dtype=torch.float64, requires_grad=True)
    logp_old = torch.zeros(len(cases), dtype=torch.float64)
    return logp_new, logp_old, adv


@pytest.mark.parametrize("case", CASES, ids=[f"A={c[0]:+}_r={c[1]}" for c in CASES])
def test_each_branch_value_and_gradient(case: tuple) -> None:
    logp_new, logp_old, adv = _tensors([case])
    out = grpo_loss(logp_new, logp_old, adv, torch.ones(1, dtype=torch.bool), PARAMS)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(case[2], abs=1e-12)
    assert logp_new.grad.item() == pytest.approx(case[3], abs=1e-12)
    m = out.metrics
    assert (m.clip_high, m.clip_low, m.clip_delta) == (
        float(case[4] == "high"),
        float(case[4] == "low"),
        float(case[4] == "delta"),
    )


def test_whole_batch_is_token_mean_with_branch_fractions() -> None:
    logp_new, logp_old, adv = _tensors(CASES + [(+2.0, 1.1, 0, 0, None)])
    mask = torch.tensor([True] * len(CASES) + [False])  # the last token is padding
    out = grpo_loss(logp_new, logp_old, adv, mask, PARAMS)
    out.loss.backward()
    # -1.0 - 2.2 - 2.56 + 0.4 + 0.55 + 1.0 + 2.0 - 2.56 + 0 = -4.37 over 9 tokens
    assert out.loss.item() == pytest.approx(-4.37 / 9, abs=1e-12)
    expected_grad = [-1.0 / 9, -2.2 / 9, 0, 0, 0.55 / 9, 1.0 / 9, 0, 0, 0, 0]
    assert logp_new.grad.tolist() == pytest.approx(expected_grad, abs=1e-12)
    means = out.metrics.means()
    assert means["clip_high"] == pytest.approx(2 / 9)
    assert means["clip_low"] == pytest.approx(1 / 9)
    assert means["clip_delta"] == pytest.approx(1 / 9)
    assert means["clip_fraction"] == pytest.approx(4 / 9)
    assert means["ratio"] == pytest.approx((0.5 + 1.1 + 1.5 + 0.5 + 1.1 + 2.0 + 5.0 + 5.0 + 3.0) / 9)
    assert means["policy_loss"] == pytest.approx(-4.37 / 9)
    assert out.metrics.tokens == 9


def test_delta_is_what_bounds_negative_advantages() -> None:
    # A = -0.5, r = 5: plain PPO (delta ~ infinite) gives 2.5 and gradient 2.5; delta = 4 gives 2.0, flat.
    logp_new, logp_old, adv = _tensors([(-0.5, 5.0)])
    loose = grpo_loss(
        logp_new, logp_old, adv, torch.ones(1, dtype=torch.bool), LossParams(0.2, 0.28, delta=1000.0)
    )
    loose.loss.backward()
    assert loose.loss.item() == pytest.approx(2.5, abs=1e-12)
    assert logp_new.grad.item() == pytest.approx(2.5, abs=1e-12)


def test_token_level_normalisation_weighs_tokens_not_samples() -> None:
    # Sample X: 3 tokens at r = 1 with A = -1 (loss 1 each); sample Y: 1 token at r = 1 with A = +1 (loss -1).
    # Token level: (3 - 1) / 4 = 0.5. (A per-sample mean would give (1 + -1) / 2 = 0.)
    logp_new = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = grpo_loss(logp_new, torch.zeros_like(logp_new), adv, mask, PARAMS)
    assert out.loss.item() == pytest.approx(0.5, abs=1e-12)


def test_micro_batches_with_batch_normaliser_sum_to_whole_batch() -> None:
    logp_new, logp_old, adv = _tensors(CASES)
    mask = torch.ones(len(CASES), dtype=torch.bool)
    whole = grpo_loss(logp_new, logp_old, adv, mask, PARAMS).loss.item()
    parts = [
        grpo_loss(logp_new[s], logp_old[s], adv[s], mask[s], PARAMS, normalizer=len(CASES)).loss.item()
        for s in (slice(0, 4), slice(4, None))
    ]
    assert sum(parts) == pytest.approx(whole, abs=1e-12)


def test_k3_kl_term_values_and_direction() -> None:
    # x = logp_ref - logp_new: ln 0.5 gives 0.5 + ln 2 - 1; ln 2 gives 2 - ln 2 - 1; they sum to exactly 0.5.
    logp_new = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    logp_ref = torch.tensor([math.log(0.5), math.log(2.0)], dtype=torch.float64)
    assert k3_kl(logp_new, logp_ref).tolist() == pytest.approx(
        [0.5 + math.log(2) - 1, 1 - math.log(2)], abs=1e-12
    )
    params = LossParams(0.2, 0.28, 4.0, kl_coef=0.1)
    out = grpo_loss(
        logp_new, torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), params, logp_ref=logp_ref
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1 * 0.5 / 2, abs=1e-12)
    # d k3 / d logp_new = 1 - exp(x): +0.5 and -1, so descent moves logp_new toward the reference
    assert logp_new.grad.tolist() == pytest.approx([0.1 * 0.5 / 2, 0.1 * -1.0 / 2], abs=1e-12)
    assert out.metrics.means()["kl"] == pytest.approx(0.25, abs=1e-12)


def test_entropy_bonus_lowers_the_loss() -> None:
    entropy = torch.tensor([1.0, 3.0], dtype=torch.float64)
    params = LossParams(0.2, 0.28, 4.0, entropy_coef=0.01)
    out = grpo_loss(
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.ones(2, dtype=torch.bool),
        params,
        entropy=entropy,
    )
    assert out.loss.item() == pytest.approx(-0.01 * 4.0 / 2, abs=1e-9)
    assert out.metrics.means()["entropy"] == pytest.approx(2.0)


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(3)
    with pytest.raises(TrainerError, match="shape"):
        grpo_loss(x, torch.zeros(4), x, torch.ones(3, dtype=torch.bool), PARAMS)
    with pytest.raises(TrainerError, match="reference"):
        grpo_loss(x, x, x, torch.ones(3, dtype=torch.bool), LossParams(kl_coef=0.1))
    with pytest.raises(TrainerError, match="positive token count"):
        grpo_loss(x, x, x, torch.zeros(3, dtype=torch.bool), PARAMS)
    with pytest.raises(TrainerError, match="delta"):
        LossParams(eps_high=0.28, delta=1.2)


def test_huge_log_ratios_keep_gradients_finite() -> None:
    logp_new = torch.tensor([80.0, -80.0], requires_grad=True)
    out = grpo_loss(
        logp_new, torch.zeros(2), torch.tensor([-1.0, 1.0]), torch.ones(2, dtype=torch.bool), PARAMS
    )
    out.loss.backward()
    assert torch.isfinite(logp_new.grad).all()
    assert out.loss.item() == pytest.approx(
        (4.0 + 0.0) / 2, abs=1e-6
    )  # delta bound, and r ~ e^-20 for A = +1


@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_one_step_moves_the_completion_probability_with_the_advantage(sign: float) -> None:
    model, _ = build_tiny_model(seed=3)
    sample = TrainSample(prompt_ids=(20, 21, 22, 23), completion_ids=(40, 41, 42, 1), advantage=sign)
    rows = pack_samples([sample], token_budget=8, pad_id=0)[0]
    with torch.no_grad():
        before, _ = token_logprobs(model, rows)
    logp, _ = token_logprobs(model, rows)
    out = grpo_loss(logp, before, rows.advantages, rows.loss_mask, PARAMS)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
        after, _ = token_logprobs(model, rows)
    change = float(((after - before) * rows.loss_mask).sum())
    assert sign * change > 0.0


def test_negative_weight_scales_only_negative_advantages() -> None:
    # A = -0.5 at r = 1.1 (inside the range) gives -J = 0.55 at weight 1; weight 0.2 makes the advantage
    # -0.1, so -J = 0.11 with gradient 0.11. A = +2 at r = 1.1 is untouched: -J = -2.2. Token mean of both.
    params = LossParams(eps_low=0.2, eps_high=0.28, delta=4.0, negative_weight=0.2)
    logp_new, logp_old, adv = _tensors([(-0.5, 1.1, 0, 0, None), (+2.0, 1.1, 0, 0, None)])
    out = grpo_loss(logp_new, logp_old, adv, torch.ones(2, dtype=torch.bool), params)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((0.11 - 2.2) / 2, abs=1e-12)
    assert logp_new.grad.tolist() == pytest.approx([0.11 / 2, -2.2 / 2], abs=1e-12)
    # Weight 0: negative samples carry no gradient at all (filtered behaviour cloning of the positives).
    logp_new, logp_old, adv = _tensors([(-0.5, 2.0, 0, 0, None), (+2.0, 1.1, 0, 0, None)])
    out = grpo_loss(
        logp_new,
        logp_old,
        adv,
        torch.ones(2, dtype=torch.bool),
        LossParams(eps_low=0.2, eps_high=0.28, delta=4.0, negative_weight=0.0),
    )
    out.loss.backward()
    assert logp_new.grad.tolist() == pytest.approx([0.0, -2.2 / 2], abs=1e-12)
    with pytest.raises(TrainerError, match="negative_weight"):
        LossParams(negative_weight=1.5)
