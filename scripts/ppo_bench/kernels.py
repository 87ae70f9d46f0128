"""Benchmark the log-prob paths: time and peak extra memory, forward and forward+backward.

Every path starts from hidden [T, H] and the LM-head weight [V, H], so rows compare like for like:

- naive:       logits = hidden @ W^T, then a full fp32 log_softmax + gather + entropy (the references)
- from_logits: logits = hidden @ W^T, then `ppo_kernels.logprobs_from_logits` (fast backend)
- fused:       `ppo_kernels.fused_linear_logprobs` (fast backend): the [T, V] logits never exist
- liger:       Liger-Kernel's fused linear cross entropy (reduction="none", log-probs only, no entropy
               or temperature), only where `liger_kernel` imports and on CUDA; skipped otherwise

"fwd" runs under `torch.no_grad()` (how old/ref log-probs are computed in PPO); "fwd+bwd" runs with grad
and backpropagates sum(g1 * logprobs + g2 * entropy) into hidden and weight. The fast backend is
"auto" by default: Triton on CUDA, chunked PyTorch on CPU (the Triton interpreter is for tests only).

Memory is the peak of what the call allocates on top of what existed before it (inputs excluded):

- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus the bytes
  allocated before the call.
- CPU (torch's CPU allocator keeps no statistics): every tensor an operation returns is counted from
  then until its storage is freed (a `TorchDispatchMode` that sees each op's outputs, and a weak
  reference on each storage), whichever thread frees it: outputs, temporaries between ops, autograd's
  saved tensors, gradients. The peak of the running sum is the call's peak extra memory. It does not
  see scratch memory inside a single operation (BLAS workspaces) or outside torch, which is small next
  to [T, V] tensors. (torch's profiler with `profile_memory` records only the profiled thread's frees,
  so it misses tensors released by a collective's worker thread; tracemalloc cannot see torch tensors,
  and RSS deltas depend on when the allocator hands pages back to the OS.)

Time is the median of --repeat runs after a warm-up (CUDA events on GPU, perf_counter on CPU). On GPU
the table adds the roofline floor, FLOPs / peak tensor-core FLOP/s, with FLOPs = 2·T·H·V forward,
6·T·H·V forward+backward for the paths that keep logits (and Liger, which forms the gradients in its
forward) and 8·T·H·V for the fused path (its backward recomputes the logits), and the achieved
fraction floor / time.

Each row (a table line, or with --json one JSON object) is one shape x path x mode and carries `ms`
(median time) and `extra_gib` (peak extra memory), e.g. for a GPU check:
    {"path": "fused", "mode": "fwd+bwd", "T": 16384, "H": 4096, "V": 152064, "dtype": "bfloat16",
     "ms": ..., "extra_gib": ..., ...}

Run:
    .venv/bin/python -m ppo_bench.kernels                     # CPU defaults, table
    .venv/bin/python -m ppo_bench.kernels --shapes 4096x256x32000 --json
    .venv/bin/python -m ppo_bench.kernels --device cuda --dtype bfloat16 --shapes 16384x4096x152064 \
        --paths fused liger --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import ppo_kernels
from ppo_bench.common import cpu_peak_bytes, cuda_peak_bytes

PATHS = ("naive", "from_logits", "fused", "liger")
DEFAULT_PATHS = ("naive", "from_logits", "fused")
MODES = ("fwd", "fwd+bwd")
# Dense peak FLOP/s (bf16/fp16 tensor cores, fp32 without TF32) by device-name substring.
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L40S": (362.0, 91.6)}


@dataclasses.dataclass
class Row:
    """One measured (path, mode, shape)."""

    device: str
    path: str
    backend: str
    mode: str
    T: int
    H: int
    V: int
    dtype: str
    ms: float
    """Median time of one call, milliseconds."""
    extra_gib: float
    """Peak memory the call allocates beyond its inputs, GiB."""
    mem_vs_naive: float | None = None
    """Peak extra memory / the naive path's, same shape and mode."""
    floor_ms: float | None = None
    roofline_frac: float | None = None


def parse_shape(text: str) -> tuple[int, int, int]:
    """'4096x256x32000' -> (T, H, V)."""
    try:
        t, h, v = (int(x) for x in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"shape must be TxHxV, got {text!r}") from exc
    return t, h, v


def liger_unavailable(device: torch.device) -> str | None:
    """Why the liger path cannot run here (None when it can)."""
    if device.type != "cuda":
        return "Liger-Kernel runs on CUDA only"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as exc:
        return f"liger_kernel does not import ({exc})"
    return None


def _liger_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's fused linear cross entropy per token: log-probs = -loss (0 at ignored labels), no entropy."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, labels)
    if isinstance(loss, tuple):  # versions that also return z-loss / accuracy
        loss = loss[0]
    return -loss, None


def make_run(
    path: str,
    mode: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    backend: str,
    chunk_size: int | None,
    vocab_chunk_size: int | None = None,
) -> Callable[[], None]:
    """A closure that runs one path once; everything it allocates is freed when it returns."""
    gen = torch.Generator(device=hidden.device).manual_seed(0)
    g_lp = torch.randn(hidden.shape[0], device=hidden.device, generator=gen)
    g_ent = 0.01 * torch.randn(hidden.shape[0], device=hidden.device, generator=gen)

    def forward(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if path == "naive":
            return ppo_kernels.fused_linear_logprobs(h, w, labels, backend="reference")
        if path == "from_logits":
            return ppo_kernels.logprobs_from_logits(h @ w.T, labels, backend=backend, chunk_size=chunk_size)
        if path == "liger":
            return _liger_logprobs(h, w, labels)
        return ppo_kernels.fused_linear_logprobs(
            h, w, labels, backend=backend, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
        )

    def run() -> None:
        if mode == "fwd":
            with torch.no_grad():
                forward(hidden, weight)
            return
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logprobs, entropy = forward(h, w)
        loss = g_lp * logprobs if entropy is None else g_lp * logprobs + g_ent * entropy
        loss.sum().backward()

    return run


def median_time_ms(run: Callable[[], None], device: torch.device, repeat: int) -> float:
    """Median wall time of `repeat` calls of run(), in ms (CUDA events on GPU)."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """Dense peak TFLOP/s of the GPU for `dtype` (None on CPU or an unknown GPU without --peak-tflops)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, fp32) in PEAK_TFLOPS.items():
        if key in name:
            return fp32 if dtype == torch.float32 else half
    return None


def bench(args: argparse.Namespace) -> list[Row]:
    """Measure every (shape, mode, path) and print each row as soon as it is measured."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    paths = list(args.paths)
    if "liger" in paths and (why := liger_unavailable(device)):
        print(f"skipping --paths liger: {why}", file=sys.stderr)
        paths.remove("liger")
    rows = []
    for num_tokens, hidden_size, vocab_size in args.shapes:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype)
        weight = (torch.randn(vocab_size, hidden_size, generator=gen) / hidden_size**0.5).to(device, dtype)
        labels = torch.randint(0, vocab_size, (num_tokens,), generator=gen).to(device)
        backend = ppo_kernels.resolve_backend(args.backend, hidden)
        for mode in args.modes:
            naive_peak = None
            for path in paths:
                run = make_run(
                    path, mode, hidden, weight, labels, backend, args.chunk_size, args.vocab_chunk_size
                )
                run()  # warm-up: compilation, autotuning, allocator
                peak = cuda_peak_bytes(run) if device.type == "cuda" else cpu_peak_bytes(run)
                row = Row(
                    device=device.type,
                    path=path,
                    backend={"naive": "reference", "liger": "liger"}.get(path, backend),
                    mode=mode,
                    T=num_tokens,
                    H=hidden_size,
                    V=vocab_size,
                    dtype=args.dtype,
                    ms=median_time_ms(run, device, args.repeat),
                    extra_gib=peak / 2**30,
                )
                if path == "naive":
                    naive_peak = peak
                if naive_peak:
                    row.mem_vs_naive = peak / naive_peak
                tflops = peak_tflops(device, dtype, args.peak_tflops)
                if tflops:
                    units = 2 if mode == "fwd" else (8 if path == "fused" else 6)
                    row.floor_ms = units * num_tokens * hidden_size * vocab_size / (tflops * 1e12) * 1e3
                    row.roofline_frac = row.floor_ms / row.ms
                rows.append(row)
                print_row(row, args.json)
    return rows


_COLUMNS = (
    ("device", "{:<6}"),
    ("path", "{:<11}"),
    ("backend", "{:<9}"),
    ("mode", "{:<7}"),
    ("T", "{:>6}"),
    ("H", "{:>5}"),
    ("V", "{:>7}"),
    ("dtype", "{:<8}"),
    ("ms", "{:>9.1f}"),
    ("extra_gib", "{:>9.3f}"),
    ("mem_vs_naive", "{:>12.3f}"),
    ("floor_ms", "{:>8.2f}"),
    ("roofline_frac", "{:>13.2f}"),
)


def print_header(as_json: bool) -> None:
    if not as_json:
        print(" ".join(_pad(name, fmt) for name, fmt in _COLUMNS))


def _pad(name: str, fmt: str) -> str:
    """`name` padded to the width and alignment of a column's format, e.g. "{:>9.1f}" -> 9, right."""
    width = int("".join(c for c in fmt.split(":")[1].split(".")[0] if c.isdigit()))
    return name.rjust(width) if ">" in fmt else name.ljust(width)


def print_row(row: Row, as_json: bool) -> None:
    """One table line, or one JSON object with --json."""
    values = dataclasses.asdict(row)
    if as_json:
        print(json.dumps(values), flush=True)
        return
    cells = []
    for name, fmt in _COLUMNS:
        value = values[name]
        cells.append(fmt.format(value) if value is not None else _pad("-", fmt))
    print(" ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse flags (argv, default sys.argv), fill in per-device defaults, run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=None,
        help="TxHxV ... (default CPU: 1024x256x32000 4096x256x32000; CUDA: 4096x4096x152064 16384x4096x152064)",
    )
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA)")
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS, default=list(DEFAULT_PATHS), help="liger: only where it imports"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--backend", choices=ppo_kernels.BACKENDS, default="auto", help="fast paths' backend")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default: from the memory budget)"
    )
    parser.add_argument(
        "--vocab-chunk-size",
        type=int,
        default=None,
        help="vocabulary rows per backward chunk of the fused path (default: from the memory budget)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the roofline peak")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if args.shapes is None:
        args.shapes = (
            [(4096, 4096, 152064), (16384, 4096, 152064)]
            if on_cuda
            else [(1024, 256, 32000), (4096, 256, 32000)]
        )
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    print_header(args.json)
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
