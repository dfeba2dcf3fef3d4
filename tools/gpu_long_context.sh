#!/usr/bin/env bash
# Issue 32's GPU check, in one device call: a train step (fwd + bwd + AdamW) on one GPU at
# growing row lengths, Qwen2-0.5B's shape, 2 rows of 256 prompt + N completion tokens, bf16,
# remat full. Kernels: auto (cuDNN up to 8k keys, then the blockwise flash attention), flash
# (models/attention.flash everywhere) and xla (whole [T, T] scores) where it fits. Peak device
# memory should grow linearly with length under flash, quadratically under xla.
#   device tool:  bash tools/gpu_long_context.sh            (figures under $OUT)
#   CPU smoke:    OUT=/tmp/lc LENGTHS="256 512" EXTRA=--tiny bash tools/gpu_long_context.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_long_context}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LENGTHS="${LENGTHS:-4096 8192 16384 32768}"
run() {  # kernel, completion length
  local name="$1_$2"
  timeout "${PER_RUN:-150}" python -m grpo_jax.bench train-step --prompts 1 --generations 2 \
    --prompt-len 256 --completion-len "$2" --attention "$1" --repeats 2 ${EXTRA:-} \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(grep -E '^(train_step_s|peak_device_memory_GiB|mfu)' "$OUT/$name.log" \
    | tr -s ' ' | tr '\n' ' ')"
}
for n in $LENGTHS; do run flash "$n"; done
# auto beyond 8k keys is flash: only the shorter rows differ.
for n in $LENGTHS; do [ "$n" -le 8192 ] && run auto "$n"; done
for n in $LENGTHS; do [ "$n" -le 8192 ] && run xla "$n"; done
true
