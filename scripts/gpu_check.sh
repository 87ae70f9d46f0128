#!/usr/bin/env bash
# GPU check of throughput and LoRA memory: one prepared run that measures everything the
# GPU tables of docs/performance.md hold and ends with one JSON line (scripts/gpu_summary.py). Nothing is downloaded:
# models have the Qwen2.5 shapes and random weights (scripts/make_shaped_model.py), data and tokenizer
# are the synthetic task's (scripts/make_tiny_assets.py). Every stage has its own time limit; a stage that
# fails or runs out of time leaves nulls in the summary and the others still run.
#
# Stages (default: the first four, about 6 minutes on one H200; GPU_CHECK_EXTRA=1 adds the rest):
#   kernels   CUDA kernel tests (real Triton), then ppo_bench.kernels in bf16 at T x H x V = 4096 x 4096 x
#             152064, 16384 x 4096 x 152064 and 16384 x 896 x 152064 (from_logits, fused; liger where it
#             imports): fused fwd+bwd ms and peak extra GiB, forward-only against logits + log-prob
#   rollout   ppo_bench.rollout on the 0.5B shape, 256 prompts x 128 new tokens, bf16: plain HF generate,
#             our sharded rollout and the compiled rollout (static cache + compiled step): ms per
#             decoding step and greedy token equality
#   ppo_0.5b  4 PPO steps of configs/qwen2_5_0_5b_gsm8k.yaml (GAE, 256 prompts x 512 response tokens)
#   summary   the JSON line (also $OUT/summary.json)
#   extra:    prefix (ppo_bench.prefix on the 0.5B shape: the prompt once per group,
#             actor.use_prefix_grouper and rollout.reuse_prompt_cache, off against on, at its headline
#             point, prompt 1024 x response 32 x G 8 with 8 groups, and at the CPU demo's shapes, prompt 16
#             x response 28 x G 8, GAE; the step's time by phase, to $RUNS/prefix.jsonl), ppo_1.5b (the
#             same as ppo_0.5b on the 1.5B shape), ppo_lora_7b (3 GRPO steps of a 7B-shaped actor with
#             rank-64 LoRA on all linear layers, bf16 base, gradient checkpointing) and ppo_full_7b (the
#             same run without LoRA, where it fits)
#
#   PYTHON=python3 PYTHONPATH=. bash scripts/gpu_check.sh        # the device machine (no install)
#   GPU_CHECK_EXTRA=1 OUT=/tmp/gpu bash scripts/gpu_check.sh     # all stages
#
# $OUT (default outputs/gpu_check) receives at most 8 files: log.txt, summary.json,
# kernels.jsonl, rollout.jsonl and each PPO run's metrics as ppo_<name>.jsonl. Scratch (models,
# run folders) goes to $RUNS (default /tmp/gpu_check_runs).
set -uo pipefail

cd "$(dirname "$0")/.."
# The benchmarks (python -m ppo_bench.*) live in scripts/ppo_bench: importable without an install.
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-outputs/gpu_check}
RUNS=${RUNS:-/tmp/gpu_check_runs}
EXTRA=${GPU_CHECK_EXTRA:-0}
mkdir -p "$OUT" "$RUNS"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # real Triton on CUDA (the tests turn the interpreter on only without a GPU)

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, report, never stop the script
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s) =="
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s =="
    return 0
}

"$PYTHON" - > "$RUNS/device.txt" <<'EOF' || { echo "no CUDA device: run the CPU tests instead"; exit 1; }
import torch, transformers, triton
assert torch.cuda.is_available()
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}")
EOF
cat "$RUNS/device.txt"

# -- kernels ----------------------------------------------------------------------------------------
stage kernel_tests 150 bash -c "'$PYTHON' -m pytest tests/unit/test_kernels.py -q -rs -p no:cacheprovider \
    | tee '$RUNS/pytest.txt'"
PATHS="from_logits fused"
"$PYTHON" -c "import liger_kernel" 2>/dev/null && PATHS="$PATHS liger"
# shellcheck disable=SC2086  # PATHS is a word list
stage kernel_bench 150 bash -c "'$PYTHON' -m ppo_bench.kernels --device cuda --dtype bfloat16 --repeat 5 \
    --json --paths $PATHS --shapes 4096x4096x152064 16384x4096x152064 16384x896x152064 \
    > '$RUNS/kernels.jsonl'"
cat "$RUNS/kernels.jsonl" 2>/dev/null

# -- rollout ----------------------------------------------------------------------------------------
stage rollout 150 bash -c "'$PYTHON' -m ppo_bench.rollout --device cuda --model-config 0.5b \
    --dtype bfloat16 --num-prompts 256 --prompt-len 128 --new-tokens 128 --micro-batch 256 --repeat 2 \
    --compiled --json > '$RUNS/rollout.jsonl'"
cat "$RUNS/rollout.jsonl" 2>/dev/null

# -- PPO steps --------------------------------------------------------------------------------------
"$PYTHON" scripts/make_tiny_assets.py --out "$RUNS/assets" --seed 0 > /dev/null
DATA=(data.train_files="[$RUNS/assets/data/train.parquet]" data.val_files=[]
      trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable
      trainer.overwrite=true trainer.logger=[console,jsonl] rollout.ignore_eos=true)

ppo() {  # ppo NAME SHAPE SECONDS CONFIG OVERRIDES...
    local name=$1 shape=$2 limit=$3 config=$4
    shift 4
    [ -d "$RUNS/model_$shape" ] || "$PYTHON" scripts/make_shaped_model.py --shape "$shape" \
        --tokenizer "$RUNS/assets/tokenizer" --out "$RUNS/model_$shape" --device cuda --dtype bfloat16
    stage "$name" "$limit" "$PYTHON" train_ppo.py --config "$config" model.path="$RUNS/model_$shape" \
        "${DATA[@]}" trainer.output_dir="$RUNS/$name" "$@"
    [ -f "$RUNS/$name/metrics.jsonl" ] && cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.jsonl"
    return 0
}

ppo ppo_0.5b 0.5b 240 configs/qwen2_5_0_5b_gsm8k.yaml trainer.total_training_steps=4

if [ "$EXTRA" = 1 ]; then
    # The prompt once per group: each point off and on in its own trainer process, the 0.5B preset's
    # precision and micro-batch budget; no compiled rollout (each process would compile its own shapes).
    [ -d "$RUNS/model_0.5b" ] || "$PYTHON" scripts/make_shaped_model.py --shape 0.5b \
        --tokenizer "$RUNS/assets/tokenizer" --out "$RUNS/model_0.5b" --device cuda --dtype bfloat16
    stage prefix 150 bash -c "'$PYTHON' -m ppo_bench.prefix --model-path '$RUNS/model_0.5b' --nproc 1 \
        --parts headline,demo --repeats 1 --prompts-per-rank 8 --config configs/qwen2_5_0_5b_gsm8k.yaml \
        --max-tokens 16384 --set rollout.compile=false --json > '$RUNS/prefix.jsonl'"
    cat "$RUNS/prefix.jsonl" 2>/dev/null
    ppo ppo_1.5b 1.5b 300 configs/qwen2_5_0_5b_gsm8k.yaml trainer.total_training_steps=4
    SEVEN_B=(trainer.total_training_steps=3 data.train_batch_size=64 actor.ppo_mini_batch_size=64
             data.max_response_length=512 rollout.micro_batch_size_per_gpu=320 trainer.n_gpus_per_node=1
             trainer.save_hf_on_end=false)
    ppo ppo_lora_7b 7b 420 configs/qwen2_5_7b_gsm8k_grpo.yaml "${SEVEN_B[@]}" actor.lora.rank=64 \
        actor.lora.alpha=128 actor.lora.base_dtype=bfloat16 actor.optim.lr=1e-5
    ppo ppo_full_7b 7b 420 configs/qwen2_5_7b_gsm8k_grpo.yaml "${SEVEN_B[@]}"
fi

# -- summary ----------------------------------------------------------------------------------------
cp "$RUNS/kernels.jsonl" "$RUNS/rollout.jsonl" "$OUT/" 2>/dev/null
echo "== summary =="
"$PYTHON" scripts/gpu_summary.py "$RUNS" | tee "$OUT/summary.json"
