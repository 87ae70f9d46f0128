"""Tests of the top-k ops of ppo_kernels (ppo_kernels/topk.py): fused_linear_topk and
fused_linear_gather_logprobs, chunked against the naive full-tensor references.

Values and gradients are held to the fp64 reference on the same inputs, with tolerances in units of the
roundoff of the stage that rounds (the logits GEMM in the input dtype, fp32 arithmetic), times the
magnitude involved, set at 5-10x the worst error seen on CPU in fp32 and fp64 (bf16 stays further
inside the same bounds: its logits round relative to each |z|, not to max|z|). Ids are held to the reference run in the
same dtype (`torch.topk` of the fp32 z). Shapes are small: every test runs in well under a second.

Run: .venv/bin/python -m pytest -q tests/unit/test_topk_kernels.py
"""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels
from ppo_kernels import topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Odd sizes: no chunk below divides T or V.
T, H, V, K = 13, 24, 300, 7
# (chunk_size, vocab_chunk_size): one token per chunk, uneven chunks, chunks larger than T and V, the
# budget's default (one chunk of each at these sizes).
CHUNKS = [(1, 7), (4, 64), (100, 1000), (None, None)]

FWD_TOL = 8.0  # x eps(logits) x (1 + max|z|)
GRAD_TOL = 4.0  # x eps(dtype) x (2 + max|z|) x max|reference grad|


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], weight [V, H] with logits of scale ~3."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * (3 / math.sqrt(H))
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)


def _ids(seed: int = 1) -> torch.Tensor:
    """[T, K] ids with the edge cases: 0, V-1, an id repeated within a row, a row of zeros (an ignored
    token, as callers pass it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (T, K), generator=gen)
    ids[0, 0], ids[0, 1] = 0, V - 1
    ids[1, :3] = 17
    ids[2] = 0
    return ids.to(DEVICE)


def _z_max(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> float:
    return (hidden.double() @ weight.double().T).abs().max().item() / temperature


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"{what}: max error {err:.3g} > tolerance {atol:.3g}"


# ---------------------------------------------------------------------------------------------------
# By hand.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_by_hand_one_token_four_words(backend: str) -> None:
    # hidden = [1], weight rows [0], [1], [2], [3]: logits z = [0, 1, 2, 3].
    # S = 1 + e + e^2 + e^3 = 1 + 2.7182818 + 7.3890561 + 20.0855369 = 31.1928748, lse = log S = 3.4401897,
    # logp = z - lse = [-3.4401897, -2.4401897, -1.4401897, -0.4401897].
    hidden = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    weight = torch.arange(4, dtype=torch.float64)[:, None].requires_grad_()
    logprobs, ids = ppo_kernels.fused_linear_topk(hidden, weight, 2, backend=backend)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(logprobs, torch.tensor([[-0.4401897, -1.4401897]], dtype=torch.float64))
    assert not logprobs.requires_grad

    # Ids [1, 1, 3] (1 repeated): logp [-2.4401897, -2.4401897, -0.4401897]. With g = 1 on each,
    # d loss / d z = onehot counts [0, 2, 0, 1] - 3 p, p = e^z / S = [0.0320586, 0.0871443, 0.2368828,
    # 0.6439143]; d z / d hidden = weight = [0, 1, 2, 3], so grad hidden = (2 * 1 + 1 * 3) - 3 E[z]
    # with E[z] = sum p z = 0.0871443 + 0.4737656 + 1.9317429 = 2.4926528: 5 - 7.4779584 = -2.4779584.
    # grad weight[v] = (d loss / d z_v) * hidden = [-0.0961758, 1.7385671, -0.7106484, -0.9317429].
    logprobs, own = ppo_kernels.fused_linear_gather_logprobs(
        hidden, weight, torch.tensor([[1, 1, 3]]), return_topk=True, backend=backend
    )
    torch.testing.assert_close(
        logprobs, torch.tensor([[-2.4401897, -2.4401897, -0.4401897]], dtype=torch.float64)
    )
    assert own.tolist() == [[3, 2, 1]]
    logprobs.sum().backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[-2.4779584]], dtype=torch.float64))
    expected_w = torch.tensor([[-0.0961758], [1.7385671], [-0.7106484], [-0.9317429]], dtype=torch.float64)
    torch.testing.assert_close(weight.grad, expected_w)

    # Temperature 2: z = [0, 0.5, 1, 1.5]; lse = 1.5 + log(1 + e^-0.5 + e^-1 + e^-1.5)
    # = 1.5 + log(1 + 0.6065307 + 0.3678794 + 0.2231302) = 1.5 + 0.7873387 = 2.2873387.
    logprobs, ids = ppo_kernels.fused_linear_topk(hidden, weight, 1, temperature=2.0, backend=backend)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(logprobs, torch.tensor([[1.5 - 2.2873387]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# Against the references.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 100, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_matches_reference(dtype: torch.dtype, chunk_size: int | None, temperature: float) -> None:
    hidden, weight = _inputs(dtype)
    logprobs, ids = ppo_kernels.fused_linear_topk(
        hidden, weight, K, temperature=temperature, chunk_size=chunk_size, backend="torch"
    )
    assert logprobs.shape == ids.shape == (T, K)
    assert logprobs.dtype == dtype and ids.dtype == torch.long
    # Ids: the same as the reference's (torch.topk of the whole fp32 z), sorted by descending log-prob.
    ref_logprobs, ref_ids = ppo_kernels.fused_linear_topk_reference(
        hidden, weight, K, temperature=temperature
    )
    assert torch.equal(ids, ref_ids)
    assert (logprobs[:, :-1] >= logprobs[:, 1:]).all()
    # Values: against fp64.
    exact, _ = ppo_kernels.fused_linear_topk_reference(
        hidden.double(), weight.double(), K, temperature=temperature
    )
    atol = FWD_TOL * _eps(dtype) * (1 + _z_max(hidden, weight, temperature))
    _assert_close(logprobs, exact, atol, "top-k logprobs")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("chunk_size", "vocab_chunk_size"), CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gather_matches_reference(
    dtype: torch.dtype, chunk_size: int | None, vocab_chunk_size: int | None, temperature: float
) -> None:
    """Values, own top-K ids and the gradients of hidden and weight (autograd on the reference)."""
    hidden, weight = _inputs(dtype)
    ids = _ids()
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)

    # Fresh leaves (.double() of fp64 inputs is the input itself).
    ref_h, ref_w = hidden.double().clone().requires_grad_(), weight.double().clone().requires_grad_()
    ref_lp, _ = ppo_kernels.fused_linear_gather_logprobs_reference(ref_h, ref_w, ids, temperature=temperature)
    (g * ref_lp).sum().backward()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, own_ids = ppo_kernels.fused_linear_gather_logprobs(
        h,
        w,
        ids,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        return_topk=True,
        backend="torch",
    )
    assert logprobs.shape == own_ids.shape == (T, K) and own_ids.dtype == torch.long
    assert logprobs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not own_ids.requires_grad
    (g.to(logprobs.dtype) * logprobs).sum().backward()

    z_max = _z_max(hidden, weight, temperature)
    atol = FWD_TOL * _eps(dtype) * (1 + z_max)
    _assert_close(logprobs, ref_lp, atol, "logprobs at ids")
    # Repeated ids give equal log-probs; row 2 (all id 0) is one value.
    assert torch.equal(logprobs[1, 0], logprobs[1, 2]) and (logprobs[2] == logprobs[2, 0]).all()
    for name, grad, ref_grad in (("hidden", h.grad, ref_h.grad), ("weight", w.grad, ref_w.grad)):
        assert grad.dtype == dtype
        grad_atol = GRAD_TOL * _eps(dtype) * (2 + z_max) * ref_grad.abs().max().item()
        _assert_close(grad, ref_grad, grad_atol, f"grad {name}")
    if dtype != torch.bfloat16:  # bf16 logits tie often; its ids are checked by value below
        _, ref_own = ppo_kernels.fused_linear_gather_logprobs_reference(
            hidden, weight, ids, temperature=temperature, return_topk=True
        )
        assert torch.equal(own_ids, ref_own)
    # Own ids are a top-K of the exact log-probs up to the logits' roundoff.
    exact_all = torch.log_softmax((ref_h @ ref_w.T).detach() / temperature, dim=-1)
    _assert_close(exact_all.gather(-1, own_ids), exact_all.topk(K).values, 2 * atol, "own top-K values")


def test_gather_backward_passes_gradcheck() -> None:
    """The hand-derived backward against finite differences (fp64), chunked in tokens and vocabulary,
    with repeated ids and a temperature."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 10, 3], [3, 3, 3], [7, 1, 0], [2, 9, 9], [5, 6, 4]])

    def op(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logprobs, _ = ppo_kernels.fused_linear_gather_logprobs(
            h, w, ids, temperature=0.7, chunk_size=2, vocab_chunk_size=4, backend="torch"
        )
        return logprobs

    assert torch.autograd.gradcheck(op, (hidden, weight))


def test_gather_at_ids_equals_log_softmax_gather() -> None:
    """The op is log_softmax(logits).gather(ids) with its gradient, written out in plain torch."""
    hidden, weight = _inputs(torch.float64)
    ids = _ids()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs, own_ids = ppo_kernels.fused_linear_gather_logprobs(h1, w1, ids, chunk_size=4, backend="torch")
    assert own_ids is None
    logprobs.sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = torch.log_softmax(h2 @ w2.T, dim=-1).gather(-1, ids)
    expected.sum().backward()
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_ties_keep_torch_topk_order(chunk_size: int | None) -> None:
    """Integer hidden and weight make every GEMM exact (any blocking) and the logits tie often: the ids
    are exactly torch.topk's on the whole fp32 z, for both ops (on CPU torch.topk orders ties by row)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randint(-2, 3, (T, 3), generator=gen).float().to(DEVICE)
    weight = torch.randint(-2, 3, (V, 3), generator=gen).float().to(DEVICE)
    z = (hidden @ weight.T) / 0.5
    top = z.topk(K)
    assert (top.values[:, :-1] == top.values[:, 1:]).any()  # the case is there: ties within the top-K
    logprobs, ids = ppo_kernels.fused_linear_topk(
        hidden, weight, K, temperature=0.5, chunk_size=chunk_size, backend="torch"
    )
    _, own_ids = ppo_kernels.fused_linear_gather_logprobs(
        hidden, weight, ids, temperature=0.5, chunk_size=chunk_size, return_topk=True, backend="torch"
    )
    if DEVICE.type == "cpu":
        assert torch.equal(ids, top.indices) and torch.equal(own_ids, top.indices)
    # Whatever the order of ties, the log-probs are the same.
    torch.testing.assert_close(logprobs, torch.log_softmax(z, -1).gather(-1, top.indices))


# ---------------------------------------------------------------------------------------------------
# Backends, grad modes.
# ---------------------------------------------------------------------------------------------------


def test_every_fast_backend_runs_the_same_chunked_code() -> None:
    """ "auto", "torch" and "triton" run the chunked torch path (no Triton kernel): bitwise equal results."""
    hidden, weight = _inputs(torch.float32)
    ids = _ids()
    results = []
    for backend in ("auto", "torch", "triton"):
        h = hidden.clone().requires_grad_()
        lp, own = ppo_kernels.fused_linear_gather_logprobs(h, weight, ids, return_topk=True, backend=backend)
        lp.sum().backward()
        top = ppo_kernels.fused_linear_topk(hidden, weight, K, backend=backend)
        results.append([lp, own, h.grad, *top])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="valid"):
        ppo_kernels.fused_linear_topk(hidden, weight, K, backend="cuda")


def test_no_grad_matches_grad_and_saves_nothing() -> None:
    hidden, weight = _inputs(torch.float32)
    ids = _ids()
    h = hidden.clone().requires_grad_()
    with_grad, _ = ppo_kernels.fused_linear_gather_logprobs(h, weight, ids, chunk_size=4, backend="torch")
    assert with_grad.requires_grad
    with torch.no_grad():
        without, _ = ppo_kernels.fused_linear_gather_logprobs(h, weight, ids, chunk_size=4, backend="torch")
    assert not without.requires_grad and without.grad_fn is None
    assert torch.equal(with_grad.detach(), without)
    # The top-k op never records a graph, even on inputs that require grad.
    logprobs, _ = ppo_kernels.fused_linear_topk(h, weight, K, backend="torch")
    assert not logprobs.requires_grad and logprobs.grad_fn is None


def test_gradient_only_where_needed() -> None:
    """A frozen weight (the student's LM head may be tied and frozen) gets no gradient; hidden still does."""
    hidden, weight = _inputs(torch.float32)
    h = hidden.clone().requires_grad_()
    logprobs, _ = ppo_kernels.fused_linear_gather_logprobs(h, weight, _ids(), backend="torch")
    logprobs.sum().backward()
    assert h.grad is not None and weight.grad is None


# ---------------------------------------------------------------------------------------------------
# Memory: never a [T, V] tensor.
# ---------------------------------------------------------------------------------------------------


class _ShapeSpy(TorchDispatchMode):
    """Records the shape of every tensor each aten op returns, and the output shape of each matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.mm_shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul):
                    self.mm_shapes.append(tuple(t.shape))
        return out


def test_chunked_ops_never_build_tokens_by_vocab() -> None:
    """With T x V large against the chunks (T=4096, V=512; 64-token and 64-word chunks), no op returns a
    tensor of [T, V] size, and each logits GEMM has 64 rows (forward) or 64 columns (backward). The
    reference, which builds [T, V], trips the same spy."""
    num_tokens, hidden_size, vocab_size, chunk, k = 4096, 16, 512, 64, 4
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).requires_grad_()
    weight = torch.randn(vocab_size, hidden_size, generator=gen).requires_grad_()
    tokens_by_vocab = num_tokens * vocab_size
    # The largest tensors the chunked path needs: a [T, 64] chunk, [T, H] or [V, H] gradients.
    allowed = max(num_tokens * chunk, chunk * vocab_size, num_tokens * hidden_size, vocab_size * hidden_size)
    assert allowed <= tokens_by_vocab // 8

    with _ShapeSpy() as spy:
        _, ids = ppo_kernels.fused_linear_topk(hidden, weight, k, chunk_size=chunk, backend="torch")
    assert spy.largest <= allowed
    assert spy.mm_shapes == [(chunk, vocab_size)] * (num_tokens // chunk)

    with _ShapeSpy() as spy:
        logprobs, _ = ppo_kernels.fused_linear_gather_logprobs(
            hidden, weight, ids, chunk_size=chunk, vocab_chunk_size=chunk, return_topk=True, backend="torch"
        )
        logprobs.sum().backward()
    assert spy.largest <= allowed
    logits_gemms = [s for s in spy.mm_shapes if s in ((chunk, vocab_size), (num_tokens, chunk))]
    # Forward: 64 token chunks. Backward: per vocabulary chunk, its logits GEMM (the grad_hidden GEMM
    # is [T, H], grad_weight's writes [64, H]).
    assert logits_gemms.count((chunk, vocab_size)) == num_tokens // chunk
    assert logits_gemms.count((num_tokens, chunk)) == vocab_size // chunk
    assert hidden.grad is not None and weight.grad is not None

    with _ShapeSpy() as spy:
        ppo_kernels.fused_linear_topk(hidden, weight, k, backend="reference")
    assert spy.largest >= tokens_by_vocab  # the spy sees a [T, V] tensor where one is built


@pytest.mark.slow  # importing the benchmarks' tracker loads transformers (~4 s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_peak_within_memory_plan(dtype: torch.dtype) -> None:
    """Forward + backward's extra tensor storage, measured like the kernels benchmark (its CPU storage
    tracker), stays within `topk_memory_plan`, the docstring's formula, and far below the reference's."""
    from ppo_bench.common import cpu_peak_bytes

    num_tokens, hidden_size, vocab_size, num_ids, chunk, vocab_chunk = 256, 32, 2048, 4, 16, 128
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) / 8).to(dtype)
    ids = torch.randint(0, vocab_size, (num_tokens, num_ids), generator=gen)
    plan = topk.topk_memory_plan(
        num_tokens,
        hidden_size,
        vocab_size,
        num_ids,
        dtype,
        chunk_size=chunk,
        vocab_chunk_size=vocab_chunk,
    )
    assert (plan.token_chunk, plan.vocab_chunk) == (chunk, vocab_chunk)

    def run(backend: str) -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logprobs, _ = ppo_kernels.fused_linear_gather_logprobs(
            h, w, ids, chunk_size=chunk, vocab_chunk_size=vocab_chunk, return_topk=True, backend=backend
        )
        logprobs.sum().backward()

    measured = {backend: cpu_peak_bytes(lambda b=backend: run(b)) for backend in ("torch", "reference")}
    assert measured["torch"] <= plan.peak_bytes, (measured, plan)
    assert measured["torch"] < measured["reference"] / 4, measured


# ---------------------------------------------------------------------------------------------------
# Argument errors.
# ---------------------------------------------------------------------------------------------------


def _topk_call(**changes: object) -> None:
    hidden, weight = torch.zeros(3, 4), torch.zeros(5, 4)
    args = {"hidden": hidden, "weight": weight, "k": 2, "temperature": 1.0, "chunk_size": None, **changes}
    ppo_kernels.fused_linear_topk(
        args["hidden"],
        args["weight"],
        args["k"],
        temperature=args["temperature"],
        chunk_size=args["chunk_size"],
        backend="torch",
    )


def _gather_call(**changes: object) -> None:
    args = {
        "hidden": torch.zeros(3, 4),
        "weight": torch.zeros(5, 4),
        "ids": torch.zeros(3, 2, dtype=torch.long),
        "temperature": 1.0,
        "vocab_chunk_size": None,
        "return_topk": False,
        **changes,
    }
    ppo_kernels.fused_linear_gather_logprobs(
        args["hidden"],
        args["weight"],
        args["ids"],
        temperature=args["temperature"],
        vocab_chunk_size=args["vocab_chunk_size"],
        return_topk=args["return_topk"],
        backend="torch",
    )


@pytest.mark.parametrize(
    ("call", "changes", "match"),
    [
        (_topk_call, {"hidden": torch.zeros(3)}, r"hidden \[T, H\] and weight \[V, H\]"),
        (_topk_call, {"weight": torch.zeros(5, 3)}, r"hidden \[T, H\] and weight \[V, H\]"),
        (_topk_call, {"weight": torch.zeros(5, 4, dtype=torch.float64)}, "dtypes differ"),
        (_topk_call, {"k": 0}, r"k must be an int in \[1, V\] = \[1, 5\]"),
        (_topk_call, {"k": 6}, r"k must be an int in \[1, V\]"),
        (_topk_call, {"k": 2.0}, r"k must be an int"),
        (_topk_call, {"temperature": 0.0}, "temperature must be > 0"),
        (_topk_call, {"chunk_size": 0}, "chunk_size must be None or an int >= 1"),
        (
            _topk_call,
            {"hidden": torch.zeros(3, 4, dtype=torch.long), "weight": torch.zeros(5, 4, dtype=torch.long)},
            "floating point",
        ),
        (_gather_call, {"ids": torch.zeros(3, dtype=torch.long)}, r"ids \[T, K\] with T = 3"),
        (_gather_call, {"ids": torch.zeros(2, 2, dtype=torch.long)}, r"ids \[T, K\] with T = 3"),
        (_gather_call, {"ids": torch.zeros(3, 0, dtype=torch.long)}, "K >= 1"),
        (_gather_call, {"ids": torch.zeros(3, 2)}, "ids must be an integer tensor"),
        (_gather_call, {"ids": torch.zeros(3, 6, dtype=torch.long), "return_topk": True}, "K <= V"),
        (_gather_call, {"weight": torch.zeros(5, 4, dtype=torch.float16)}, "dtypes differ"),
        (_gather_call, {"temperature": -1.0}, "temperature must be > 0"),
        (_gather_call, {"vocab_chunk_size": -1}, "vocab_chunk_size must be None or an int >= 1"),
    ],
)
def test_argument_errors(call: Callable[..., None], changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(**changes)


def test_argument_errors_on_the_reference_too() -> None:
    with pytest.raises(ValueError, match=r"k must be an int in \[1, V\]"):
        ppo_kernels.fused_linear_topk(torch.zeros(3, 4), torch.zeros(5, 4), 9, backend="reference")
    with pytest.raises(ValueError, match="ids must be an integer tensor"):
        ppo_kernels.fused_linear_gather_logprobs(
            torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, 2), backend="reference"
        )
