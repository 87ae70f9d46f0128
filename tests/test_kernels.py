"""Tests of kernels/: each op's chunked-torch and Triton paths against the float64 reference.

On CPU the Triton kernels run under the interpreter: TRITON_INTERPRET=1 is set below, before `kernels`
imports its Triton module (the `@triton.jit` decorators read it). On CUDA the real compiler runs, and
bf16 joins fp32/fp16 (the interpreter gets bf16 wrong). Shapes are small and tiles large, since the
interpreter spends ~10 ms per program.

Tolerances are written as multiples of the unit roundoff of the stage that rounds (the logits or the
gradients in the input dtype, fp32 arithmetic otherwise), times the magnitude involved; the multiples
were set at 4-10x the worst error seen on CPU.

Run: .venv/bin/python -m pytest tests/test_kernels.py  (about 1 minute on 2 CPU cores).
"""

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from kernels import torch_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO = Path(__file__).resolve().parents[1]

FAST_BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# Odd sizes: V is not a multiple of any block width used below.
T, H, V = 37, 48, 1000
IGNORED_ROWS = slice(16, 32)  # a whole BLOCK_T=16 tile of ignored tokens in the fused kernel

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


def _triton_kwargs(op: str) -> dict:
    """Small tiles for the Triton paths so that every loop runs several, partly masked iterations."""
    from kernels import triton_ops

    if op == "logits":
        return {"block_v": 256}  # 1000 = 3 x 256 + 232
    # 3 token tiles (the middle one all ignored), 1000 = 7 x 128 + 104, H = 48 = 32 + 16, 3 vocab splits,
    # backward chunks of 32 tokens.
    return {
        "tile": triton_ops.TileConfig(block_t=16, block_v=128, block_h=32),
        "num_splits": 3,
        "chunk_size": 32,
    }


def _logits_op(backend: str, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple:
    """The op on one backend ("reference", "torch" or "triton"), with small chunks or tiles."""
    if backend == "triton":
        from kernels import triton_ops

        return triton_ops.logprobs_from_logits_triton(logits, labels, **_triton_kwargs("logits"), **kwargs)
    return kernels.logprobs_from_logits(logits, labels, backend=backend, chunk_size=8, **kwargs)


def _linear_op(
    backend: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kwargs
) -> tuple:
    """The fused op on one backend ("reference", "torch" or "triton"), with small chunks or tiles."""
    if backend == "triton":
        from kernels import triton_ops

        return triton_ops.fused_linear_logprobs_triton(
            hidden, weight, labels, **_triton_kwargs("linear"), **kwargs
        )
    return kernels.fused_linear_logprobs(hidden, weight, labels, backend=backend, chunk_size=8, **kwargs)


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
    labels = kernels.next_token_labels(input_ids, cu_seqlens)
    # Each sequence predicts its own next token; its last position (and the padding) predicts nothing.
    expected = [11, 12, -100, -100, 31, -100, 41, 42, 43, -100, -100, -100]
    assert labels.tolist() == expected
    assert labels.dtype == torch.long
    assert kernels.next_token_labels(
        input_ids[:1], cu_seqlens[:2].clamp(max=1), ignore_index=-1
    ).tolist() == [-1]


def test_backend_names() -> None:
    assert kernels.BACKENDS == ("auto", "triton", "torch", "reference")
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="auto, triton, torch, reference"):
        kernels.logprobs_from_logits(x, torch.zeros(4, dtype=torch.long), backend="cuda")
    with pytest.raises(ValueError, match="valid"):
        kernels.low_var_kl(x, x, backend="fast")
    assert kernels.resolve_backend("auto", x) == "torch"  # CPU
    assert kernels.resolve_backend("auto", x.double().to(DEVICE)) == "torch"  # fp64 has no Triton path
    if DEVICE.type == "cuda" and HAS_TRITON:
        assert kernels.resolve_backend("auto", x.to(DEVICE)) == "triton"


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
    ref_lp, ref_ent = kernels.logprobs_from_logits_reference(ref_logits, labels, temperature=temperature)
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
    ref_lp, ref_ent = kernels.fused_linear_logprobs_reference(ref_h, ref_w, labels, temperature=temperature)
    (g_lp * ref_lp + g_ent * ref_ent).sum().backward()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = _linear_op(backend, h, w, labels, temperature=temperature)
    (g_lp * lp + g_ent * ent).sum().backward()

    z_max = (ref_h @ ref_w.T).abs().max().item() / temperature
    # The torch path rounds the logits to the input dtype (like the naive LM head); the Triton tile
    # keeps them in its fp32 accumulator.
    logits_eps = _eps(dtype) if backend == "torch" else EPS32
    atol = FWD_TOL * logits_eps * (1 + z_max)
    _assert_close(lp, ref_lp, atol, "logprobs")
    _assert_close(ent, ref_ent, atol, "entropy")
    _check_properties(lp, ent, labels)
    for name, grad, ref_grad in (("hidden", h.grad, ref_h.grad), ("weight", w.grad, ref_w.grad)):
        grad_atol = GRAD_TOL * (_eps(dtype) + logits_eps * (1 + z_max)) * ref_grad.abs().max().item()
        _assert_close(grad, ref_grad, grad_atol, f"grad {name}")
        assert grad.dtype == dtype
    assert (h.grad[labels == -100] == 0).all()


@pytest.mark.parametrize("backend", ["auto", *FAST_BACKENDS])
def test_public_api_default_tiles_prime_vocab(backend: str) -> None:
    """The dispatcher with default tiles, splits and chunks, on a prime V (997) and int32 labels."""
    vocab_size = 997
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab_size, H, generator=gen) / math.sqrt(H)).to(DEVICE)
    labels = _labels(T, vocab_size).int()
    ref_h = hidden.double().requires_grad_()
    ref_lp, ref_ent = kernels.fused_linear_logprobs_reference(ref_h, weight.double(), labels, temperature=0.6)
    (ref_lp + ref_ent).sum().backward()
    h = hidden.clone().requires_grad_()
    lp, ent = kernels.fused_linear_logprobs(h, weight, labels, temperature=0.6, backend=backend)
    (lp + ent).sum().backward()
    _assert_close(lp, ref_lp, 1e-5, "logprobs")
    _assert_close(ent, ref_ent, 1e-5, "entropy")
    _assert_close(h.grad, ref_h.grad, 1e-5 * ref_h.grad.abs().max().item(), "grad hidden")
    logits = (hidden @ weight.T).requires_grad_()
    lp, ent = kernels.logprobs_from_logits(logits, labels, temperature=0.6, backend=backend)
    _assert_close(lp, ref_lp, 1e-5, "logprobs from logits")
    _assert_close(ent, ref_ent, 1e-5, "entropy from logits")


# ---------------------------------------------------------------------------------------------------
# Low-variance KL.
# ---------------------------------------------------------------------------------------------------


def test_low_var_kl_reference_by_hand() -> None:
    logprobs = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.tensor([0.0, 1.0, -1.0, 3.0, 25.0, -25.0], dtype=torch.float64)
    kl = kernels.low_var_kl_reference(logprobs, ref_logprobs)
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
    ref_kl = kernels.low_var_kl_reference(ref_lp, ref_ref)
    (g * ref_kl).sum().backward()
    lp, rf = logprobs.clone().requires_grad_(), ref_logprobs.clone().requires_grad_()
    kl = kernels.low_var_kl(lp, rf, backend=backend)
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
    kernels.fused_linear_logprobs_reference(ref_h, weight.double(), labels)[index].sum().backward()
    h = hidden.clone().requires_grad_()
    _linear_op(backend, h, weight, labels)[index].sum().backward()
    _assert_close(h.grad, ref_h.grad, 1e-5 * ref_h.grad.abs().max().item(), f"grad hidden via {use}")

    logits = _logits("randn", torch.float32)
    ref_x = logits.double().requires_grad_()
    kernels.logprobs_from_logits_reference(ref_x, labels)[index].sum().backward()
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
    logits, labels = _logits("randn", torch.float32), _labels(T, V)
    x = logits.clone().requires_grad_()
    lp, ent = _logits_op(backend, x, labels, compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    lp_full, _ = _logits_op(backend, logits, labels)
    torch.testing.assert_close(lp.detach(), lp_full, rtol=0, atol=0)
    hidden, weight = _linear_inputs("randn", torch.float32)
    h = hidden.clone().requires_grad_()
    lp, ent = _linear_op(backend, h, weight, labels, compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    assert torch.isfinite(h.grad).all()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_two_runs_are_bitwise_equal(backend: str) -> None:
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    results = []
    for _ in range(2):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = _linear_op(backend, h, w, labels, temperature=0.6)
        (g_lp * lp + g_ent * ent).sum().backward()
        results.append((lp, ent, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_chunk_size_does_not_change_torch_results() -> None:
    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    outs = []
    for chunk_size in (1, 5, 16, 37, 1000):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = kernels.fused_linear_logprobs(h, w, labels, chunk_size=chunk_size, backend="torch")
        (g_lp * lp + g_ent * ent).sum().backward()
        x = (hidden @ weight.T).requires_grad_()
        lp2, ent2 = kernels.logprobs_from_logits(x, labels, chunk_size=chunk_size, backend="torch")
        (g_lp * lp2 + g_ent * ent2).sum().backward()
        outs.append([lp, ent, h.grad, w.grad, lp2, ent2, x.grad])
    for out in outs[1:]:
        for a, b in zip(out, outs[0], strict=True):
            # Only the BLAS blocking of the chunk's matmul and the grad_weight sum order change:
            # fp32 rounding of sums, relative to the largest entry.
            _assert_close(a, b, 1e-5 * b.abs().max().item(), "chunked vs one chunk")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_chunk_size_and_splits_do_not_change_triton_results() -> None:
    from kernels import triton_ops

    hidden, weight = _linear_inputs("randn", torch.float32)
    labels = _labels(T, V)
    g_lp, g_ent = _output_grads()
    tile = triton_ops.TileConfig(block_t=16, block_v=128, block_h=32)
    outs = []
    for chunk_size, num_splits in ((16, 1), (48, 8)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = triton_ops.fused_linear_logprobs_triton(
            h, w, labels, chunk_size=chunk_size, tile=tile, num_splits=num_splits
        )
        (g_lp * lp + g_ent * ent).sum().backward()
        outs.append([lp, ent, h.grad, w.grad])
    for a, b in zip(*outs, strict=True):
        # Splits change the order the epilogue merges partials; chunks the grad_weight sum order.
        _assert_close(a, b, 1e-5 * b.abs().max().item(), "chunks/splits")


def test_torch_backward_passes_gradcheck() -> None:
    """The hand-written backward of each chunked-torch op against finite differences, in float64."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.tensor([2, -100, 6, 0, 3])
    logits = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: torch_ops.logprobs_from_logits_torch(x, labels, temperature=0.6, chunk_size=2), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda h, w: torch_ops.fused_linear_logprobs_torch(h, w, labels, temperature=0.6, chunk_size=2),
        (hidden, weight),
    )
    logprobs = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = (logprobs + torch.linspace(-4, 4, 9, dtype=torch.float64)).detach().requires_grad_()
    assert torch.autograd.gradcheck(torch_ops.low_var_kl_torch, (logprobs, ref))


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
        "import torch, kernels\n"
        "lp, _ = kernels.logprobs_from_logits(torch.zeros(2, 5), torch.tensor([1, -100]))\n"
        "assert lp.tolist()[1] == 0.0\n"
        "try:\n"
        "    kernels.logprobs_from_logits(torch.zeros(2, 5), torch.tensor([1, 1]), backend='triton')\n"
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
        "import torch, kernels\n"
        "try:\n"
        "    kernels.low_var_kl(torch.zeros(3), torch.zeros(3), backend='triton')\n"
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
        [sys.executable, "-m", "kernels.aot_check", "--arch", "90"],
        cwd=REPO,
        env=dict(env, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 16
