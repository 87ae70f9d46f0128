"""The math of ``ppo.algorithms`` against the released verl 0.9.1 on the same random inputs.

verl is imported from a side folder (``make parity`` builds ``.verl091/``: the wheel without its
dependencies plus the few small packages that importing ``core_algos`` and ``rollout_corr_helper``
needs); without it every test here skips. Inputs are dense and ragged, with masks that have holes and
fully masked rows; losses are also summed over several micro-batch splits with the global counts, as
the trainer does. Differences that are by design are named in the test that shows them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ppo import algorithms as ours
from ppo.algorithms.correction import rollout_rs_mask
from tests.helpers import import_verl

_verl = import_verl("verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper")
pytestmark = pytest.mark.skipif(
    _verl is None, reason="verl 0.9.1 side environment absent (or for another Python): run `make parity`"
)
if _verl is not None:
    verl, verl_corr = _verl

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
SPLITS = [[8], [3, 5], [1, 2, 2, 3]]  # micro-batch sizes over 8 rows
WIDTH = 7


def batch(seed: int, ragged: bool = True) -> dict[str, torch.Tensor]:
    """8 rows of 7 tokens; ragged: lengths 7, 3, 0 (fully masked), 5, 1, 7, 4, 6, with holes in rows 0
    and 5 (multi-turn observation tokens)."""
    gen = torch.Generator().manual_seed(seed)
    if ragged:
        lengths = torch.tensor([7, 3, 0, 5, 1, 7, 4, 6])
        mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
        mask[0, 2:4] = False
        mask[5, 1] = False
    else:
        mask = torch.ones(8, WIDTH, dtype=torch.bool)
    old = -torch.rand(8, WIDTH, generator=gen, dtype=torch.float64) * 3
    return {
        "mask": mask,
        "old": old,
        "logprobs": old + 0.3 * torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "ref": old + 0.5 * torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "adv": torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "values": torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "old_values": torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "returns": torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "rewards": torch.randn(8, WIDTH, generator=gen, dtype=torch.float64),
        "scores": torch.randint(0, 3, (8,), generator=gen).double(),
        "groups": torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]),
    }


def verl_counts(mask: torch.Tensor) -> dict[str, float]:
    return {
        "batch_num_tokens": float(mask.sum()),
        "global_batch_size": float((mask.sum(-1) > 0).sum()),
        "loss_scale_factor": WIDTH,
    }


def our_counts(mask: torch.Tensor) -> dict[str, float]:
    return {
        "num_tokens": float(mask.sum()),
        "num_seqs": float((mask.sum(-1) > 0).sum()),
        "loss_scale_factor": WIDTH,
    }


def split_sum(fn, sizes: list[int], n: int = 8):  # noqa: ANN001, ANN202
    """Sum of ``fn(rows)`` over consecutive micro-batches of ``sizes``."""
    starts = np.cumsum([0, *sizes])
    assert starts[-1] == n
    return sum(fn(slice(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:], strict=True))


# verl divides a row's token sum by (count + 1e-8) in seq-mean-token-mean: 1e-7 relative, not 1e-12
def close(a: torch.Tensor | float, b: torch.Tensor | float, tol: float = 1e-7) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=tol, atol=tol)  # fmt: skip


def actor_config(**policy_loss: float) -> object:
    """What verl's policy losses read of an ``ActorConfig``, built without its checks."""
    cfg = verl.ActorConfig.__new__(verl.ActorConfig)
    fields = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "policy_loss": SimpleNamespace(**policy_loss),
        "global_batch_info": {},
    }
    for k, v in fields.items():
        object.__setattr__(cfg, k, v)
    return cfg


# ---------------------------------------------------------------------------------------------------
# aggregation, policy and value losses, over micro-batch splits
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss(mode: str, sizes: list[int], ragged: bool) -> None:
    b = batch(0, ragged)
    x = b["rewards"]
    counts_v, counts_o = verl_counts(b["mask"]), our_counts(b["mask"])
    theirs = split_sum(lambda r: verl.agg_loss(x[r], b["mask"][r].double(), mode, **counts_v), sizes)
    mine = split_sum(lambda r: ours.agg_loss(x[r], b["mask"][r], mode, **counts_o), sizes)
    close(mine, theirs)


@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_policy_loss_and_gradient(loss_mode: str, mode: str, sizes: list[int]) -> None:
    b = batch(1)
    mask, counts_v = b["mask"], verl_counts(b["mask"])
    fn = verl.get_policy_loss_fn(loss_mode)
    grads = {}
    for who in ("verl", "ours"):
        lp = b["logprobs"].clone().requires_grad_()

        def one(r: slice, lp: torch.Tensor = lp, who: str = who) -> torch.Tensor:
            if who == "verl":
                cfg = actor_config()
                cfg.global_batch_info.update(counts_v)
                loss, _ = fn(b["old"][r], lp[r], b["adv"][r], mask[r].double(), mode, cfg)
                return loss
            loss, _ = ours.policy_loss(lp[r], b["old"][r], b["adv"][r], mask[r], 0.2, 0.28, 3.0, mode,
                                       loss_mode=loss_mode, **our_counts(mask))  # fmt: skip
            return loss

        total = split_sum(one, sizes)
        total.backward()
        grads[who] = (total.detach(), lp.grad)
    close(grads["ours"][0], grads["verl"][0])
    close(grads["ours"][1], grads["verl"][1])


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_policy_loss_metrics(loss_mode: str) -> None:
    b = batch(2)
    mask = b["mask"]
    # large log-ratios so that both clips act
    lp = b["old"] + 5.0 * (b["logprobs"] - b["old"])
    _, theirs = verl.get_policy_loss_fn(loss_mode)(
        b["old"], lp, b["adv"], mask.double(), "token-mean", actor_config()
    )
    _, mine = ours.policy_loss(
        lp, b["old"], b["adv"], mask, 0.2, 0.28, 3.0, "token-mean", loss_mode=loss_mode
    )
    for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        close(mine[key], theirs[f"actor/{key}"])
    if loss_mode == "vanilla":
        assert theirs["actor/pg_clipfrac"] > 0 and theirs["actor/pg_clipfrac_lower"] > 0  # both clips act


def test_clip_cov_with_the_same_tokens() -> None:
    """With every candidate chosen (ratio 1) both pick the same tokens: valid, unclipped, with
    ``lb < cov < ub``, cov from the current log-probs. Named difference: verl's ``pg_clipfrac`` here is
    the share of detached tokens, ours ``pg_covfrac`` (our ``pg_clipfrac`` is the clip's share)."""
    b = batch(3)
    mask, lp = b["mask"], b["logprobs"].clone().requires_grad_()
    cfg = actor_config(clip_cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=2.0)
    theirs, tm = verl.get_policy_loss_fn("clip_cov")(b["old"], lp, b["adv"], mask.double(), "token-mean", cfg)
    cov = ours.token_covariance(b["adv"], lp.detach(), mask)
    ids = torch.arange(mask.numel()).reshape(mask.shape)
    chosen = ours.clip_cov_selection(cov, mask, ids, ratio=1.0, lb=0.0, ub=2.0, generator=torch.Generator())
    mine, mm = ours.policy_loss(lp, b["old"], b["adv"], mask, 0.2, 0.28, 3.0, "token-mean",
                                loss_mode="clip_cov", cov_mask=chosen)  # fmt: skip
    close(mine, theirs)
    g_theirs = torch.autograd.grad(theirs, lp, retain_graph=True)[0]
    close(torch.autograd.grad(mine, lp)[0], g_theirs)
    close(mm["pg_covfrac"], tm["actor/pg_clipfrac"])
    close(mm["ppo_kl"], tm["actor/ppo_kl"])
    assert 0 < tm["actor/pg_clipfrac"] < 1  # some tokens detached, not all


def test_kl_cov_with_the_same_tokens() -> None:
    """Top ``int(ratio · N)`` covariances, from the current log-probs. Named difference: verl's KL-Cov
    logs ``ppo_kl`` as the mean ``|log-ratio|``, ours the k1 mean ``-log-ratio`` as every mode."""
    b = batch(4)
    mask, lp = b["mask"], b["logprobs"].clone().requires_grad_()
    cfg = actor_config(kl_cov_ratio=0.2, ppo_kl_coef=0.1)
    theirs, tm = verl.get_policy_loss_fn("kl_cov")(b["old"], lp, b["adv"], mask.double(), "token-mean", cfg)
    cov = ours.token_covariance(b["adv"], lp.detach(), mask)
    ids = torch.arange(mask.numel()).reshape(mask.shape)
    chosen = ours.kl_cov_selection(cov, mask, ids, ratio=0.2)
    mine, mm = ours.policy_loss(lp, b["old"], b["adv"], mask, 0.2, 0.28, 3.0, "token-mean",
                                loss_mode="kl_cov", cov_mask=chosen, ppo_kl_coef=0.1)  # fmt: skip
    close(mine, theirs)
    g_theirs = torch.autograd.grad(theirs, lp, retain_graph=True)[0]
    close(torch.autograd.grad(mine, lp)[0], g_theirs)
    close(tm["actor/ppo_kl"], ours.masked_mean((lp.detach() - b["old"]).abs(), mask))


@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss(mode: str, sizes: list[int]) -> None:
    b = batch(5)
    mask = b["mask"]
    c = verl_counts(mask)
    theirs = split_sum(lambda r: verl.compute_value_loss(b["values"][r], b["returns"][r], b["old_values"][r],
                                                         mask[r].double(), 0.2, mode, **c)[0], sizes)  # fmt: skip
    mine = split_sum(lambda r: ours.value_loss(b["values"][r], b["old_values"][r], b["returns"][r], mask[r], 0.2,
                                               mode, **our_counts(mask))[0], sizes)  # fmt: skip
    close(mine, theirs)
    _, clipfrac = verl.compute_value_loss(b["values"], b["returns"], b["old_values"], mask.double(), 0.2)
    close(ours.value_loss(b["values"], b["old_values"], b["returns"], mask, 0.2, "token-mean")[1]["vf_clipfrac"],
          clipfrac)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "abs+", "k3+", "low_var_kl+"]
)
def test_kl_penalty_value_and_gradient(kind: str) -> None:
    b = batch(6)
    lp_v, lp_o = b["logprobs"].clone().requires_grad_(), b["logprobs"].clone().requires_grad_()
    theirs, mine = verl.kl_penalty(lp_v, b["ref"], kind), ours.kl_penalty(lp_o, b["ref"], kind)
    close(mine, theirs)
    (theirs * b["mask"]).sum().backward()
    (mine * b["mask"]).sum().backward()
    close(lp_o.grad, lp_v.grad)


# ---------------------------------------------------------------------------------------------------
# advantage estimators
# ---------------------------------------------------------------------------------------------------


def outcome_rewards(b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's score on its last valid token (where the trainer puts it)."""
    mask = b["mask"]
    last = (mask.long() * torch.arange(WIDTH)).argmax(-1)
    rewards = torch.zeros(8, WIDTH, dtype=torch.float64)
    rewards[torch.arange(8), last] = torch.where(mask.any(-1), b["scores"], 0.0)
    return rewards


@pytest.mark.parametrize("ragged", [True, False])
def test_gae(ragged: bool) -> None:
    b = batch(7, ragged)
    mask = b["mask"]
    adv_v, ret_v = verl.compute_gae_advantage_return(b["rewards"], b["values"], mask.double(), 0.99, 0.95)
    adv_o, ret_o = ours.compute_gae(b["rewards"], b["values"], mask, 0.99, 0.95)
    close(adv_o * mask, adv_v * mask)
    close(ret_o * mask, ret_v * mask)


@pytest.mark.parametrize("norm_by_std", [True, False], ids=["grpo", "drgrpo"])
def test_grpo(norm_by_std: bool) -> None:
    b = batch(8, ragged=False)
    mask, index = b["mask"], b["groups"].numpy()
    theirs, _ = verl.compute_grpo_outcome_advantage(outcome_rewards(b), mask.double(), index,
                                                    norm_adv_by_std_in_grpo=norm_by_std)  # fmt: skip
    close(ours.compute_grpo_advantages(b["scores"], b["groups"], mask, norm_by_std=norm_by_std), theirs, 1e-6)


@pytest.mark.parametrize("name", ["rloo", "opo", "reinforce_plus_plus_baseline"])
def test_group_estimators(name: str) -> None:
    b = batch(9)
    mask, index = b["mask"], b["groups"].numpy()
    keep = mask.any(-1)  # verl counts a fully masked row in its group; the trainer never makes one
    mask, index = mask[keep], index[keep.numpy()]
    scores, groups = b["scores"][keep], b["groups"][keep]
    rewards = outcome_rewards(b)[keep]
    fn = verl.get_adv_estimator_fn(name)
    theirs, _ = fn(token_level_rewards=rewards, response_mask=mask.double(), index=index, config=None)
    mine = {
        "rloo": ours.compute_rloo_advantages,
        "opo": ours.compute_opo_advantages,
        "reinforce_plus_plus_baseline": ours.compute_reinforce_plus_plus_baseline_advantages,
    }[name](scores, groups, mask)
    close(mine * mask, theirs * mask, 1e-6)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma: float) -> None:
    b = batch(10)
    mask = b["mask"]
    adv_v, ret_v = verl.compute_reinforce_plus_plus_outcome_advantage(b["rewards"], mask.double(),
                                                                      config=SimpleNamespace(gamma=gamma))  # fmt: skip
    adv_o, ret_o = ours.compute_reinforce_plus_plus_advantages(b["rewards"], mask, gamma)
    close(adv_o * mask, adv_v * mask)
    close(ret_o * mask, ret_v * mask)


# ---------------------------------------------------------------------------------------------------
# rollout correction
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights(level: str) -> None:
    b = batch(11)
    mask = b["mask"]
    rollout = b["old"] + 0.4 * torch.randn(
        8, WIDTH, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    log_ratio = b["old"] - rollout
    theirs, metrics = verl_corr.compute_rollout_correction_weights(log_ratio, mask.double(), level, 2.0)
    mine = ours.rollout_is_weights(b["old"], rollout, mask, level=level, threshold=2.0)
    close(mine * mask, theirs * mask)
    off = verl_corr.compute_offpolicy_metrics(b["old"], rollout, mask.double())
    ours_m = ours.mismatch_metrics(b["old"], rollout, mask, threshold=2.0, level=level)
    close(ours_m["mismatch_kl"], off["kl"])
    close(ours_m["mismatch_k3_kl"], off["k3_kl"])
    # verl's IS metrics at the weights' level; its sequence-level share is over every row, empty ones
    # included: compare on the rows with tokens (row 2 has none)
    rows = mask.any(-1)
    _, at_level = verl_corr.compute_rollout_correction_weights(
        log_ratio[rows], mask[rows].double(), level, 2.0
    )
    close(ours_m["rollout_is_mean"], at_level["rollout_is_mean"])
    close(ours_m["rollout_is_ratio_fraction_high"], at_level["rollout_is_ratio_fraction_high"])
    assert 0 < at_level["rollout_is_ratio_fraction_high"] < 1, "some weights above the threshold, not all"


@pytest.mark.parametrize(
    ("options", "thresholds"),
    [
        ("token_k1", "0.7_1.5"),
        ("token_k1", 1.5),  # one number: the upper ratio bound, its reciprocal the lower
        ("token_k2", 0.02),
        ("token_k3", 0.02),
        ("seq_sum_k1", "0.5_2.0"),
        ("seq_sum_k2", 0.1),
        ("seq_sum_k3", 0.1),
        ("seq_mean_k1", "0.9_1.1"),
        ("seq_mean_k2", 0.03),
        ("seq_mean_k3", 0.03),
        ("seq_max_k2", 0.1),
        ("seq_max_k3", 0.1),
        ("token_k2,seq_mean_k3", "0.05,0.03"),
        ("token_k3,seq_max_k2,token_k3", 0.08),  # a repeated option counts once
    ],
)
def test_rollout_rejection_mask(options: str, thresholds: str | float) -> None:
    b = batch(12)
    mask = b["mask"]
    rollout = b["old"] + 0.3 * torch.randn(
        8, WIDTH, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    theirs, _ = verl_corr.compute_rollout_rejection_mask(
        b["old"] - rollout, mask.double(), options, thresholds
    )
    mine = rollout_rs_mask(b["old"], rollout, mask, options=options, thresholds=thresholds)
    assert torch.equal(mine, (theirs > 0.5) & mask)
    assert 0 < int(mine.sum()) < int(mask.sum()), "the bounds reject some tokens, not all"


# ---------------------------------------------------------------------------------------------------
# DAPO's group filter
# ---------------------------------------------------------------------------------------------------


def test_filter_groups_as_dapo() -> None:
    """verl's DAPO trainer keeps a prompt's group when its metric's std over the group is > 0, or when
    the group has one response (recipe ``dapo_ray_trainer``)."""
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.3, 0.3, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    kept = {
        int(g)
        for g in groups.unique()
        if values[groups == g].numel() == 1 or np.std(values[groups == g].numpy()) > 0
    }
    assert ours.filter_groups(values, groups).tolist() == [int(g) in kept for g in groups]


# ---------------------------------------------------------------------------------------------------
# on-policy distillation (verl.trainer.distillation)
# ---------------------------------------------------------------------------------------------------

try:  # imported apart, so that the tests above run even where these modules do not import
    _distill = import_verl(
        "verl.trainer.distillation.losses",
        "verl.trainer.distillation.fsdp.losses",
        "verl.workers.config",
        "verl.utils.tensordict_utils",
        "tensordict",
    )
except Exception:  # noqa: BLE001
    _distill = None
needs_distillation = pytest.mark.skipif(
    _distill is None, reason="verl 0.9.1's distillation modules do not import"
)
if _distill is not None:
    verl_distill, verl_distill_fsdp, verl_workers_config, verl_tu, tensordict = _distill

VOCAB, TOPK, MIN_CLAMP = 12, 4, -3.0


def topk_batch(seed: int) -> dict[str, torch.Tensor]:
    """``batch(seed)``'s mask with student logits ``[8, 7, VOCAB]`` and the teacher's top-``TOPK``
    log-probs and ids. Row b's student logits are ``a_b`` times the teacher's plus noise: sharper (the
    student's mass on the teacher's top-k exceeds the teacher's, so the divergence is negative), alike,
    or reversed (no top-k overlap)."""
    gen = torch.Generator().manual_seed(seed)
    teacher_logits = 2 * torch.randn(8, WIDTH, VOCAB, generator=gen, dtype=torch.float64)
    a = torch.tensor([1.5, 1.0, -1.0, 1.5, -1.0, 1.0, 0.0, 1.5], dtype=torch.float64)[:, None, None]
    student_logits = a * teacher_logits + torch.randn(8, WIDTH, VOCAB, generator=gen, dtype=torch.float64)
    teacher_lp, teacher_ids = torch.log_softmax(teacher_logits, -1).topk(TOPK, -1)
    return {
        "mask": batch(seed)["mask"],
        "logits": student_logits,
        "teacher_lp": teacher_lp,
        "teacher_ids": teacher_ids,
    }


def packed(x: torch.Tensor) -> torch.Tensor:
    """``[n, T, ...] -> [n (T + 1), ...]``: verl's unpadded layout of n sequences of one prompt token and T
    response tokens, whose response outputs sit one place left (``no_padding_2_padding``)."""
    pad = torch.zeros(x.shape[0], 1, *x.shape[2:], dtype=x.dtype)
    return torch.cat([x, pad], 1).reshape(-1, *x.shape[2:])


def verl_topk_outputs(logits: torch.Tensor, teacher_lp: torch.Tensor, teacher_ids: torch.Tensor,
                      clamp: float | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """verl's FSDP ``compute_forward_kl_topk`` on ``[n, T, ...]`` rows packed as one sequence: each output
    ``[n (T + 1)]``."""
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=False))
    nested = [torch.nested.nested_tensor([packed(x)], layout=torch.jagged) for x in (teacher_lp, teacher_ids)]
    out = verl_distill_fsdp.compute_forward_kl_topk(packed(logits)[None], *nested, cfg, "thd")
    return {k: v[0] for k, v in out.items()}


def our_topk(b: dict[str, torch.Tensor], logits: torch.Tensor, r: slice, clamp: float | None):  # noqa: ANN201
    """Our ``forward_kl_topk`` and ``topk_overlap`` on rows ``r``, from the same logits."""
    logprobs = torch.log_softmax(logits[r], -1)
    student = logprobs.gather(-1, b["teacher_ids"][r])
    losses, student_mass, teacher_mass = ours.forward_kl_topk(student, b["teacher_lp"][r], clamp)
    student_ids = logprobs.topk(TOPK, -1).indices
    count, advantage = ours.topk_overlap(b["teacher_ids"][r], student_ids, b["teacher_lp"][r], student, clamp)
    return losses, student_mass, teacher_mass, count, advantage


def verl_distillation_loss(loss_mode: str, agg_mode: str, rows: slice, mask: torch.Tensor,
                           model_output: dict[str, torch.Tensor], teacher_lp: torch.Tensor | None,
                           old: torch.Tensor | None, **loss_config: object) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """verl's ``distillation_loss`` (the whole composition: the mode's token losses, their range, the
    clamp, then ``agg_loss`` or the vanilla policy loss) on the micro-batch ``rows`` of 8 rows of
    ``WIDTH`` tokens, with the global counts of ``mask``; ``model_output`` is already packed. Returns
    the loss and verl's metrics (``Metric``s aggregated)."""
    n = mask[rows].shape[0]
    data = {
        "prompts": torch.ones(n, 1, dtype=torch.long),
        "responses": torch.ones(n, WIDTH, dtype=torch.long),
        "attention_mask": torch.ones(n, WIDTH + 1, dtype=torch.long),
        "response_mask": mask[rows].double(),
    }
    if teacher_lp is not None:
        data["teacher_logprobs"] = packed(teacher_lp[rows])
    if old is not None:
        data["old_log_probs"] = old[rows]
    data = tensordict.TensorDict(data, batch_size=[])
    counts = verl_counts(mask)
    verl_tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=counts["batch_num_tokens"],
                              global_batch_size=counts["global_batch_size"])  # fmt: skip
    loss_cfg = verl_workers_config.DistillationLossConfig(loss_mode=loss_mode, topk=TOPK, **loss_config)
    actor = SimpleNamespace(loss_agg_mode=agg_mode, global_batch_info={}, loss_scale_factor=WIDTH)
    loss, metrics = verl_distill.distillation_loss(
        actor, SimpleNamespace(distillation_loss=loss_cfg), model_output, data
    )
    return loss, {k: v.aggregate() if hasattr(v, "aggregate") else v for k, v in metrics.items()}


@needs_distillation
def test_distillation_loss_modes() -> None:
    """Our list of loss modes is verl's registry; the estimator modes are its ``use_estimator`` ones."""
    assert sorted(ours.DISTILLATION_LOSS_MODES) == sorted(verl_distill.DISTILLATION_LOSS_REGISTRY)
    estimators = [
        m
        for m in ours.DISTILLATION_LOSS_MODES
        if verl_distill.get_distillation_loss_settings(m).use_estimator
    ]
    assert estimators == [m for m in ours.DISTILLATION_LOSS_MODES if m != "forward_kl_topk"]


@needs_distillation
@pytest.mark.parametrize("mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_distillation_token_losses_as_kl_penalty(mode: str) -> None:
    b = batch(8)
    lp_v, lp_o = b["logprobs"].clone().requires_grad_(), b["logprobs"].clone().requires_grad_()
    theirs = verl.kl_penalty(logprob=lp_v, ref_logprob=b["ref"], kl_penalty=mode)
    mine = ours.distillation_token_losses(lp_o, b["ref"], mode)
    close(mine, theirs)
    (theirs * b["adv"]).sum().backward()
    (mine * b["adv"]).sum().backward()
    close(lp_o.grad, lp_v.grad)


@needs_distillation
@pytest.mark.parametrize("clamp", [None, MIN_CLAMP])
def test_forward_kl_topk_and_overlap(clamp: float | None) -> None:
    """Top-k loss (after verl's clamp at 0), masses, overlap count and advantage, and the gradient to the
    student's logits, against verl's FSDP ``compute_forward_kl_topk`` on the same logits."""
    b = topk_batch(101)
    mask = b["mask"]
    weights = b["mask"] * torch.rand(
        8, WIDTH, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    logits_v, logits_o = b["logits"].clone().requires_grad_(), b["logits"].clone().requires_grad_()
    theirs = verl_topk_outputs(logits_v, b["teacher_lp"], b["teacher_ids"], clamp)
    theirs = {k: v.reshape(8, WIDTH + 1)[:, :WIDTH] for k, v in theirs.items()}  # the responses of packed()
    losses, student_mass, teacher_mass, count, advantage = our_topk(b, logits_o, slice(0, 8), clamp)
    close(losses, theirs["distillation_losses"].clamp_min(0.0))
    close(student_mass, theirs["student_mass"])
    close(teacher_mass, theirs["teacher_mass"])
    assert torch.equal(count, theirs["overlap_count"])
    close(advantage, theirs["overlap_token_advantage"])
    (theirs["distillation_losses"].clamp_min(0.0) * weights).sum().backward()
    (losses * weights).sum().backward()
    close(logits_o.grad, logits_v.grad)
    # the inputs exercise every corner: negative divergences clamped at 0, log-probs under the clamp,
    # tokens whose top-k do not overlap at all and tokens whose do entirely
    assert int((theirs["distillation_losses"][mask] < 0).sum()) > 0
    assert int((b["teacher_lp"][mask] < MIN_CLAMP).sum()) > 0
    assert {0, TOPK} <= set(count[mask].tolist())


@needs_distillation
@pytest.mark.parametrize("loss_max_clamp", [None, 0.3])
@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["k3", "abs", "forward_kl_topk"])
def test_distillation_loss(loss_mode: str, mode: str, sizes: list[int], loss_max_clamp: float | None) -> None:
    """The supervised loss (``use_policy_gradient=False``) and its gradient, summed over micro-batches
    with global counts, against verl's whole ``distillation_loss`` (verl refuses k1 here)."""
    topk = loss_mode == "forward_kl_topk"
    b = topk_batch(102) if topk else batch(9)
    mask = b["mask"]
    source = "logits" if topk else "logprobs"
    grads = {}
    for who in ("verl", "ours"):
        x = b[source].clone().requires_grad_()

        def one(r: slice, x: torch.Tensor = x, who: str = who) -> torch.Tensor:
            if who == "verl":
                if topk:
                    out = verl_topk_outputs(x[r], b["teacher_lp"][r], b["teacher_ids"][r], MIN_CLAMP)
                    return verl_distillation_loss(loss_mode, mode, r, mask, out, None, None,
                                                  use_policy_gradient=False, loss_max_clamp=loss_max_clamp,
                                                  log_prob_min_clamp=MIN_CLAMP)[0]  # fmt: skip
                return verl_distillation_loss(loss_mode, mode, r, mask, {"log_probs": packed(x[r])}, b["ref"],
                                              None, use_policy_gradient=False,
                                              loss_max_clamp=loss_max_clamp)[0]  # fmt: skip
            if topk:
                token_losses = our_topk(b, x, r, MIN_CLAMP)[0]
            else:
                token_losses = ours.distillation_token_losses(x[r], b["ref"][r], loss_mode)
            return ours.distillation_loss(token_losses, mask[r], mode, loss_max_clamp, **our_counts(mask))

        total = split_sum(one, sizes)
        total.backward()
        grads[who] = (total.detach(), x.grad)
    close(grads["ours"][0], grads["verl"][0])
    close(grads["ours"][1], grads["verl"][1])
    if loss_max_clamp is not None:  # the clamp acts on some tokens
        losses = ours.distillation_token_losses(b["logprobs"], b["ref"], loss_mode) if not topk else None
        losses = our_topk(b, b["logits"], slice(0, 8), MIN_CLAMP)[0] if topk else losses
        assert 0 < int((losses[mask] > loss_max_clamp).sum()) < int(mask.sum())


@needs_distillation
@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode, loss_max_clamp", [("k1", 0.5), ("k3", None)])
def test_distillation_policy_gradient(loss_mode: str, loss_max_clamp: float | None, mode: str,
                                      sizes: list[int]) -> None:  # fmt: skip
    """``use_policy_gradient=True``: the vanilla clipped loss with ``distillation_pg_advantages`` as the
    advantages, summed over micro-batches, against verl's ``distillation_loss``."""
    b = batch(10)
    mask = b["mask"]
    grads = {}
    for who in ("verl", "ours"):
        lp = b["logprobs"].clone().requires_grad_()

        def one(r: slice, lp: torch.Tensor = lp, who: str = who) -> torch.Tensor:
            if who == "verl":
                return verl_distillation_loss(loss_mode, mode, r, mask, {"log_probs": packed(lp[r])}, b["ref"],
                                              b["old"], use_policy_gradient=True, loss_max_clamp=loss_max_clamp,
                                              clip_ratio_high=0.28)[0]  # fmt: skip
            token_losses = ours.distillation_token_losses(lp[r], b["ref"][r], loss_mode)
            advantages = ours.distillation_pg_advantages(token_losses, loss_max_clamp)
            loss, _ = ours.policy_loss(lp[r], b["old"][r], advantages, mask[r], 0.2, 0.28, 3.0, mode,
                                       **our_counts(mask))  # fmt: skip
            return loss

        total = split_sum(one, sizes)
        total.backward()
        grads[who] = (total.detach(), lp.grad)
    close(grads["ours"][0], grads["verl"][0])
    close(grads["ours"][1], grads["verl"][1])


def resolved(means: dict[str, tuple[torch.Tensor, torch.Tensor]], extremes: dict[str, torch.Tensor]) -> dict:
    return {**{k: s / c for k, (s, c) in means.items()}, **extremes}


@needs_distillation
@pytest.mark.parametrize("loss_mode", ["kl", "k3", "abs", "forward_kl_topk"])
def test_distillation_metrics(loss_mode: str) -> None:
    """Our metrics' parts, resolved, on one micro-batch, against the ``distillation/*`` metrics of verl's
    ``distillation_loss``. Named difference: over several micro-batches verl averages each micro-batch's
    mean with equal weight, ours are the mini-batch's token means (``Σ sum / Σ count``)."""
    topk = loss_mode == "forward_kl_topk"
    b = topk_batch(103) if topk else batch(11)
    mask, rows = b["mask"], slice(0, 8)
    if topk:
        out = verl_topk_outputs(b["logits"], b["teacher_lp"], b["teacher_ids"], MIN_CLAMP)
        _, theirs = verl_distillation_loss(loss_mode, "token-mean", rows, mask, out, None, None,
                                           use_policy_gradient=False, log_prob_min_clamp=MIN_CLAMP)  # fmt: skip
        losses, student_mass, teacher_mass, count, advantage = our_topk(b, b["logits"], rows, MIN_CLAMP)
        mine = resolved(
            *ours.distillation_topk_metrics(student_mass, teacher_mass, mask, count, advantage, TOPK)
        )
        mine.update(
            ours.distillation_metrics(losses, mask)[1]
        )  # loss_min, loss_max; verl logs no abs_loss here
    else:
        _, theirs = verl_distillation_loss(loss_mode, "token-mean", rows, mask, {"log_probs": packed(b["logprobs"])},
                                           b["ref"], b["old"], use_policy_gradient=loss_mode == "kl",
                                           loss_max_clamp=0.1)  # fmt: skip
        theirs = {
            k: v for k, v in theirs.items() if not k.startswith(("distillation/pg_", "distillation/ppo_kl"))
        }
        mine = resolved(
            *ours.distillation_metrics(
                ours.distillation_token_losses(b["logprobs"], b["ref"], loss_mode), mask
            )
        )
    assert set(theirs) == {f"distillation/{k}" for k in mine}
    for key, value in mine.items():
        close(value, theirs[f"distillation/{key}"])
