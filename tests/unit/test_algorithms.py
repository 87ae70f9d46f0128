"""Tests for ppo.algorithms: hand-derived values (derivation next to each assertion), edge cases, gradients.

Run: ``.venv/bin/pytest tests/unit/test_algorithms.py``
"""

import math

import pytest
import torch

from ppo import algorithms
from ppo.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    compute_gae,
    compute_grpo_advantages,
    compute_rloo_advantages,
    entropy_from_logits,
    full_kl,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from tests.helpers import close, t64

LN2 = math.log(2.0)
LN3 = math.log(3.0)


# ---------------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------------


def test_masked_mean_and_whiten() -> None:
    x = t64([[1.0, 2.0, 100.0], [3.0, float("nan"), 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # valid: 1, 2, 3 -> (1 + 2 + 3) / 3 = 2; the masked NaN and 100 are ignored
    close(masked_mean(x, mask), 2.0)
    # per row: (1 + 2) / 2 = 1.5 ; 3 / 1 = 3
    close(masked_mean(x, mask, dim=-1), [1.5, 3.0])
    # an empty mask gives 0, not NaN
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)

    y = t64([1.0, 2.0, 3.0, 40.0])
    m = torch.tensor([1, 1, 1, 0])
    # mean 2, unbiased var ((1-2)² + 0 + (3-2)²) / (3 - 1) = 1 -> (y - 2) / sqrt(1 + 1e-8)
    close(masked_whiten(y, m)[:3], [-1.0, 0.0, 1.0])
    # masked position uses the same statistics: (40 - 2) / 1 = 38
    close(masked_whiten(y, m)[3], 38.0)
    # shift_mean=False adds the mean back: [-1, 0, 1] + 2
    close(masked_whiten(y, m, shift_mean=False)[:3], [1.0, 2.0, 3.0])
    # a single valid element (verl raises): x - mean = 0, var 0 -> 0, finite
    close(masked_whiten(y, torch.tensor([0, 1, 0, 0]))[1], 0.0)
    # an empty mask (verl raises): mean 0, var 0 -> x / sqrt(0 + 1e-8) = x * 1e4, finite
    torch.testing.assert_close(masked_whiten(y, torch.zeros(4)), y * 1e4, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------------
# KL penalties
# ---------------------------------------------------------------------------------------------------

# d = logprobs - ref_logprobs = [ln 2, -ln 2]
KL_LOGP = [[-1.0 + LN2, -1.0 - LN2]]
KL_REF = [[-1.0, -1.0]]
KL_EXPECTED = {
    # k1 = d
    "kl": [LN2, -LN2],
    "k1": [LN2, -LN2],
    # |d|
    "abs": [LN2, LN2],
    # ½ d² = ½ ln²2 = 0.2402265
    "mse": [0.5 * LN2**2, 0.5 * LN2**2],
    "k2": [0.5 * LN2**2, 0.5 * LN2**2],
    # x = -d: d = ln2 -> e^{-ln2} + ln2 - 1 = ln2 - 0.5 = 0.1931472;
    #         d = -ln2 -> e^{ln2} - ln2 - 1 = 1 - ln2 = 0.3068528
    "low_var_kl": [LN2 - 0.5, 1.0 - LN2],
    "k3": [LN2 - 0.5, 1.0 - LN2],
}


@pytest.mark.parametrize("kind", sorted(KL_EXPECTED))
def test_kl_penalty_values_and_straight_through(kind: str) -> None:
    close(kl_penalty(t64(KL_LOGP), t64(KL_REF), kind), [KL_EXPECTED[kind]])
    logp = t64(KL_LOGP).requires_grad_()
    ref = t64(KL_REF).requires_grad_()
    est = kl_penalty(logp, ref, kind + "+")
    # "+": the estimator's value ...
    close(est, [KL_EXPECTED[kind]])
    est.sum().backward()
    # ... with the gradient of ½ d²: ∂/∂logp = d = [ln2, -ln2], ∂/∂ref = -d
    close(logp.grad, [[LN2, -LN2]])
    close(ref.grad, [[-LN2, LN2]])


def test_low_var_kl_clamps() -> None:
    # d = -30: x = 30 -> clamp 20 -> e^20 - 21 ≈ 4.85e8 -> clamp 10
    # d = +30: x = -30 -> clamp -20 -> e^-20 + 20 - 1 ≈ 19.0 -> clamp 10
    # d = 0: e^0 - 0 - 1 = 0
    out = kl_penalty(t64([[-30.0, 30.0, 0.0]]), torch.zeros(1, 3, dtype=torch.float64), "k3")
    close(out, [[10.0, 10.0, 0.0]])


def test_kl_penalty_unknown_kind() -> None:
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="valid kinds"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_penalty_gradcheck(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 3, dtype=torch.float64, generator=gen)
    # keep |d| >= 0.3 so that abs is smooth around the inputs
    ref = logp + torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda a, b: kl_penalty(a, b, kind), (logp.requires_grad_(), ref.requires_grad_())
    )


# ---------------------------------------------------------------------------------------------------
# full KL and entropy
# ---------------------------------------------------------------------------------------------------


def test_full_kl_hand_value_and_mask() -> None:
    logits = t64([[[0.0, LN3], [5.0, -5.0]]])
    ref_logits = t64([[[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    out = full_kl(logits, ref_logits, mask)
    # p = softmax(0, ln3) = (1/4, 3/4), q = (1/2, 1/2):
    # KL = ¼ ln(½) + ¾ ln(3/2) = ¾ ln3 - ln2 = 0.1308120; masked position -> 0
    close(out, [[0.75 * LN3 - LN2, 0.0]])
    # identical distributions (shift-invariant logits) -> 0
    close(full_kl(t64([[[1.0, 2.0, 3.0]]]), t64([[[11.0, 12.0, 13.0]]]), torch.ones(1, 1)), [[0.0]])


def test_full_kl_chunked_matches_unchunked_and_upcasts() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=gen)
    ref_logits = torch.randn(3, 5, 7, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    # reference: direct formula on the whole tensor
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    expected = (logp.exp() * (logp - logq)).sum(-1) * mask
    for chunk in (1, 4, 100):
        a = logits.clone().requires_grad_()
        b = ref_logits.clone().requires_grad_()
        out = full_kl(a, b, mask, chunk_tokens=chunk)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        # ∂KL/∂a = p (log p - log q - KL), ∂KL/∂b = q - p, zero at masked positions
        p, q = logp.exp(), logq.exp()
        kl = (p * (logp - logq)).sum(-1, keepdim=True)
        torch.testing.assert_close(a.grad, p * (logp - logq - kl) * mask[..., None])
        torch.testing.assert_close(b.grad, (q - p) * mask[..., None])
    # bf16 logits are computed and returned in fp32
    out16 = full_kl(logits.bfloat16(), ref_logits.bfloat16(), mask)
    assert out16.dtype == torch.float32
    torch.testing.assert_close(out16, expected, atol=0.05, rtol=0.05)


def test_full_kl_gradcheck() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    ref_logits = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # chunk_tokens=2 runs the checkpointed chunk path in backward
    torch.autograd.gradcheck(lambda a, b: full_kl(a, b, mask, chunk_tokens=2), (logits, ref_logits))


def test_entropy_from_logits() -> None:
    # uniform over 4: ln 4; p = (1/4, 3/4): -(¼ ln¼ + ¾ ln¾) = ln4 - ¾ ln3 = 0.5623351
    close(entropy_from_logits(t64([0.0, 0.0, 0.0, 0.0])), math.log(4.0))
    close(entropy_from_logits(t64([[0.0, LN3], [7.0, 7.0 + LN3]])), [2 * LN2 - 0.75 * LN3] * 2)
    # bf16 input, large logits: computed in fp32, shift-invariant -> ln 2
    out = entropy_from_logits(torch.full((2, 3, 2), 1000.0, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    close(out, torch.full((2, 3), LN2))
    # one-hot-like logits: entropy ≈ 0, finite
    assert 0.0 <= entropy_from_logits(torch.tensor([0.0, 80.0])).item() < 1e-6


def test_entropy_gradcheck() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_tokens=4), (logits.requires_grad_(),))


# ---------------------------------------------------------------------------------------------------
# KL controllers
# ---------------------------------------------------------------------------------------------------


def test_fixed_kl_controller() -> None:
    ctrl = FixedKLController(kl_coef=0.1)
    ctrl.update(current_kl=100.0, n_steps=256)
    # fixed: unchanged
    assert ctrl.value == 0.1
    state = ctrl.state_dict()
    assert state == {"value": 0.1} and type(state["value"]) is float
    other = FixedKLController(kl_coef=0.5)
    other.load_state_dict(state)
    assert other.value == 0.1


def test_adaptive_kl_controller_steps_and_checkpoint() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    # e = clip(9/6 - 1 = 0.5, ±0.2) = 0.2; β = 0.2 · (1 + 0.2 · 256 / 10000) = 0.2 · 1.00512 = 0.201024
    assert ctrl.value == pytest.approx(0.201024, abs=1e-12)
    ctrl.update(current_kl=torch.tensor(5.4), n_steps=1000)
    # e = 5.4/6 - 1 = -0.1 (inside the clip); β = 0.201024 · (1 - 0.1 · 0.1) = 0.201024 · 0.99 = 0.19901376
    assert ctrl.value == pytest.approx(0.19901376, abs=1e-8)
    ctrl.update(current_kl=0.0, n_steps=10000)
    # e = clip(-1, ±0.2) = -0.2; β = 0.19901376 · (1 - 0.2 · 1) = 0.159211008
    assert ctrl.value == pytest.approx(0.159211008, abs=1e-8)

    state = ctrl.state_dict()
    assert set(state) == {"value"} and type(state["value"]) is float
    resumed = AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10000)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value
    # the resumed controller continues identically
    ctrl.update(7.0, 64)
    resumed.update(7.0, 64)
    assert resumed.value == ctrl.value
    with pytest.raises(ValueError):
        resumed.load_state_dict({"value": 1.0, "typo": 2.0})
    with pytest.raises(ValueError):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)


# ---------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------

# r = [0, 0, 1], V = [0.1, 0.2, 0.3]; recursion from t = 2 down, next_value = last_gae = 0 at the end.
GAE_CASES = [
    # γ = λ = 1: A_t = Σ_{k≥t} r_k - V_t = [0.9, 0.8, 0.7]; returns = A + V = [1, 1, 1]
    (1.0, 1.0, [0.9, 0.8, 0.7], [1.0, 1.0, 1.0]),
    # γ = λ = 0.9: δ2 = 1 - 0.3 = 0.7, A2 = 0.7; δ1 = 0.9·0.3 - 0.2 = 0.07, A1 = 0.07 + 0.81·0.7 = 0.637;
    # δ0 = 0.9·0.2 - 0.1 = 0.08, A0 = 0.08 + 0.81·0.637 = 0.59597; returns = [0.69597, 0.837, 1.0]
    (0.9, 0.9, [0.59597, 0.637, 0.7], [0.69597, 0.837, 1.0]),
    # γ = 1, λ = 0.9: A2 = 0.7; δ1 = 0.1, A1 = 0.1 + 0.9·0.7 = 0.73; δ0 = 0.1, A0 = 0.1 + 0.9·0.73 = 0.757
    (1.0, 0.9, [0.757, 0.73, 0.7], [0.857, 0.93, 1.0]),
    # γ = 0.9, λ = 1: A2 = 0.7; A1 = 0.07 + 0.9·0.7 = 0.7; A0 = 0.08 + 0.9·0.7 = 0.71;
    # returns = discounted return-to-go [0.81, 0.9, 1.0]
    (0.9, 1.0, [0.71, 0.7, 0.7], [0.81, 0.9, 1.0]),
]


@pytest.mark.parametrize(("gamma", "lam", "adv", "ret"), GAE_CASES)
def test_gae_short_sequence(gamma: float, lam: float, adv: list[float], ret: list[float]) -> None:
    rewards, values = t64([[0.0, 0.0, 1.0]]), t64([[0.1, 0.2, 0.3]])
    advantages, returns = compute_gae(rewards, values, torch.ones(1, 3), gamma, lam, whiten=False)
    close(advantages, [adv])
    close(returns, [ret])


@pytest.mark.parametrize(("gamma", "lam", "adv", "ret"), GAE_CASES)
def test_gae_masked_middle_position_is_skipped(
    gamma: float, lam: float, adv: list[float], ret: list[float]
) -> None:
    # The same three tokens with a masked position (reward 5, value 9) inserted at t = 1: it is skipped,
    # so token 0 bootstraps from token 2 and the valid results equal the unmasked case; output 0 there.
    rewards, values = t64([[0.0, 5.0, 0.0, 1.0]]), t64([[0.1, 9.0, 0.2, 0.3]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # a 0/1 float mask works like a bool one
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam, whiten=False)
    close(advantages, [[adv[0], 0.0, adv[1], adv[2]]])
    close(returns, [[ret[0], 0.0, ret[1], ret[2]]])


def test_gae_whitening_and_fully_masked_row() -> None:
    rewards = t64([[0.0, 5.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    values = t64([[0.1, 9.0, 0.2, 0.3], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, False, True, True], [False, False, False, False]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.9)
    # raw A over the valid tokens = [0.59597, 0.637, 0.7] (γ = λ = 0.9 case above);
    # mean = 1.93297 / 3 = 0.6443233; deviations = [-0.0483533, -0.0073233, 0.0556767];
    # unbiased var = (0.00233805 + 0.00005363 + 0.00309989) / 2 = 0.00274578; std = 0.0524002
    # whitened = deviations / sqrt(var + 1e-8) = [-0.9227679, -0.1397574, 1.0625253]
    close(advantages, [[-0.9227679, 0.0, -0.1397574, 1.0625253], [0.0, 0.0, 0.0, 0.0]])
    # returns are taken before whitening; the fully masked row is all 0, not NaN
    close(returns, [[0.69597, 0.0, 0.837, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # a single valid token in the batch whitens to 0 (finite)
    single, _ = compute_gae(rewards, values, torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]]), 1.0, 1.0)
    close(single, torch.zeros(2, 4))


# ---------------------------------------------------------------------------------------------------
# GRPO and RLOO
# ---------------------------------------------------------------------------------------------------

# Groups given by non-contiguous, unsorted ids:
#   id 7 -> scores [1, 0, 0, 1] (rows 0, 2, 4, 6); id 2 -> [2] (row 3, a group of one);
#   id 5 -> [3, 3] (rows 1, 5, all equal)
GROUP_SCORES = [1.0, 3.0, 0.0, 2.0, 0.0, 3.0, 1.0]
GROUP_IDS = [7, 5, 7, 2, 7, 5, 7]


def group_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.ones(7, 3, dtype=torch.bool)
    mask[0, 2] = False  # a padded token gets advantage 0
    return torch.tensor(GROUP_SCORES), torch.tensor(GROUP_IDS), mask


def test_grpo_advantages() -> None:
    scores, group_ids, mask = group_inputs()
    adv = compute_grpo_advantages(scores, group_ids, mask)
    # id 7: mean 0.5, unbiased std = sqrt(4 · 0.25 / 3) = 0.5773503 -> ±0.5 / (0.5773503 + 1e-6) = ±0.8660239
    # id 2 (group of one, verl): mean 0, std 1 -> 2 / (1 + 1e-6) = 1.999998
    # id 5 (all equal): (3 - 3) / (0 + 1e-6) = 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, 0.0, -a, 2 / (1 + 1e-6), -a, 0.0, a])[:, None].expand(7, 3) * mask
    close(adv, expected)
    assert adv[0, 2] == 0.0 and torch.isfinite(adv).all()
    # Dr. GRPO (no std): id 7 -> ±0.5, id 2 -> 2 - 0 = 2, id 5 -> 0
    adv_nostd = compute_grpo_advantages(scores, group_ids, mask, norm_by_std=False)
    close(adv_nostd[:, 0], [0.5, 0.0, -0.5, 2.0, -0.5, 0.0, 0.5])


def test_rloo_advantages() -> None:
    scores, group_ids, mask = group_inputs()
    adv = compute_rloo_advantages(scores, group_ids, mask)
    # id 7 (n = 4): s·4/3 - 0.5·4/3 = ±2/3; check row 0 by leave-one-out: 1 - (0 + 0 + 1)/3 = 2/3
    # id 2 (group of one, verl): no baseline, A = s = 2
    # id 5 (all equal): 3·2 - 3·2 = 0
    expected = torch.tensor([2 / 3, 0.0, -2 / 3, 2.0, -2 / 3, 0.0, 2 / 3])[:, None].expand(7, 3) * mask
    close(adv, expected)
    assert adv[0, 2] == 0.0 and torch.isfinite(adv).all()


# ---------------------------------------------------------------------------------------------------
# policy and value losses
# ---------------------------------------------------------------------------------------------------


def test_policy_loss_clip_branches_and_dual_clip() -> None:
    # clip_ratio_low = 0.2, clip_ratio_high = 0.28, clip_ratio_c = 3. Tokens:
    #  a: A = +1, ρ = e^0.1 = 1.1051709 (inside [0.8, 1.28]): l = -1.1051709, unclipped
    #  b: A = +1, ρ = 1.5: l1 = -1.5, l2 = -1.28 -> max = -1.28, clipped (l2 > l1)
    #  c: A = -1, ρ = 0.5: l1 = 0.5, l2 = 0.8 -> max = 0.8, clipped; dual bound 3 not hit
    #  d: A = -1, ρ = 4: l1 = 4, l2 = 1.28 -> max = 4 > 3 -> dual clip l = 3 (lower clip)
    #  e: masked (log-ratio 50, clamped to 20): ignored
    log_ratio = [0.1, math.log(1.5), math.log(0.5), math.log(4.0), 50.0]
    old = t64([[-2.0] * 5])
    logp = (old + t64([log_ratio])).requires_grad_()
    adv = t64([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    # (-1.1051709 - 1.28 + 0.8 + 3) / 4 = 1.4148291 / 4 = 0.3537073
    close(loss, (-math.exp(0.1) - 1.28 + 0.8 + 3.0) / 4)
    # clipped: b, c -> 2/4; lower (dual) clipped: d -> 1/4
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["pg_clipfrac_lower"], 0.25)
    # ppo_kl = mean(-log ρ) = -(0.1 + ln1.5 + ln0.5 + ln4) / 4 = -(0.1 + ln 3) / 4 = -0.2996530
    close(metrics["ppo_kl"], -(0.1 + LN3) / 4)
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    # only the unclipped token a has a gradient: ∂/∂logp (-A ρ / 4) = -ρ / 4 = -0.2762927;
    # clipped (b, c), dual-clipped (d, a constant) and masked (e) tokens get 0
    close(logp.grad, [[-math.exp(0.1) / 4, 0.0, 0.0, 0.0, 0.0]])

    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, 0.2, 0.28, 1.0, "token-mean")


def test_value_loss_clipping() -> None:
    # c = 0.5. Tokens (V, V_old, R):
    #  a: (1.2, 1.0, 2.0): V_clip = 1.2, (V - R)² = 0.64 = (V_clip - R)² -> 0.64, not clipped
    #  b: (2.0, 1.0, 2.0): V_clip = 1.5, (V - R)² = 0, (V_clip - R)² = 0.25 -> 0.25, clipped
    #  c: (0.0, 1.0, 3.0): V_clip = 0.5, 9 vs 6.25 -> 9, not clipped
    #  d: masked
    values = t64([[1.2, 2.0, 0.0, 7.0]]).requires_grad_()
    old_values = t64([[1.0, 1.0, 1.0, 0.0]])
    returns = t64([[2.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, 0.5, "token-mean")
    # ½ · (0.64 + 0.25 + 9) / 3 = 1.6483333
    close(loss, 0.5 * 9.89 / 3)
    # one of three valid tokens uses the clipped error
    close(metrics["vf_clipfrac"], 1 / 3)
    assert not metrics["vf_clipfrac"].requires_grad
    loss.backward()
    # ∂/∂V ½(V - R)²/3 = (V - R)/3: a -> -0.8/3, c -> -3/3; b: clipped term is constant in V -> 0
    close(values.grad, [[-0.8 / 3, 0.0, -1.0, 0.0]])


# ---------------------------------------------------------------------------------------------------
# loss aggregation and exact accumulation
# ---------------------------------------------------------------------------------------------------

AGG_LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AGG_MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]  # row sums 6 and 9; row 2 fully masked
AGG_EXPECTED = {
    # (1 + 2 + 3 + 4 + 5) / 5 tokens = 3
    "token-mean": 3.0,
    # 1 + 2 + 3 + 4 + 5 = 15, no count (verl 0.9.1's masked sum, at dp_size 1)
    "token-sum": 15.0,
    # (6 + 9) / 2 sequences (the fully masked row is not counted) = 7.5
    "seq-mean-token-sum": 7.5,
    # (6/3 + 9/2) / 2 = (2 + 4.5) / 2 = 3.25
    "seq-mean-token-mean": 3.25,
    # (6 + 9) / 2 sequences / T with T = 3 (the width, when no loss_scale_factor is given) = 2.5
    # (verl 0.9.1: the sequence mean, then the constant)
    "seq-mean-token-sum-norm": 2.5,
}


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_modes(mode: str) -> None:
    loss_mat = t64(AGG_LOSS)
    loss_mat[2, 0] = float("nan")  # garbage under the mask must not leak
    mask = torch.tensor(AGG_MASK, dtype=torch.bool)
    close(agg_loss(loss_mat, mask, mode), AGG_EXPECTED[mode])
    # an all-masked batch gives 0, not NaN
    close(agg_loss(loss_mat, torch.zeros_like(mask), mode), 0.0)


def test_agg_loss_explicit_counts_and_errors() -> None:
    loss_mat, mask = t64(AGG_LOSS), torch.tensor(AGG_MASK)
    # 15 / 10 tokens = 1.5
    close(agg_loss(loss_mat, mask, "token-mean", num_tokens=10), 1.5)
    # 15 / 5 sequences = 3; (2 + 4.5) / 4 = 1.625; with loss_scale_factor 5: 15 / 2 / 5 = 1.5, and
    # with 5 sequences counted globally 15 / 5 / 5 = 0.6
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum", num_seqs=torch.tensor(5)), 3.0)
    close(agg_loss(loss_mat, mask, "seq-mean-token-mean", num_seqs=4), 1.625)
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=5), 1.5)
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", num_seqs=5, loss_scale_factor=5), 0.6)
    # token-sum takes no count; 2 replicas (a sequence-parallel pair on the same rows) take 15 / 2 each
    close(agg_loss(loss_mat, mask, "token-sum", num_tokens=10, num_seqs=5, loss_scale_factor=5), 15.0)
    close(agg_loss(loss_mat, mask, "token-sum", num_replicas=2), 7.5)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss_mat, mask, "sum")


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_gradcheck(mode: str) -> None:
    loss_mat = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    torch.autograd.gradcheck(lambda x: agg_loss(x, mask, mode), (loss_mat.requires_grad_(),))


def accumulation_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([6, 1, 0, 4, 3])  # row 2 fully masked
    mask = torch.arange(6)[None, :] < lengths[:, None]
    old_logprobs = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    return {
        "mask": mask,
        "logprobs": old_logprobs + 0.4 * torch.randn(5, 6, generator=gen, dtype=torch.float64),
        "old_logprobs": old_logprobs,
        "advantages": torch.randn(5, 6, generator=gen, dtype=torch.float64),
        "values": torch.randn(5, 6, generator=gen, dtype=torch.float64),
        "old_values": torch.randn(5, 6, generator=gen, dtype=torch.float64),
        "returns": torch.randn(5, 6, generator=gen, dtype=torch.float64),
    }


def combined_loss(b: dict[str, torch.Tensor], rows: slice, mode: str, **counts: object) -> torch.Tensor:
    """Policy + value + KL + entropy-like terms of the micro-batch ``rows``, all through agg_loss."""
    mask = b["mask"][rows]
    pg, _ = policy_loss(
        b["logprobs"][rows],
        b["old_logprobs"][rows],
        b["advantages"][rows],
        mask,
        0.2,
        0.28,
        3.0,
        mode,
        **counts,
    )
    vf, _ = value_loss(
        b["values"][rows], b["old_values"][rows], b["returns"][rows], mask, 0.2, mode, **counts
    )
    kl = kl_penalty(b["logprobs"][rows], b["old_logprobs"][rows], "k3+")
    return pg + 0.5 * vf + 0.1 * agg_loss(kl, mask, mode, **counts)


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_micro_batch_accumulation_is_exact(mode: str) -> None:
    """Uneven micro-batches with the mini-batch's global counts sum to the full-batch loss and gradient."""
    batch = accumulation_batch()
    num_tokens = int(batch["mask"].sum())  # 14
    num_seqs = int((batch["mask"].sum(-1) > 0).sum())  # 4: the fully masked row is not a sequence

    full = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in batch.items()}
    full_loss = combined_loss(full, slice(None), mode)
    full_loss.backward()

    micro = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in batch.items()}
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):  # sizes 2, 1 (fully masked), 2
        loss = combined_loss(micro, rows, mode, num_tokens=num_tokens, num_seqs=num_seqs)
        loss.backward()  # gradients accumulate as in the training loop
        total = total + loss.detach()

    torch.testing.assert_close(total, full_loss.detach(), rtol=1e-12, atol=1e-12)
    for key in ("logprobs", "values"):
        torch.testing.assert_close(micro[key].grad, full[key].grad, rtol=1e-12, atol=1e-12)
    if mode == "token-sum":  # no count to normalize by: each micro-batch's own sum is already exact
        return
    # the check can fail: per-micro-batch normalization (no global counts) gives a different loss
    naive = sum(combined_loss(batch, rows, mode).item() for rows in (slice(0, 2), slice(2, 3), slice(3, 5)))
    assert abs(naive - full_loss.item()) > 1e-3


def test_the_tables_name_every_choice() -> None:
    """Every loss mode and estimator the config accepts has its row (SPPO's targets one more), and a row
    is the function its name says."""
    assert set(algorithms.POLICY_LOSSES) == set(algorithms.POLICY_LOSS_MODES)
    assert set(algorithms.ADVANTAGE_ESTIMATORS) == set(algorithms.ADV_ESTIMATORS) | {"sppo"}
    assert algorithms.POLICY_LOSSES["gspo"].__name__ == "gspo_policy_loss"
    assert algorithms.ADVANTAGE_ESTIMATORS["rloo"].__name__ == "rloo_estimator"


def test_policy_loss_metrics_are_shares_of_the_mini_batch() -> None:
    """One row of 2 tokens, δ = [log 2, 0], A = 1, clip 0.2: token 0 is clipped (l1 = -2 < l2 = -1.2),
    pg_clipfrac 1/2 over this call. With num_tokens=4 (the mini-batch's tokens, all micro-batches) the
    call's share is 1/2 · 2/4 = 1/4; the loss is -(1.2 + 1) / 4 = -0.55."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    inputs = algorithms.PolicyLossInputs(
        logprobs=torch.tensor([[math.log(2.0), 0.0]]),
        old_logprobs=torch.zeros(1, 2),
        response_mask=mask,
        advantages=torch.ones(1, 2),
    )
    settings = algorithms.PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss, metrics = algorithms.POLICY_LOSSES["vanilla"](inputs, settings)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    loss, metrics = algorithms.POLICY_LOSSES["vanilla"](inputs, settings, num_tokens=4.0)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)
    assert loss.item() == pytest.approx(-0.55)
