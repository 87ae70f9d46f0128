"""Tests of ppo_kernels/: each op's chunked-torch and Triton paths against the float64 reference.

On CPU the Triton kernels run under the interpreter: TRITON_INTERPRET=1 is set below, before `kernels`
imports its Triton module (the `@triton.jit` decorators read it). On CUDA the real compiler runs, and
bf16 joins fp32/fp16 (the interpreter gets bf16 wrong). Shapes are small and tiles large, since the
interpreter spends ~10 ms per program.

Tolerances are written as multiples of the unit roundoff of the stage that rounds (the logits or the
gradients in the input dtype, fp32 arithmetic otherwise), times the magnitude involved; the multiples
were set at 4-10x the worst error seen on CPU. Both fused paths compute the logits with a GEMM in the
input dtype (like the naive LM head), so both are held to the input dtype's roundoff of the logits.

Run: .venv/bin/python -m pytest tests/unit/test_kernels.py  (about 20-30 s on 2 CPU cores).
"""

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ppo_kernels  # noqa: E402
from ppo_kernels import torch_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO = Path(__file__).resolve().parents[2]

FAST_BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# Odd sizes: V is not a multiple of any block width used below.
T, H, V = 37, 48, 1000
IGNORED_ROWS = slice(16, 32)  # a whole token chunk (and BLOCK_T=16 tile) of ignored tokens
# Fused op: 37 tokens = 16 + 16 + 5 per forward chunk, 1000 vocabulary rows = 384 + 384 + 232 per
# backward chunk; neither divides evenly.
TOKEN_CHUNK, VOCAB_CHUNK = 16, 384

EPS32 = torch.finfo(torch.float32).eps
FWD_TOL = 8.0  # x eps x (1 + max|z|): log-probs and entropy
GRAD_TOL = 4.0  # x (eps(dtype) + eps32 (1 + max|z|)) x max|reference grad|


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _labels(num_tokens: int, vocab_size: int, seed: int = 1) -> torch.Tensor:
    """Random labels with the edge cases: V-1, 0, a block of ignored tokens, an ignored last token."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    labels[3], labels[4] = vocab_size - 1, 0
    labels[IGNORED_ROWS] = -100
    labels[-1] = -100
    return labels.to(DEVICE)


def _logits(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[T, V] logits: "randn" (scale 3), "peaked" (x50: near-one-hot softmax), "negative" (all < -20)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V, generator=gen, dtype=torch.float64)
    z = {"randn": 3 * z, "peaked": 50 * z, "negative": -20 - 4 * z.abs()}[kind]
    return z.to(dtype).to(DEVICE)


def _output_grads(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, generator=gen).to(DEVICE), torch.randn(T, generator=gen).to(DEVICE)


def _logits_op(backend: str, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple:
    """logprobs_from_logits on one backend, with small chunks (torch) or blocks (Triton)."""
    if backend == "triton":
        from ppo_kernels import triton_ops

        # 256-wide blocks: 1000 = 3 x 256 + 232, so the online log-sum-exp runs several, partly
        # masked iterations per row.
        return ppo_kernels.logprobs_from_logits(
            logits, labels, backend=triton_ops.primitives(block_v=256), **kwargs
        )
    return ppo_kernels.logprobs_from_logits(logits, labels, backend=backend, chunk_size=8, **kwargs)


def _linear_op(
    backend: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kwargs
) -> tuple:
    """fused_linear_logprobs on one backend, with chunks that do not divide T or V."""
    kwargs = {"chunk_size": TOKEN_CHUNK, "vocab_chunk_size": VOCAB_CHUNK, **kwargs}
    if backend == "reference":
        kwargs = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "vocab_chunk_size")}
    return ppo_kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend, **kwargs)


def _forward_backward(
    op: Callable, hidden: torch.Tensor, weight: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor
) -> list[torch.Tensor]:
    """``op(h, w)`` on fresh leaf copies of ``hidden`` and ``weight``, then the backward of
    ``sum(g_lp * logprobs + g_ent * entropy)``: ``[logprobs, entropy, grad hidden, grad weight]``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = op(h, w)
    (g_lp * lp + g_ent * ent).sum().backward()
    return [lp, ent, h.grad, w.grad]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"{what}: max error {err:.3g} > tolerance {atol:.3g}"


def _check_properties(logprobs: torch.Tensor, entropy: torch.Tensor, labels: torch.Tensor) -> None:
    """logp <= 0 and 0 <= entropy <= log V hold exactly in the kernels' formulation; ignored rows are 0."""
    ignored = labels == -100
    assert (logprobs <= 0).all()
    assert (entropy >= 0).all() and (entropy <= math.log(V) + 1e-5).all()
    assert (logprobs[ignored] == 0).all() and (entropy[ignored] == 0).all()


# ---------------------------------------------------------------------------------------------------
# Labels, backend names.
# ---------------------------------------------------------------------------------------------------


def test_next_token_labels_stays_inside_each_sequence() -> None:
    # Sequences [10 11 12] [20] [] [30 31] [40 41 42 43], then two padding positions.
    input_ids = torch.tensor([10, 11, 12, 20, 30, 31, 40, 41, 42, 43, 0, 0])
    cu_seqlens = torch.tensor([0, 3, 4, 4, 6, 10], dtype=torch.int32)
    labels = ppo_kernels.next_token_labels(input_ids, cu_seqlens)
    # Each sequence predicts its own next token; its last position (and the padding) predicts nothing.
    expected = [11, 12, -100, -100, 31, -100, 41, 42, 43, -100, -100, -100]
    assert labels.tolist() == expected
    assert labels.dtype == torch.long
    assert ppo_kernels.next_token_labels(
        input_ids[:1], cu_seqlens[:2].clamp(max=1), ignore_index=-1
    ).tolist() == [-1]


def test_backend_names() -> None:
    assert ppo_kernels.BACKENDS == ("auto", "triton", "torch", "reference")
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="auto, triton, torch, reference"):
        ppo_kernels.logprobs_from_logits(x, torch.zeros(4, dtype=torch.long), backend="cuda")
    with pytest.raises(ValueError, match="valid"):
        ppo_kernels.low_var_kl(x, x, backend="fast")
    assert ppo_kernels.resolve_backend("auto", x) == "torch"  # CPU
    assert ppo_kernels.resolve_backend("auto", x.double().to(DEVICE)) == "torch"  # fp64 has no Triton path
    if DEVICE.type == "cuda" and HAS_TRITON:
        assert ppo_kernels.resolve_backend("auto", x.to(DEVICE)) == "triton"


# ---------------------------------------------------------------------------------------------------
# Log-probs and entropy from logits.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("kind", ["randn", "peaked", "negative"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_logprobs_from_logits_matches_reference(
    backend: str, dtype: torch.dtype, kind: str, temperature: float
) -> None:
    logits, labels = _logits(kind, dtype), _labels(T, V)
    g_lp, g_ent = _output_grads()
    ref_logits = logits.double().requires_grad_()
    ref_lp, ref_ent = ppo_kernels.logprobs_from_logits_reference(ref_logits, labels, temperature=temperature)
    (g_lp * ref_lp + g_ent * ref_ent).sum().backward()

    x = logits.clone().requires_grad_()
    lp, ent = _logits_op(backend, x, labels, temperature=temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (T,)
    (g_lp * lp + g_ent * ent).sum().backward()

    z_max = ref_logits.detach().abs().max().item() / temperature
    # The inputs are already in `dtype`, so only fp32 arithmetic rounds in the forward.
    atol = FWD_TOL * EPS32 * (1 + z_max)
    _assert_close(lp, ref_lp, atol, "logprobs")
    _assert_close(ent, ref_ent, atol, "entropy")
    _check_properties(lp, ent, labels)
    # d logits is stored in the input dtype.
    ref_grad = ref_logits.grad
    grad_atol = GRAD_TOL * (_eps(dtype) + EPS32 * (1 + z_max)) * ref_grad.abs().max().item()
    _assert_close(x.grad, ref_grad, grad_atol, "grad logits")
    assert x.grad.dtype == dtype
    assert (x.grad[labels == -100] == 0).all()
    torch.testing.assert_close(x.detach(), logits, rtol=0, atol=0)  # backward did not write over logits


# ---------------------------------------------------------------------------------------------------
# Fused with the LM head.
# ---------------------------------------------------------------------------------------------------


def _linear_inputs(kind: str, dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], weight [V, H] with logits of scale ~3 ("randn") or ~150 ("peaked", x50)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * (3 / math.sqrt(H))
    if kind == "peaked":
        weight = weight * 50
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("kind", ["randn", "peaked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fused_linear_logprobs_matches_reference(
    backend: str, dtype: torch.dtype, kind: str, temperature: float
) -> None:
    hidden, weight = _linear_inputs(kind, dtype)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = ppo_kernels.fused_linear_logprobs_reference(
        ref_h, ref_w, labels, temperature=temperature
    )
    (g_lp * ref_lp + g_ent * ref_ent).sum().backward()

    op = partial(_linear_op, backend, labels=labels, temperature=temperature)
    lp, ent, h_grad, w_grad = _forward_backward(op, hidden, weight, g_lp, g_ent)

    z_max = (ref_h @ ref_w.T).abs().max().item() / temperature
    # Both paths round the logits to the input dtype (a GEMM in that dtype, like the naive LM head).
    logits_eps = _eps(dtype)
    atol = FWD_TOL * logits_eps * (1 + z_max)
    _assert_close(lp, ref_lp, atol, "logprobs")
    _assert_close(ent, ref_ent, atol, "entropy")
    _check_properties(lp, ent, labels)
    for name, grad, ref_grad in (("hidden", h_grad, ref_h.grad), ("weight", w_grad, ref_w.grad)):
        grad_atol = GRAD_TOL * (_eps(dtype) + logits_eps * (1 + z_max)) * ref_grad.abs().max().item()
        _assert_close(grad, ref_grad, grad_atol, f"grad {name}")
        assert grad.dtype == dtype
    assert (h_grad[labels == -100] == 0).all()


@pytest.mark.parametrize("backend", ["auto", *FAST_BACKENDS])
def test_public_api_default_tiles_prime_vocab(backend: str) -> None:
    """The dispatcher with default tiles, splits and chunks, on a prime V (997) and int32 labels."""
    vocab_size = 997
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab_size, H, generator=gen) / math.sqrt(H)).to(DEVICE)
    labels = _labels(T, vocab_size).int()
    ref_h = hidden.double().requires_grad_()
    ref_lp, ref_ent = ppo_kernels.fused_linear_logprobs_reference(
        ref_h, weight.double(), labels, temperature=0.6
    )
    (ref_lp + ref_ent).sum().backward()
    h = hidden.clone().requires_grad_()
    lp, ent = ppo_kernels.fused_linear_logprobs(h, weight, labels, temperature=0.6, backend=backend)
    (lp + ent).sum().backward()
    _assert_close(lp, ref_lp, 1e-5, "logprobs")
    _assert_close(ent, ref_ent, 1e-5, "entropy")
    _assert_close(h.grad, ref_h.grad, 1e-5 * ref_h.grad.abs().max().item(), "grad hidden")
    logits = (hidden @ weight.T).requires_grad_()
    lp, ent = ppo_kernels.logprobs_from_logits(logits, labels, temperature=0.6, backend=backend)
    _assert_close(lp, ref_lp, 1e-5, "logprobs from logits")
    _assert_close(ent, ref_ent, 1e-5, "entropy from logits")


# ---------------------------------------------------------------------------------------------------
# Low-variance KL.
# ---------------------------------------------------------------------------------------------------


def test_low_var_kl_reference_by_hand() -> None:
    logprobs = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.tensor([0.0, 1.0, -1.0, 3.0, 25.0, -25.0], dtype=torch.float64)
    kl = ppo_kernels.low_var_kl_reference(logprobs, ref_logprobs)
    # x = ref - logp: e^0 - 0 - 1 = 0; e - 2; 1/e; e^3 - 4 = 16.1 -> 10 (value clamp);
    # x = 25 -> 20 (log-ratio clamp) -> e^20 - 21 -> 10; x = -25 -> -20 -> e^-20 + 19 -> 10.
    expected = [0.0, math.e - 2, 1 / math.e, 10.0, 10.0, 10.0]
    torch.testing.assert_close(kl, torch.tensor(expected, dtype=torch.float64))
    kl.sum().backward()
    # d kl / d logp = -(e^x - 1) = 0, 1 - e, 1 - 1/e; 0 where a clamp is active.
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([0.0, 1 - math.e, 1 - 1 / math.e, 0.0, 0.0, 0.0]).double()
    )


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_low_var_kl_matches_reference(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    # Log-ratios across both clamps (|x| > 20 and kl > 10 from x > ~2.53 or x < -11).
    n = 3000
    logprobs = (-5 * torch.rand(n, generator=gen)).to(DEVICE)
    ref_logprobs = logprobs + torch.linspace(-30, 30, n).to(DEVICE)
    g = torch.randn(n, generator=gen).to(DEVICE)
    ref_lp, ref_ref = logprobs.double().requires_grad_(), ref_logprobs.double().requires_grad_()
    ref_kl = ppo_kernels.low_var_kl_reference(ref_lp, ref_ref)
    (g * ref_kl).sum().backward()
    lp, rf = logprobs.clone().requires_grad_(), ref_logprobs.clone().requires_grad_()
    kl = ppo_kernels.low_var_kl(lp, rf, backend=backend)
    (g * kl).sum().backward()
    assert kl.dtype == torch.float32
    # fp32 inputs: x itself is rounded (eps32 * |ref|), e^x amplifies that by e^x <= 11 where unclamped.
    # fp32: x = ref - logp rounds by eps32 |x| <= 30 eps32, which e^x - 1 (<= 11.6 where no clamp is
    # active) carries into kl and its gradient (|g| <= ~4), plus the rounding of e^x - x - 1 itself.
    _assert_close(kl, ref_kl, 1e-5, "kl")
    _assert_close(lp.grad, ref_lp.grad, 4e-5, "grad logprobs")
    _assert_close(rf.grad, ref_ref.grad, 4e-5, "grad ref_logprobs")
    assert (lp.grad[ref_kl.detach() >= 10] == 0).all()  # value clamp active: no gradient
    assert (kl >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["auto", "reference", *FAST_BACKENDS])
def test_low_var_kl_equals_kl_penalty(backend: str, dtype: torch.dtype) -> None:
    """ppo_kernels.low_var_kl is ppo.algorithms.kl_penalty(..., "low_var_kl"): value and both gradients."""
    from ppo.algorithms import kl_penalty

    if backend == "triton" and dtype == torch.float64:
        pytest.skip("Triton takes fp16/bf16/fp32")
    gen = torch.Generator().manual_seed(7)
    # x = ref - logp across both clamps: |x| > 20 (log-ratio clamp), e^x - x - 1 > 10 (value clamp, for
    # x > ~2.53 and x < ~-11.0), live in between, and x = +-20 exactly (logp = 0).
    x = torch.cat([torch.linspace(-30, 30, 241), torch.tensor([-20.0, 20.0, 2.5, 2.6, -10.9, -11.1])])
    logprobs = -5 * torch.rand(x.numel(), generator=gen)
    logprobs[241:243] = 0.0
    ref_logprobs = logprobs + x
    g = torch.randn(x.numel(), generator=gen)
    lp, rf = (t.to(dtype).to(DEVICE).requires_grad_() for t in (logprobs, ref_logprobs))
    kl = ppo_kernels.low_var_kl(lp, rf, backend=backend)
    (g.to(DEVICE, dtype) * kl).sum().backward()
    lp2, rf2 = (t.detach().clone().requires_grad_() for t in (lp, rf))
    expected = kl_penalty(lp2, rf2, "low_var_kl")
    (g.to(DEVICE, dtype) * expected).sum().backward()

    assert kl.dtype == dtype
    if backend == "triton":
        # tl.exp vs torch.exp: a few ulps of e^x <= e^20 before the clamp, <= ~12.6 after it.
        _assert_close(kl, expected, 16 * EPS32 * 12.6, "kl")
    else:
        assert torch.equal(kl.detach(), expected.detach())  # the same operations in the same order
    clamped = expected.detach().abs() >= 10
    assert clamped.any() and (~clamped).any()
    for name, grad, ref_grad in (("logprobs", lp.grad, lp2.grad), ("ref_logprobs", rf.grad, rf2.grad)):
        # Where a clamp is active both give exactly 0; elsewhere g (e^x - 1) against autograd's
        # g e^x - g: a few roundings of |g| e^x <= 4 x 12.6.
        assert (grad[clamped] == 0).all() and (ref_grad[clamped] == 0).all(), name
        _assert_close(grad, ref_grad, 16 * _eps(dtype) * 4 * 12.6, f"grad {name}")
        assert grad.dtype == dtype


# ---------------------------------------------------------------------------------------------------
# Gradient paths, no-grad, determinism, chunking.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use", ["logprobs", "entropy"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_gradient_through_one_output(backend: str, use: str) -> None:
    """Only one output in the loss: the other's gradient is None inside backward (entropy bonus alone)."""
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    index = 0 if use == "logprobs" else 1
    ref_h = hidden.double().requires_grad_()
    ppo_kernels.fused_linear_logprobs_reference(ref_h, weight.double(), labels)[index].sum().backward()
    h = hidden.clone().requires_grad_()
    _linear_op(backend, h, weight, labels)[index].sum().backward()
    _assert_close(h.grad, ref_h.grad, 1e-5 * ref_h.grad.abs().max().item(), f"grad hidden via {use}")

    logits = _logits("randn", torch.float32)
    ref_x = logits.double().requires_grad_()
    ppo_kernels.logprobs_from_logits_reference(ref_x, labels)[index].sum().backward()
    x = logits.clone().requires_grad_()
    _logits_op(backend, x, labels)[index].sum().backward()
    _assert_close(x.grad, ref_x.grad, 1e-5 * ref_x.grad.abs().max().item(), f"grad logits via {use}")


def _count_saved(fn: Callable[[], object]) -> tuple[int, object]:
    """(number of tensors autograd saved while running fn, fn's result)."""
    count = 0

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return count, out


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_no_grad_saves_nothing(backend: str) -> None:
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    h = hidden.clone().requires_grad_()
    saved, (lp, _) = _count_saved(lambda: _linear_op(backend, h, weight, labels))
    assert saved > 0 and lp.grad_fn is not None  # the check can fail: with grad, something is saved
    with torch.no_grad():
        saved, (lp, ent) = _count_saved(lambda: _linear_op(backend, h, weight, labels))
    assert saved == 0 and lp.grad_fn is None and ent is not None
    saved, _ = _count_saved(lambda: _linear_op(backend, hidden, weight, labels))
    assert saved == 0  # no input requires grad

    x = _logits("randn", torch.float32).requires_grad_()
    with torch.no_grad():
        saved, (lp, ent) = _count_saved(lambda: _logits_op(backend, x, labels, compute_entropy=False))
    assert saved == 0 and lp.grad_fn is None and ent is None


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_compute_entropy_false(backend: str) -> None:
    """No entropy: the same log-probs, and gradients (from logits; to the weight alone when hidden is
    frozen) against the reference."""
    logits, labels = _logits("randn", torch.float32), _labels(T, V)
    g_lp, _ = _output_grads()
    x = logits.clone().requires_grad_()
    lp, ent = _logits_op(backend, x, labels, compute_entropy=False)
    assert ent is None
    (g_lp * lp).sum().backward()
    lp_full, _ = _logits_op(backend, logits, labels)
    torch.testing.assert_close(lp.detach(), lp_full, rtol=0, atol=0)
    ref_x = logits.double().requires_grad_()
    ref_lp, _ = ppo_kernels.logprobs_from_logits_reference(ref_x, labels, compute_entropy=False)
    (g_lp * ref_lp).sum().backward()
    _assert_close(x.grad, ref_x.grad, 1e-5 * ref_x.grad.abs().max().item(), "grad logits")

    hidden, weight = _linear_inputs("randn", torch.float32)
    w = weight.clone().requires_grad_()
    lp, ent = _linear_op(backend, hidden, w, labels, compute_entropy=False, temperature=0.6)
    assert ent is None
    (g_lp * lp).sum().backward()
    ref_w = weight.double().requires_grad_()
    ref_lp, _ = ppo_kernels.fused_linear_logprobs_reference(
        hidden.double(), ref_w, labels, compute_entropy=False, temperature=0.6
    )
    (g_lp * ref_lp).sum().backward()
    _assert_close(lp, ref_lp, 1e-5, "logprobs")
    _assert_close(w.grad, ref_w.grad, 1e-5 * ref_w.grad.abs().max().item(), "grad weight")


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_two_runs_are_bitwise_equal(backend: str) -> None:
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    op = partial(_linear_op, backend, labels=labels, temperature=0.6)
    results = [_forward_backward(op, hidden, weight, g_lp, g_ent) for _ in range(2)]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_chunk_sizes_do_not_change_results(backend: str) -> None:
    """Token chunks of the forward and vocabulary chunks of the backward: from 1 row to everything."""
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    outs = []
    for chunk_size, vocab_chunk_size in ((1, 1000), (5, 97), (16, 129), (37, 384), (1000, 5000)):
        chunks = dict(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, backend=backend)
        op = partial(ppo_kernels.fused_linear_logprobs, labels=labels, **chunks)
        outs.append(_forward_backward(op, hidden, weight, g_lp, g_ent))
        if backend == "torch":
            x = (hidden @ weight.T).requires_grad_()
            lp2, ent2 = ppo_kernels.logprobs_from_logits(x, labels, chunk_size=chunk_size, backend="torch")
            (g_lp * lp2 + g_ent * ent2).sum().backward()
            outs[-1] += [lp2, ent2, x.grad]
    for out in outs[1:]:
        for a, b in zip(out, outs[0], strict=True):
            # Only the BLAS blocking of each chunk's matmul changes: fp32 rounding of sums, relative to
            # the largest entry.
            _assert_close(a, b, 1e-5 * b.abs().max().item(), "chunked vs other chunks")


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_forward_without_grad_equals_forward_with_grad(backend: str) -> None:
    """PPO's old log-probs (no grad) and the update's log-probs (grad) agree bitwise on the same inputs,
    and equal the from-logits op on the same logits (a single GEMM instead of token chunks)."""
    hidden, weight = _linear_inputs("randn", torch.float16)
    labels = _labels(T, V)
    with torch.no_grad():
        lp_old, ent_old = _linear_op(backend, hidden, weight, labels, temperature=0.6)
    lp, ent = _linear_op(backend, hidden.clone().requires_grad_(), weight, labels, temperature=0.6)
    assert torch.equal(lp.detach(), lp_old) and torch.equal(ent.detach(), ent_old)
    lp_logits, ent_logits = ppo_kernels.logprobs_from_logits(
        hidden @ weight.T, labels, temperature=0.6, backend=backend
    )
    # Per-chunk and whole GEMMs may round a logit differently by one fp16 ulp (<= eps |logit|), which
    # moves logp and entropy by at most twice that over the temperature.
    atol = 4 * _eps(torch.float16) * (hidden.double() @ weight.double().T).abs().max().item() / 0.6
    _assert_close(lp_old, lp_logits, atol, "fused vs from logits")
    _assert_close(ent_old, ent_logits, atol, "fused vs from logits")


def test_torch_backward_passes_gradcheck() -> None:
    """The hand-written backward of each chunked-torch op against finite differences, in float64."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.tensor([2, -100, 6, 0, 3])
    logits = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: ppo_kernels.logprobs_from_logits(x, labels, temperature=0.6, chunk_size=2, backend="torch"),
        (logits,),
    )
    assert torch.autograd.gradcheck(
        lambda h, w: ppo_kernels.fused_linear_logprobs(
            h, w, labels, temperature=0.6, chunk_size=2, vocab_chunk_size=3, backend="torch"
        ),
        (hidden, weight),
    )
    logprobs = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = (logprobs + torch.linspace(-4, 4, 9, dtype=torch.float64)).detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: ppo_kernels.low_var_kl(a, b, backend="torch"), (logprobs, ref)
    )


# ---------------------------------------------------------------------------------------------------
# Peak memory: the accounting, and the torch path measured against it.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_memory_plan_at_target_shape() -> None:
    """Triton path, bf16, T=16384, H=4096, V=152064, 256 MiB budget: the accounting of fused_memory_plan."""
    from ppo_kernels import triton_ops

    mib, gib = 2**20, 2**30
    plan = ppo_kernels.fused_memory_plan(
        triton_ops.primitives(), 16384, 4096, 152064, torch.bfloat16, 256 * mib
    )
    # Backward chunk: 256 MiB / (16384 tokens x 2 B) = 8192 vocab rows (a multiple of 128).
    # Forward chunk: 256 MiB / (152064 x 2 B) = 882 tokens, rounded down to 768.
    assert (plan.vocab_chunk, plan.token_chunk) == (8192, 768)
    assert plan.backward == {
        "grad_weight": 152064 * 4096 * 2,  # 1,245,708,288 B, bf16, written once per vocab chunk
        "grad_hidden_acc": 16384 * 4096 * 4,  # 256 MiB, fp32
        "vocab_chunk": 16384 * 8192 * 2,  # 256 MiB, logits then d logits in place
        "per_token": 16384 * 128,  # 2 MiB
    }
    assert plan.forward["token_chunk"] == 768 * 152064 * 2
    assert plan.peak_bytes == sum(plan.backward.values()) == 1_784_676_352  # 1.662 GiB
    assert plan.peak_bytes <= 1.7 * gib
    # Without the fp32 grad_weight accumulator of the token-chunked design (2.3 GiB) and its copy.
    assert "grad_weight_acc" not in plan.backward
    # T=4096: a 32768-row chunk, 1.473 GiB; H=896: 0.560 GiB.
    plan_4k = ppo_kernels.fused_memory_plan(
        triton_ops.primitives(), 4096, 4096, 152064, torch.bfloat16, 256 * mib
    )
    assert plan_4k.vocab_chunk == 32768 and abs(plan_4k.peak_bytes / gib - 1.473) < 1e-3
    plan_896 = ppo_kernels.fused_memory_plan(
        triton_ops.primitives(), 16384, 896, 152064, torch.bfloat16, 256 * mib
    )
    assert abs(plan_896.peak_bytes / gib - 0.560) < 1e-3


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_memory_plan_keeps_chunks_within_budget(backend: str) -> None:
    """Whatever T, the [T, chunk] and [chunk, V] temporaries fit the budget."""
    if backend == "torch":
        prims = torch_ops.TORCH
    else:
        from ppo_kernels import triton_ops

        prims = triton_ops.primitives()
    budget = 256 * 2**20
    for dtype in (torch.bfloat16, torch.float32):
        for num_tokens in (1, 100, 4096, 16384, 65536, 1 << 20):
            plan = ppo_kernels.fused_memory_plan(prims, num_tokens, 4096, 152064, dtype, budget)
            assert plan.backward["vocab_chunk"] <= budget and plan.forward["token_chunk"] <= budget
            # Multiples of 128 (whole GEMM tiles) unless the budget allows fewer rows or all of V.
            assert plan.vocab_chunk % 128 == 0 or plan.vocab_chunk in (152064, *range(1, 128))
            # The rest of the peak: the gradients (grad_hidden in fp32, then cast), [T] vectors.
            gradients = 152064 * 4096 * dtype.itemsize + num_tokens * 4096 * (4 + dtype.itemsize % 4)
            assert plan.peak_bytes <= gradients + 128 * num_tokens + budget


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fused_memory_measured_within_plan(dtype: torch.dtype) -> None:
    """The torch path's extra peak memory, fwd+bwd, measured like the benchmark (its CPU storage tracker), stays
    within fused_memory_plan and far below the naive path's."""
    from ppo_bench import kernels as bench

    num_tokens, hidden_size, vocab_size = 512, 64, 4096
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) / 8).to(dtype)
    labels = _labels(num_tokens, vocab_size).cpu()
    # A 2 MiB budget: 42 tokens per forward chunk, 256 vocab rows per backward chunk (fp32).
    plan = ppo_kernels.fused_memory_plan(
        torch_ops.TORCH, num_tokens, hidden_size, vocab_size, dtype, 2 * 2**20
    )
    assert 1 < plan.vocab_chunk < vocab_size and 1 < plan.token_chunk < num_tokens
    measured = {}
    for path in ("fused", "naive"):
        run = bench.make_run(
            path, "fwd+bwd", hidden, weight, labels, "torch", plan.token_chunk, plan.vocab_chunk
        )
        run()
        measured[path] = bench.cpu_peak_bytes(run)
    assert measured["fused"] <= plan.peak_bytes, (measured, plan)
    assert measured["fused"] < measured["naive"] / 8, measured


# ---------------------------------------------------------------------------------------------------
# Import without triton, Triton on CPU without the interpreter.
# ---------------------------------------------------------------------------------------------------


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, ppo_kernels\n"
        "lp, _ = ppo_kernels.logprobs_from_logits(torch.zeros(2, 5), torch.tensor([1, -100]))\n"
        "assert lp.tolist()[1] == 0.0\n"
        "try:\n"
        "    ppo_kernels.logprobs_from_logits(torch.zeros(2, 5), torch.tensor([1, 1]), backend='triton')\n"
        "except RuntimeError as exc:\n"
        "    print('RuntimeError:', exc)\n"
    )
    result = _run_python(code, dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    assert "RuntimeError: backend='triton' needs the triton package" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_on_cpu_without_interpreter_is_a_clear_error() -> None:
    code = (
        "import torch, ppo_kernels\n"
        "try:\n"
        "    ppo_kernels.low_var_kl(torch.zeros(3), torch.zeros(3), backend='triton')\n"
        "except RuntimeError as exc:\n"
        "    print('RuntimeError:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run_python(code, dict(env, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    assert "RuntimeError: Triton kernels on CPU need the interpreter: set TRITON_INTERPRET=1" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_kernels_compile_for_sm90() -> None:
    """The real Triton compiler (not the interpreter) accepts every kernel: ptxas to a cubin, no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "ppo_kernels.aot_check", "--arch", "90"],
        cwd=REPO,
        env=dict(env, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    from ppo_kernels import aot_check

    assert result.stdout.count("ok ") == len(aot_check.specializations())


# ---------------------------------------------------------------------------------------------------
# The benchmark script (scripts/ppo_bench/kernels.py) at a small shape.
# ---------------------------------------------------------------------------------------------------


def test_bench_kernels_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """One JSON object per shape x path x mode with `ms` and `extra_gib`; liger is skipped where it
    cannot run (here: no CUDA or no liger_kernel)."""
    import json

    from ppo_bench import kernels as bench

    argv = [
        "--device",
        "cpu",
        "--shapes",
        "64x16x512",
        "--repeat",
        "1",
        "--json",
        "--paths",
        "naive",
        "fused",
    ]
    assert bench.main([*argv, "liger"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    assert [(r["path"], r["mode"]) for r in rows] == [
        ("naive", "fwd"),
        ("fused", "fwd"),
        ("naive", "fwd+bwd"),
        ("fused", "fwd+bwd"),
    ]
    for row in rows:
        assert (row["T"], row["H"], row["V"], row["dtype"]) == (64, 16, 512, "float32")
        assert row["ms"] > 0 and 0 < row["extra_gib"] < 1
    fused = rows[3]
    assert fused["extra_gib"] < rows[2]["extra_gib"] and fused["mem_vs_naive"] < 1
    if bench.liger_unavailable(torch.device("cpu")):
        assert "skipping --paths liger" in captured.err
