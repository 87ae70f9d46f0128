"""On-policy distillation's math (``ppo.algorithms.distillation``) on cases computed by hand: the reverse-KL
estimators, the top-k forward KL with its clamps and gradient, the top-k overlap, the clamped and
aggregated loss over micro-batches, the policy-gradient advantages and the metrics' parts. The same
functions against verl 0.9.1 on random inputs: ``test_parity_verl.py``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from ppo.algorithms import (
    DISTILLATION_LOSS_MODES,
    KL_KINDS,
    LOSS_AGG_MODES,
    distillation_loss,
    distillation_metrics,
    distillation_pg_advantages,
    distillation_token_losses,
    distillation_topk_metrics,
    forward_kl_topk,
    topk_overlap,
)

LN2 = math.log(2.0)


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


# ---------------------------------------------------------------------------------------------------
# reverse-KL estimators of the sampled token
# ---------------------------------------------------------------------------------------------------


def test_estimator_modes_are_the_kl_kinds() -> None:
    assert DISTILLATION_LOSS_MODES[-1] == "forward_kl_topk"
    assert DISTILLATION_LOSS_MODES[:-1] == KL_KINDS


@pytest.mark.parametrize(
    "mode, expected",
    [
        # d = student - teacher = -1 - (-2) = 1
        ("kl", 1.0),
        ("k1", 1.0),
        ("abs", 1.0),
        ("mse", 0.5),  # d² / 2
        ("k2", 0.5),
        ("low_var_kl", math.exp(-1.0)),  # x = -d = -1: e⁻¹ - (-1) - 1 = e⁻¹
        ("k3", math.exp(-1.0)),
    ],
)
def test_token_losses_by_hand(mode: str, expected: float) -> None:
    student = torch.tensor([[-1.0, -3.0]], dtype=torch.float64)
    teacher = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)
    losses = distillation_token_losses(student, teacher, mode)
    assert losses.shape == (1, 2)
    assert losses[0, 0].item() == pytest.approx(expected, abs=1e-12)
    # second token: d = -2: k1 -2, abs 2, k2 2, k3 with x = 2: e² - 3
    second = {"kl": -2.0, "k1": -2.0, "abs": 2.0, "mse": 2.0, "k2": 2.0}.get(mode, math.exp(2.0) - 3.0)
    assert losses[0, 1].item() == pytest.approx(second, abs=1e-12)


def test_k3_clamps() -> None:
    # d = -30: x = clamp(30, ±20) = 20, e²⁰ - 21 clamped to 10; d = 30: x = -20, e⁻²⁰ + 19 = 19 -> 10
    student = torch.tensor([-31.0, -1.0], dtype=torch.float64)
    teacher = torch.tensor([-1.0, -31.0], dtype=torch.float64)
    assert distillation_token_losses(student, teacher, "k3").tolist() == [10.0, 10.0]


def test_token_losses_gradient_flows_to_the_student() -> None:
    student = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    distillation_token_losses(student, teacher, "k2").sum().backward()
    assert student.grad.item() == pytest.approx(1.0)  # ∂(d²/2)/∂s = d = 1
    assert teacher.grad.item() == pytest.approx(-1.0)  # the caller detaches the teacher's log-probs


@pytest.mark.parametrize("mode", ["bogus", "k3+", "forward_kl_topk", "full"])
def test_unknown_mode(mode: str) -> None:
    x = torch.zeros(1, 1)
    valid = "valid modes: kl, k1, abs, mse, k2, low_var_kl, k3$"
    with pytest.raises(ValueError, match=re.escape(repr(mode)) + ".*" + valid) as e:
        distillation_token_losses(x, x, mode)
    assert ("forward_kl_topk()" in str(e.value)) == (mode == "forward_kl_topk")


# ---------------------------------------------------------------------------------------------------
# forward KL over the teacher's top-k
# ---------------------------------------------------------------------------------------------------


def test_forward_kl_topk_by_hand() -> None:
    # one token, K = 2: teacher (0.5, 0.25), student at those ids (0.25, 0.25)
    # loss = 0.5 (ln 0.5 - ln 0.25) + 0.25 (ln 0.25 - ln 0.25) = 0.5 ln 2
    student = logs(0.25, 0.25)[None, None].requires_grad_()
    teacher = logs(0.5, 0.25)[None, None]
    losses, student_mass, teacher_mass = forward_kl_topk(student, teacher)
    assert losses.shape == student_mass.shape == teacher_mass.shape == (1, 1)
    assert losses.dtype == torch.float32  # fp32, as verl's kl_divergence
    assert losses.item() == pytest.approx(0.5 * LN2, rel=1e-6)
    assert student_mass.item() == pytest.approx(0.5)
    assert teacher_mass.item() == pytest.approx(0.75)
    losses.sum().backward()
    # ∂loss/∂s_k = -exp(t_k) = (-0.5, -0.25)
    torch.testing.assert_close(student.grad, torch.tensor([[[-0.5, -0.25]]], dtype=torch.float64))


def test_log_prob_min_clamp_changes_the_loss_not_the_masses() -> None:
    # teacher (0.5, e⁻⁵), student (0.25, e⁻⁸); clamp at -6 lifts the student's -8 to -6:
    # unclamped: 0.5 ln 2 + e⁻⁵ (-5 + 8) = 0.5 ln 2 + 3 e⁻⁵;  clamped: 0.5 ln 2 + e⁻⁵ (-5 + 6)
    teacher = torch.tensor([[math.log(0.5), -5.0]], dtype=torch.float64)
    free = torch.tensor([[math.log(0.25), -8.0]], dtype=torch.float64, requires_grad=True)
    clamped = free.detach().clone().requires_grad_()
    loss_free, s_free, t_free = forward_kl_topk(free, teacher)
    loss_clamped, s_clamped, t_clamped = forward_kl_topk(clamped, teacher, log_prob_min_clamp=-6.0)
    assert loss_free.item() == pytest.approx(0.5 * LN2 + 3 * math.exp(-5.0), rel=1e-6)
    assert loss_clamped.item() == pytest.approx(0.5 * LN2 + math.exp(-5.0), rel=1e-6)
    # the masses are of the unclamped log-probs: 0.25 + e⁻⁸ and 0.5 + e⁻⁵ either way
    assert s_free.item() == s_clamped.item() == pytest.approx(0.25 + math.exp(-8.0), rel=1e-12)
    assert t_free.item() == t_clamped.item() == pytest.approx(0.5 + math.exp(-5.0), rel=1e-12)
    loss_free.sum().backward()
    loss_clamped.sum().backward()
    assert free.grad[0].tolist() == pytest.approx([-0.5, -math.exp(-5.0)])
    assert clamped.grad[0].tolist() == pytest.approx([-0.5, 0.0])  # the clamped log-prob gets no gradient


def test_negative_topk_divergence_is_clamped_at_zero() -> None:
    # teacher (0.3, 0.2), student (0.6, 0.3): 0.3 ln(0.3/0.6) + 0.2 ln(0.2/0.3) = -0.2890 < 0 -> 0
    student = logs(0.6, 0.3).requires_grad_()
    losses, student_mass, teacher_mass = forward_kl_topk(student, logs(0.3, 0.2))
    assert losses.item() == 0.0
    assert (student_mass.item(), teacher_mass.item()) == pytest.approx((0.9, 0.5))
    losses.backward()
    assert student.grad.tolist() == [0.0, 0.0]


def test_forward_kl_topk_gradient_is_minus_teacher_probs() -> None:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(2 * torch.randn(3, 5, 8, generator=gen, dtype=torch.float64), -1)[..., :4]
    student = torch.log_softmax(2 * torch.randn(3, 5, 8, generator=gen, dtype=torch.float64), -1)[..., :4]
    student.requires_grad_()
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    losses, _, _ = forward_kl_topk(student, teacher, log_prob_min_clamp=-3.0)
    (losses * weights).sum().backward()
    active = (losses > 0)[..., None] & (student > -3.0)
    expected = torch.where(active, -weights[..., None] * teacher.clamp_min(-3.0).exp(), 0.0)
    assert 0 < int(active.sum()) < active.numel()  # both the clamp and the zero floor act somewhere
    torch.testing.assert_close(student.grad, expected, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# top-k overlap
# ---------------------------------------------------------------------------------------------------


def test_topk_overlap_by_hand() -> None:
    # three tokens, K = 2, teacher ids (3, 5) with probabilities (0.5, 0.25), student at them (0.25, 0.5)
    teacher_ids = torch.tensor([[3, 5], [3, 5], [3, 5]])
    student_ids = torch.tensor([[5, 7], [5, 3], [1, 2]])
    teacher = logs(0.5, 0.25).expand(3, 2)
    student = logs(0.25, 0.5).expand(3, 2)
    count, advantage = topk_overlap(teacher_ids, student_ids, teacher, student)
    assert count.tolist() == [1, 2, 0]
    # token 0: id 5 only: -0.25 (ln 0.25 - ln 0.5) = 0.25 ln 2
    # token 1: both: (-0.5 (ln 0.5 - ln 0.25) + 0.25 ln 2) / 2 = -0.125 ln 2;  token 2: none -> 0
    assert advantage.tolist() == pytest.approx([0.25 * LN2, -0.125 * LN2, 0.0])
    # clamped at -1 (as verl, the weight too): the teacher's ln 0.25 at id 5 becomes -1, so token 0 is
    # -e⁻¹ (-1 - ln 0.5) = e⁻¹ (1 - ln 2)
    _, clamped = topk_overlap(teacher_ids, student_ids, teacher, student, log_prob_min_clamp=-1.0)
    assert clamped[0].item() == pytest.approx(math.exp(-1.0) * (1 - LN2))


# ---------------------------------------------------------------------------------------------------
# the aggregated loss and the policy-gradient advantages
# ---------------------------------------------------------------------------------------------------

TOKEN_LOSSES = [[1.0, -3.0, 0.5], [2.0, 9.0, 9.0]]
MASK = [[True, True, True], [True, False, False]]


def test_distillation_loss_by_hand() -> None:
    losses = torch.tensor(TOKEN_LOSSES, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK)
    # token-mean: (1 - 3 + 0.5 + 2) / 4 = 0.125;  clamped to ±1.5: (1 - 1.5 + 0.5 + 1.5) / 4 = 0.375
    assert distillation_loss(losses, mask, "token-mean").item() == pytest.approx(0.125)
    clamped = distillation_loss(losses, mask, "token-mean", loss_max_clamp=1.5)
    assert clamped.item() == pytest.approx(0.375)
    # seq-mean-token-mean clamped: (0 / 3 + 1.5 / 1) / 2 = 0.75; with num_seqs=4: 1.5 / 4
    assert distillation_loss(losses, mask, "seq-mean-token-mean", 1.5).item() == pytest.approx(0.75)
    assert distillation_loss(losses, mask, "seq-mean-token-mean", 1.5, num_seqs=4).item() == pytest.approx(
        0.375
    )
    # seq-mean-token-sum-norm: (0 + 1.5) / 2 / loss_scale_factor 5
    norm = distillation_loss(losses, mask, "seq-mean-token-sum-norm", 1.5, loss_scale_factor=5)
    assert norm.item() == pytest.approx(0.15)
    clamped.backward()
    # 1/4 on the unclamped masked tokens, 0 on the clamped (-3, 2) and the masked-out ones
    assert losses.grad.tolist() == [[0.25, 0.0, 0.25], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    losses = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    mask[2] = False  # a fully masked row
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int(mask.any(-1).sum()), "loss_scale_factor": 5}
    whole = distillation_loss(losses, mask, mode, 0.8, **counts)
    parts = sum(
        distillation_loss(losses[r], mask[r], mode, 0.8, **counts)
        for r in (slice(0, 1), slice(1, 4), slice(4, 6))
    )
    assert whole.item() == pytest.approx(parts.item(), rel=1e-12)
    # and the whole batch with its own counts is the defaults' value
    assert whole.item() == pytest.approx(distillation_loss(losses, mask, mode, 0.8).item(), rel=1e-12)


def test_pg_advantages() -> None:
    losses = torch.tensor([[1.0, -3.0, 0.5]], requires_grad=True)
    advantages = distillation_pg_advantages(losses)
    assert advantages.tolist() == [[-1.0, 3.0, -0.5]]
    assert not advantages.requires_grad
    assert distillation_pg_advantages(losses, loss_max_clamp=2.0).tolist() == [[-1.0, 2.0, -0.5]]


# ---------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------


def test_distillation_metrics_by_hand() -> None:
    losses = torch.tensor(TOKEN_LOSSES)
    means, extremes = distillation_metrics(losses, torch.tensor(MASK))
    # |1| + |-3| + |0.5| + |2| = 6.5 over 4 tokens; the 9s are masked out
    assert {k: (s.item(), c.item()) for k, (s, c) in means.items()} == {"abs_loss": (6.5, 4.0)}
    assert {k: v.item() for k, v in extremes.items()} == {"loss_min": -3.0, "loss_max": 2.0}


def test_metrics_of_an_empty_mask() -> None:
    losses = torch.tensor([[float("nan"), 1.0]])
    none = torch.zeros(1, 2, dtype=torch.bool)
    means, extremes = distillation_metrics(losses, none)
    assert {k: (s.item(), c.item()) for k, (s, c) in means.items()} == {"abs_loss": (0.0, 0.0)}
    assert {k: v.item() for k, v in extremes.items()} == {"loss_min": math.inf, "loss_max": -math.inf}
    means, extremes = distillation_topk_metrics(losses, losses, none, torch.ones(1, 2), losses, topk=4)
    assert all(s.item() == 0.0 and c.item() == 0.0 for s, c in means.values())
    assert {k: v.item() for k, v in extremes.items()} == {
        "student_mass_min": math.inf,
        "student_mass_max": -math.inf,
        "teacher_mass_min": math.inf,
        "teacher_mass_max": -math.inf,
    }
    empty = torch.zeros(0, 2)  # a micro-batch without rows
    _, extremes = distillation_metrics(empty, empty.bool())
    assert {k: v.item() for k, v in extremes.items()} == {"loss_min": math.inf, "loss_max": -math.inf}


def test_distillation_topk_metrics_by_hand() -> None:
    mask = torch.tensor([[True, True, False]])
    student_mass = torch.tensor([[0.5, 0.9, 0.1]])
    teacher_mass = torch.tensor([[0.75, 0.6, 0.01]])
    overlap_count = torch.tensor([[2, 0, 1]])
    overlap_token_advantage = torch.tensor([[-0.1, 0.0, 0.3]])
    means, extremes = distillation_topk_metrics(
        student_mass, teacher_mass, mask, overlap_count, overlap_token_advantage, topk=4
    )
    got = {k: (round(s.item(), 6), c.item()) for k, (s, c) in means.items()}
    assert got == {
        "student_mass": (1.4, 2.0),
        "teacher_mass": (1.35, 2.0),
        "overlap_ratio": (0.5, 2.0),  # (2/4 + 0/4) over 2 tokens: 0.25
        "overlap_token_advantage": (-0.1, 1.0),  # the masked tokens with overlap: token 0 only
    }
    assert {k: round(v.item(), 6) for k, v in extremes.items()} == {
        "student_mass_min": 0.5,
        "student_mass_max": 0.9,
        "teacher_mass_min": 0.6,
        "teacher_mass_max": 0.75,
    }
    means, _ = distillation_topk_metrics(student_mass, teacher_mass, mask)
    assert set(means) == {"student_mass", "teacher_mass"}  # no overlap given, none logged


def test_metric_parts_of_micro_batches_add_up() -> None:
    gen = torch.Generator().manual_seed(2)
    losses = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.6
    mask[1:3] = False  # the second micro-batch below is empty
    rows = (slice(0, 1), slice(1, 3), slice(3, 6))
    parts = [distillation_metrics(losses[r], mask[r]) for r in rows]
    total = sum(p[0]["abs_loss"][0] for p in parts) / sum(p[0]["abs_loss"][1] for p in parts)
    assert total.item() == pytest.approx(losses[mask].abs().mean().item(), rel=1e-12)
    assert min(p[1]["loss_min"] for p in parts).item() == losses[mask].min().item()
    assert max(p[1]["loss_max"] for p in parts).item() == losses[mask].max().item()
