#!/usr/bin/env bash
# GPU check: the kernel tests with real Triton on CUDA (fp32, fp16 and bf16), the kernel benchmark
# (table + JSON lines), then 3 PPO steps of the Qwen2.5-0.5B preset on a model with its shapes built from
# its config (random weights, the tiny character tokenizer and the synthetic task: nothing downloaded),
# printing the actor update's MFU and tokens/s per GPU. About 4-5 minutes on one H100/H200.
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
echo "== PPO steps of configs/qwen2_5_0_5b_gsm8k.yaml (0.5B shapes, random weights) =="
"$PYTHON" scripts/make_tiny_assets.py --out "$OUT/assets" --seed 0 > /dev/null
"$PYTHON" - "$OUT" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
sys.path.insert(0, "scripts")
from bench_rollout import model_config  # Qwen2.5-0.5B's shapes with the tiny tokenizer's special ids
out = Path(sys.argv[1])
AutoModelForCausalLM.from_config(model_config("0.5b")).save_pretrained(out / "qwen05b")
AutoTokenizer.from_pretrained(out / "assets" / "tokenizer").save_pretrained(out / "qwen05b")
EOF
timeout 420 "$PYTHON" train_ppo.py --config configs/qwen2_5_0_5b_gsm8k.yaml \
    model.path="$OUT/qwen05b" data.train_files="$OUT/assets/data/train.parquet" \
    data.val_files="$OUT/assets/data/val.parquet" trainer.val_before_train=false trainer.test_freq=-1 \
    trainer.save_freq=-1 trainer.total_training_steps=3 trainer.resume_mode=disable \
    trainer.output_dir="$OUT/ppo_0.5b" 2>&1 | tail -n 5
"$PYTHON" - "$OUT/ppo_0.5b/metrics.jsonl" <<'EOF'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]
for key in ("perf/mfu/actor", "perf/throughput", "timing_s/update_actor", "timing_s/gen", "timing_s/step", "perf/max_memory_gib"):
    print(f"{key:24s} {last.get(key, float('nan')):.4g}")
EOF
echo "wrote $OUT/pytest.txt $OUT/bench.txt $OUT/bench.jsonl $OUT/ppo_0.5b"
