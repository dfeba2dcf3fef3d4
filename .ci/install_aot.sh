#!/usr/bin/env bash
# Install the compilers `python -m grpo_jax.aot` needs into their own venv: libtpu (TPU slices)
# and jax's CUDA plugin (NVIDIA GPUs). Both compile without the hardware. A side venv keeps
# them out of the trainer's venv; the repo is used from PYTHONPATH, not installed.
# Usage: .ci/install_aot.sh [DIR]. Idempotent: does nothing when DIR/bin/python has them.
set -euo pipefail
. "$(dirname "$0")/pip.sh"

DIR="${1:-$PWD/.venv-aot}"
PY="${PYTHON:-python3}"
root="$(cd "$(dirname "$0")/.." && pwd)"
# jax, libtpu and the plugin from constraints/aot.txt; flax, optax, ... as the trainer has them.
pin=(-c "$root/constraints/aot.txt" -c "$root/constraints/test.txt")
if [ "${GRPO_JAX_CONSTRAINTS:-}" = none ]; then pin=(); fi
check="import libtpu, flax, optax, yaml, jax_plugins.xla_cuda13"

if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "$check" 2>/dev/null; then
  echo "the AOT compilers are already importable from $DIR/bin/python; nothing to do"
  exit 0
fi

start=$(date +%s)
"$PY" -m venv "$DIR"
pip_install "$DIR/bin/python" --upgrade pip
pip_install "$DIR/bin/python" "${pin[@]}" "jax[tpu]" flax optax numpy pyyaml
# --no-deps: the CUDA libraries (~4 GB) are for running on a GPU; compiling needs none.
pip_install "$DIR/bin/python" "${pin[@]}" --no-deps jax-cuda13-plugin jax-cuda13-pjrt
"$DIR/bin/python" -c "$check"
echo "installed jax[tpu] and the CUDA plugin into $DIR in $(( $(date +%s) - start )) s"
