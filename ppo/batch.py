"""The step's data: what sampling returns (``Rollout``) and one PPO step's sequences with everything
scored for them (``Batch``). Below every module that fills or reads them (rollout, offline, packing,
rewards, update, metrics), so none of those needs another to name its types.

Token tensors are ``[B, R]`` over response tokens (``R = data.max_response_length``), right-padded;
rows ``[g*n, (g+1)*n)`` are the ``n`` responses to prompt ``g`` (``group_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    response_mask: torch.Tensor
    """[B, R] bool: True on generated tokens up to and including the first EOS."""
    truncated: torch.Tensor
    """[B] bool: the response hit ``max_new_tokens`` without an EOS."""


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout of the sequences of ``parts`` in order. All parts share ``R``."""
    return Rollout(
        prompts=[p for part in parts for p in part.prompts],
        responses=torch.cat([part.responses for part in parts]),
        response_mask=torch.cat([part.response_mask for part in parts]),
        truncated=torch.cat([part.truncated for part in parts]),
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
    token_rewards: torch.Tensor | None = None
    """[B, R] the score on the last response token minus the in-reward KL penalty."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def response_mask(self) -> torch.Tensor:
        return self.rollout.response_mask

    @property
    def seq_lens(self) -> list[int]:
        """Packed length (prompt + valid response tokens) of each sequence."""
        resp = self.response_mask.sum(-1).tolist()
        return [p.numel() + int(r) for p, r in zip(self.rollout.prompts, resp, strict=True)]

    def rows(self) -> torch.Tensor:
        """``[B]`` the index of every sequence, on the batch's device."""
        return torch.arange(len(self.records), device=self.response_mask.device)


def group_index(num_rows: int, n: int, device: torch.device) -> torch.Tensor:
    """``[B]`` the group (prompt) of each row: rows ``[g*n, (g+1)*n)`` answer prompt ``g``."""
    return torch.arange(num_rows, device=device) // n


def decode_responses(tokenizer: Any, rollout: Rollout) -> list[str]:
    """Response texts up to (not including) their EOS."""
    texts = []
    for tokens, mask in zip(rollout.responses.tolist(), rollout.response_mask.tolist(), strict=True):
        texts.append(
            tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m], skip_special_tokens=True)
        )
    return texts
