"""Per-token KL estimates between the policy's and the reference's log-probs, for the KL in the reward
(step 3) and the KL loss (step 4): ``algorithms.kl_penalty``, with k3 on the ``ppo_kernels`` op.

    kl = kl_estimate(logprobs, ref_logprobs, "low_var_kl", backend="auto")   # [B, R]
"""

import torch

import ppo_kernels
from ppo import algorithms


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str, backend: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` (``algorithms.kl_penalty``) for the KL in the reward and the KL
    loss; k3 runs on the ``ppo_kernels`` low-variance KL op (Triton on GPU), which computes the same values
    and gradients."""
    if kind in ("low_var_kl", "k3"):
        return ppo_kernels.low_var_kl(logprobs, ref_logprobs, backend=backend)
    return algorithms.kl_penalty(logprobs, ref_logprobs, kind)
