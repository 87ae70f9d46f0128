"""The step's data: what sampling returns (``Rollout``) and one PPO step's sequences with everything
scored for them (``Batch``). Below every module that fills or reads them (rollout, offline, packing,
rewards, update, metrics), so none of those needs another to name its types.

Token tensors are ``[B, R]`` over response tokens (``R = data.max_response_length``), right-padded;
rows ``[g*n, (g+1)*n)`` are the ``n`` responses to prompt ``g`` (``group_index``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ppo.data import PromptRecord


@dataclass(kw_only=True)
class Rollout:
    """This rank's sampled (or offline) sequences."""

    prompts: list[torch.Tensor]
    """``B`` prompt token tensors ``[P_i]`` (unpadded)."""
    responses: torch.Tensor
    """[B, R] response tokens, padded with the pad id after the end."""
    attention_mask: torch.Tensor
    """[B, R] bool: True on the response tokens that exist, up to and including the first EOS (and a
    multi-turn rollout's observations): what packing and the forwards see."""
    truncated: torch.Tensor
    """[B] bool: the response hit ``max_new_tokens`` without an EOS."""
    response_mask: torch.Tensor | None = None
    """[B, R] bool: True on the tokens the policy generated, the ones trained (every loss, KL, entropy,
    whitening and token count), as verl's ``response_mask``; given as None it is ``attention_mask``
    (single-turn: every token that exists was generated). A multi-turn rollout's observation tokens
    exist (``attention_mask``) but are not trained."""
    env_rewards: torch.Tensor | None = None
    """[B, R] rewards an environment gave, each on the last generated token of its turn; None: none."""
    turn_stats: dict[str, torch.Tensor] | None = None
    """Multi-turn rollouts: ``[B]`` per-row counts by name (``multi_turn.TURN_STATS``); None otherwise."""

    def __post_init__(self) -> None:
        if self.response_mask is None:
            self.response_mask = self.attention_mask

    @property
    def step_rewards(self) -> torch.Tensor:
        """``env_rewards``, or zeros."""
        return (
            self.env_rewards
            if self.env_rewards is not None
            else torch.zeros_like(self.attention_mask, dtype=torch.float32)
        )


def concat_rollouts(parts: list[Rollout], device: torch.device | None = None) -> Rollout:
    """One rollout of the sequences of ``parts`` in order (on ``device``, default: where they are). All
    parts share ``R``; multi-turn parts are all multi-turn (one run samples one way)."""
    with_env_rewards = any(part.env_rewards is not None for part in parts)

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(tensors)
        return out.to(device) if device is not None else out

    return Rollout(
        prompts=[p for part in parts for p in part.prompts],
        responses=cat([part.responses for part in parts]),
        attention_mask=cat([part.attention_mask for part in parts]),
        truncated=cat([part.truncated for part in parts]),
        response_mask=cat([part.response_mask for part in parts]),
        env_rewards=cat([part.step_rewards for part in parts]) if with_env_rewards else None,
        turn_stats=(
            {k: cat([part.turn_stats[k] for part in parts]) for k in parts[0].turn_stats}
            if parts and parts[0].turn_stats is not None
            else None
        ),
    )


def rollout_rows(rollout: Rollout, rows: slice, device: torch.device) -> Rollout:
    """The sequences ``rows`` of ``rollout``, on ``device``."""
    return Rollout(
        prompts=[p.to(device) for p in rollout.prompts[rows]],
        responses=rollout.responses[rows].to(device),
        attention_mask=rollout.attention_mask[rows].to(device),
        truncated=rollout.truncated[rows].to(device),
        response_mask=rollout.response_mask[rows].to(device),
        env_rewards=rollout.env_rewards[rows].to(device) if rollout.env_rewards is not None else None,
        turn_stats=(
            {k: v[rows].to(device) for k, v in rollout.turn_stats.items()}
            if rollout.turn_stats is not None
            else None
        ),
    )


@dataclass(kw_only=True)
class Batch:
    """One step's sequences on this rank. Token tensors are ``[B, R]`` over response tokens."""

    rollout: Rollout
    records: list[PromptRecord]
    """The prompt record of each sequence (repeated ``n`` times)."""
    group_ids: torch.Tensor
    """[B] index of the prompt a sequence answers (groups never straddle ranks)."""
    data_ranks: torch.Tensor | None = None
    """[B] the offline data set's rank of each response (0 = best), -1 for sampled ones."""
    data_scores: torch.Tensor | None = None
    """[B] the offline data set's score of each response (``reward.style=dataset``), NaN for sampled ones."""
    data_logprobs: torch.Tensor | None = None
    """[B, R] the log-probs of the policy that sampled the offline responses (the data's ``logprobs``),
    NaN where unknown; None when no response of the batch has them."""
    old_logprobs: torch.Tensor | None = None
    """[B, R] log-probs under the policy that sampled (None with the on-policy shortcut)."""
    ref_logprobs: torch.Tensor | None = None
    full_kl: torch.Tensor | None = None
    """[B, R] exact KL over the vocabulary (only with ``algorithm.kl_penalty=full``)."""
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    """[B] the reward of each sequence."""
    prm_rewards: torch.Tensor | None = None
    """[B, R] PRIME's implicit process rewards (``algorithm.adv_estimator=prime``), normalized."""
    token_rewards: torch.Tensor | None = None
    """[B, R] the score on the last response token minus the in-reward KL penalty."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    """[B] the regression target of each response, for a loss with one (SPPO)."""
    teacher_logprobs: torch.Tensor | None = None
    """[B, R] the row's teacher's log-prob of each sampled token (distillation's estimator losses)."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """[B, R, K] the teacher's ``K`` most likely next tokens' log-probs at each response position
    (``distillation.distillation_loss.loss_mode=forward_kl_topk``), with ``teacher_topk_ids``."""
    teacher_topk_ids: torch.Tensor | None = None
    """[B, R, K] those tokens' ids."""
    share_prompts: bool = False
    """Pack each prompt once with its responses after it in every forward of the step
    (``actor.use_prefix_grouper``; ``ppo.packing.pack``, ``micro_batches``)."""
    pack_cache: object | None = field(default=None, repr=False, compare=False)
    """``ppo.packing.PackCache``: the step's packing of these rows, built and read by ``packing.pack_rows``
    and ``micro_batches`` (never set by hand); it goes with the batch."""

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, R] the response tokens that exist (packing and forwards)."""
        return self.rollout.attention_mask

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, R] the tokens the policy generated: what is trained (every loss, KL, entropy, whitening
        and count)."""
        return self.rollout.response_mask

    @property
    def seq_lens(self) -> list[int]:
        """Packed length (prompt + valid response tokens) of each sequence."""
        resp = self.attention_mask.sum(-1).tolist()
        return [p.numel() + int(r) for p, r in zip(self.rollout.prompts, resp, strict=True)]

    def rows(self) -> torch.Tensor:
        """``[B]`` the index of every sequence, on the batch's device."""
        return torch.arange(len(self.records), device=self.attention_mask.device)


def group_index(num_rows: int, n: int, device: torch.device) -> torch.Tensor:
    """``[B]`` the group (prompt) of each row: rows ``[g*n, (g+1)*n)`` answer prompt ``g``."""
    return torch.arange(num_rows, device=device) // n


def decode_responses(tokenizer: Any, rollout: Rollout) -> list[str]:
    """Response texts up to (not including) their EOS."""
    texts = []
    for tokens, mask in zip(rollout.responses.tolist(), rollout.attention_mask.tolist(), strict=True):
        texts.append(
            tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m], skip_special_tokens=True)
        )
    return texts
