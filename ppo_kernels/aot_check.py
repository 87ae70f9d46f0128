"""Compile every Triton kernel of `ppo_kernels.triton_ops` for a CUDA target, without a GPU.

The interpreter (how the tests run the kernels on CPU) executes Python, not the Triton compiler, so a
kernel can pass every CPU test and still fail to compile on a GPU (a loop-carried type that changes,
a constexpr misuse, a dot shape). This runs the real compiler down to a cubin with the ptxas that ships
in the triton wheel, for bf16 and fp32 inputs and the launch configs the ops use.

Run (TRITON_INTERPRET must be unset):
    .venv/bin/python -m ppo_kernels.aot_check            # sm_90 (H100/H200)
    .venv/bin/python -m ppo_kernels.aot_check --arch 80  # A100
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ppo_kernels import triton_ops as k

# Argument types shared by name across the kernels; "{dt}" is the input dtype.
_ARG_TYPES = {
    **dict.fromkeys(("logits_ptr", "grad_logits_ptr", "a_ptr", "b_ptr"), "*{dt}"),
    **dict.fromkeys(
        (
            "logprobs_ptr",
            "entropy_ptr",
            "lse_ptr",
            "mean_z_ptr",
            "grad_logprobs_ptr",
            "grad_entropy_ptr",
            "c_ptr",
            "ref_ptr",
            "kl_ptr",
            "grad_kl_ptr",
            "grad_x_ptr",
        ),
        "*fp32",
    ),
    "labels_ptr": "*i64",
    **dict.fromkeys(("temperature", "LOG_RATIO_CLAMP", "VALUE_CLAMP"), "fp32"),
}


def compile_kernel(
    fn: triton.JITFunction, dtype: str, constexprs: dict, target: GPUTarget, **options: int
) -> int:
    """Compile one specialization to a cubin; returns its shared memory in bytes."""
    signature = {
        name: "constexpr" if name in constexprs else _ARG_TYPES.get(name, "i32").format(dt=dtype)
        for name in fn.arg_names
    }
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target, options=options
    )
    return kernel.metadata.shared


def specializations() -> list[tuple[triton.JITFunction, str, dict, dict]]:
    """(kernel, input dtype, constexprs, launch options) for every kernel variant the ops launch."""
    specs = []
    grad_tile = {name: k._GRAD_TILE[name] for name in ("BLOCK_T", "BLOCK_V")}
    for dt in ("bf16", "fp32"):
        for flag in (True, False):
            specs.append(
                (k._logits_fwd_kernel, dt, {"COMPUTE_ENTROPY": flag, "BLOCK_V": 4096}, {"num_warps": 8})
            )
            specs.append(
                (
                    k._logits_bwd_kernel,
                    dt,
                    {"HAS_GRAD_ENTROPY": flag, **grad_tile},
                    {"num_warps": k._GRAD_TILE["num_warps"]},
                )
            )
    # grad_hidden accumulation: half-precision inputs only (fp32 goes to cuBLAS).
    acc_blocks = {name: k._ACC_CONFIG[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    acc_launch = {name: k._ACC_CONFIG[name] for name in ("num_warps", "num_stages")}
    specs.append((k._matmul_acc_kernel, "bf16", {**acc_blocks, "UPCAST": False}, acc_launch))
    specs.append((k._low_var_kl_fwd_kernel, "fp32", {"BLOCK": 1024}, {}))
    specs.append((k._low_var_kl_grad_kernel, "fp32", {"BLOCK": 1024}, {}))
    return specs


def main() -> None:
    """Compile all specializations for --arch and print one line per kernel; exit 1 on any failure."""
    parser = argparse.ArgumentParser(description="Compile the kernels for a CUDA target without a GPU.")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args()
    if k.INTERPRETED:
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this check compiles")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's default-change warning
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for fn, dtype, constexprs, options in specializations():
        start = time.perf_counter()
        try:
            shared = compile_kernel(fn, dtype, constexprs, target, **options)
        except Exception as exc:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {fn.__name__} {dtype} {constexprs}: {exc}")
            continue
        print(f"ok   {fn.__name__} {dtype} smem={shared}B {time.perf_counter() - start:.1f}s")
    if failures:
        sys.exit(f"{failures} kernel(s) failed to compile for sm_{args.arch}")


if __name__ == "__main__":
    main()
