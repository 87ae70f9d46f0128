#!/usr/bin/env bash
# GPU check of kernels/: the kernel tests with real Triton on CUDA (fp32, fp16 and bf16), then the
# benchmark (table + JSON lines). Meant for the day a GPU is at hand; about 2-4 minutes on one H100/H200.
#
#   bash scripts/gpu_check.sh                  # uses .venv/bin/python, or $PYTHON
#   OUT=/tmp/gpu_check bash scripts/gpu_check.sh
#
# Writes $OUT/pytest.txt, $OUT/bench.txt and $OUT/bench.jsonl (default OUT: ./outputs/gpu_check).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"

# Real Triton on CUDA: the interpreter must be off (the tests only turn it on when there is no GPU).
unset TRITON_INTERPRET

"$PYTHON" - <<'EOF'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device: run tests/test_kernels.py on CPU instead"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
EOF

echo "== kernel tests (CUDA) =="
timeout 180 "$PYTHON" -m pytest tests/test_kernels.py -q -rs 2>&1 | tee "$OUT/pytest.txt"

echo "== benchmark (bf16) =="
# 16k tokens x 152k vocab is the case the fused path exists for; the naive path needs ~50 GB there.
timeout 150 "$PYTHON" scripts/bench_kernels.py --dtype bfloat16 --repeat 5 \
    --shapes 4096x4096x152064 16384x4096x152064 | tee "$OUT/bench.txt"
timeout 60 "$PYTHON" scripts/bench_kernels.py --dtype bfloat16 --repeat 3 --json \
    --shapes 4096x4096x152064 --paths from_logits fused > "$OUT/bench.jsonl"
echo "wrote $OUT/pytest.txt $OUT/bench.txt $OUT/bench.jsonl"
