#!/usr/bin/env bash
# Every measurement docs/benchmarks.md asks of a GPU session, in one call (a device start costs
# minutes): the bench in each variant, JSON figures, the device's target config and autotune
# results (so tools/gpu_aot.py on a CPU machine compiles what the device compiles).
#   device tool:  bash tools/gpu_session.sh            (writes under $OUT)
#   CPU smoke:    OUT=/tmp/s bash tools/gpu_session.sh --tiny --repeats 1
# Extra arguments go to every bench run. Each variant takes ~1.5 minutes on an H100 (compiles
# included); VARIANTS="auto dots" picks some, e.g. to stay under a 10-minute call limit.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_session}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - > "$OUT/target_config.txtpb" 2> "$OUT/target_config.err" <<'EOF'
import jax
from jax._src.lib import xla_client as xc
if jax.default_backend() == "gpu":
    print(xc.get_topology_for_devices(jax.devices()).target_config)
EOF

CMD_BUFFERS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
ALL="gmm moe16 moe64 xla_decode pallas_decode partial auto dots cudnn dots_cudnn_cmdbuf"
VARIANTS="${VARIANTS:-$ALL dots_no_shared_prefix tldr_like}"
run() {  # name, XLA_FLAGS, bench args... (the bench's `all`, or $what: what=sampler run ...)
  local name=$1 flags=$2
  shift 2
  case " $VARIANTS " in *" $name "*) ;; *) return ;; esac
  echo "== $name ${flags:+(XLA_FLAGS=$flags)} ${what:-all} $*"
  XLA_FLAGS="$flags" timeout 400 python -m grpo_jax.bench "${what:-all}" "$@" \
    --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "   exit $?"
  grep -E "^(train_step_s|mfu|generate_s|prefill|decode_ms|decode_fraction|grpo_step|peak|partial_speedup|(refill|partial)_(groups_per_s|round_s|generate_s|update_s|slot_occupancy|staleness_mean))" \
    "$OUT/$name.log"
}
# The MoE grouped matmuls (models/gmm.py): Mosaic GPU kernels against XLA's ragged_dot (~1 min).
case " $VARIANTS " in *" gmm "*)
  echo "== gmm"; timeout 300 python tools/gmm_gpu_check.py > "$OUT/gmm.log" 2>&1
  echo "   exit $?"; cat "$OUT/gmm.log" | tail -8 ;; esac
# Qwen3-30B-A3B's shape (4 layers, random weights) at the two sizes issue #51 names, with the
# kernels "auto" picks on Hopper: 16 rows of 256 + 256 tokens, then 64 rows (XLA's ragged_dot ran
# out of memory at both; deviceless they need 21 and 27 GiB of temporaries, docs/benchmarks.md).
run moe16 "" --preset qwen3-30b-a3b --num-layers 4 --prompts 4 --generations 4 "$@"
run moe64 "" --preset qwen3-30b-a3b --num-layers 4 --prompts 8 --generations 8 "$@"
# The decode step's attention (numerics.decode_attention, issue #51): XLA's against the fused
# Pallas kernel (models/decode_attention.py), the sampler alone, one after the other on one device.
# First the kernel alone against XLA's attention: outputs and per-layer times (~1 min).
case " $VARIANTS " in *" pallas_decode "*)
  echo "== decode_attention check"
  timeout 200 python tools/decode_attention_gpu_check.py > "$OUT/decode_attention.log" 2>&1
  echo "   exit $?"; tail -4 "$OUT/decode_attention.log" ;; esac
what=sampler run xla_decode "" --decode-attention xla "$@"
what=sampler run pallas_decode "" --decode-attention pallas "$@"
# Partial rollouts against refilled rounds (issue #49) on one device, Qwen2-0.5B's shape: 8
# groups of 8 a round through 64 decode slots, up to 512 tokens, lengths long-tailed by stop
# tokens of 0.4% of the vocabulary (geometric, mean ~250; 13% reach the cap), max_staleness 4
# (so four batches in flight, 256 rows: max_inflight_tasks' default).
what=partial run partial "" --completion-len 512 --max-num-seqs 64 --max-staleness 4 \
  --stop-fraction 0.004 "$@"
run auto "--xla_gpu_dump_autotune_results_to=$OUT/autotune.pbtxt" "$@"
run dots "" --remat-policy dots "$@"
run cudnn "" --attention cudnn "$@"
run dots_cudnn_cmdbuf "$CMD_BUFFERS" --remat-policy dots --attention cudnn "$@"
# Shared-prefix training (numerics.shared_prefix, on in every run above): the e2e step without
# it, and a tldr-like shape (long prompts, G = 8) where computing each prompt once matters most.
run dots_no_shared_prefix "" --remat-policy dots --no-shared-prefix "$@"
run tldr_like "" --remat-policy dots --prompt-len 512 --completion-len 128 "$@"
