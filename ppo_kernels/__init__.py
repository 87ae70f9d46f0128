"""Token log-probs, entropy and low-variance KL on packed sequences, with and without the LM head.

PPO needs every token's log-prob three times (rollout policy, reference, training policy). The naive
path builds [tokens, vocab] logits, an fp32 copy and an fp32 log-softmax (16k tokens x 152k vocab is
about 25 GB); `fused_linear_logprobs` never holds the whole logits.

    from ppo_kernels import fused_linear_logprobs, low_var_kl, next_token_labels
    labels = next_token_labels(input_ids, cu_seqlens)          # [T], -100 at each sequence's end
    logprobs, entropy = fused_linear_logprobs(hidden, lm_head.weight, labels, temperature=0.6)
    kl = low_var_kl(logprobs, ref_logprobs)

For on-policy distillation, `fused_linear_topk` (the teacher's top-k log-probs and ids) and
`fused_linear_gather_logprobs` (the student's differentiable log-probs at those ids, and its own top-k)
work the same way, in chunked PyTorch on every backend (`ppo_kernels/topk.py`).

Both fast paths run one chunked algorithm (`ppo_kernels/chunked.py`: chunk loops, autograd, peak-memory
accounting) over per-chunk primitives in Triton (`ppo_kernels/triton_ops.py`) or PyTorch
(`ppo_kernels/torch_ops.py`, which also holds the naive `*_reference` of each op); `backend` picks one
("auto" = Triton on CUDA, else torch; see `ppo_kernels/dispatch.py`).

Tests: `.venv/bin/python -m pytest tests/unit/test_kernels.py` (Triton under TRITON_INTERPRET=1 on CPU). Benchmark: `.venv/bin/python -m ppo_bench.kernels`. Compile check of the
Triton kernels for a GPU without one: `.venv/bin/python -m ppo_kernels.aot_check`. On a GPU machine:
`bash scripts/gpu_check.sh`.
"""

from ppo_kernels.chunked import IGNORE_INDEX, fused_memory_plan
from ppo_kernels.dispatch import (
    BACKENDS,
    fused_linear_gather_logprobs,
    fused_linear_logprobs,
    fused_linear_topk,
    logprobs_from_logits,
    low_var_kl,
    resolve_backend,
)
from ppo_kernels.torch_ops import (
    fused_linear_gather_logprobs_reference,
    fused_linear_logprobs_reference,
    fused_linear_topk_reference,
    logprobs_from_logits_reference,
    low_var_kl_reference,
    next_token_labels,
)

__all__ = [
    "BACKENDS",
    "IGNORE_INDEX",
    "fused_linear_gather_logprobs",
    "fused_linear_gather_logprobs_reference",
    "fused_linear_logprobs",
    "fused_linear_logprobs_reference",
    "fused_linear_topk",
    "fused_linear_topk_reference",
    "fused_memory_plan",
    "logprobs_from_logits",
    "logprobs_from_logits_reference",
    "low_var_kl",
    "low_var_kl_reference",
    "next_token_labels",
    "resolve_backend",
]
