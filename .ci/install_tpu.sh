#!/usr/bin/env bash
# Install jax with libtpu into its own venv, for `python -m grpo_jax.aot` on TPU topologies
# (compiling for a TPU pod needs libtpu, not a TPU). A side venv keeps libtpu out of the
# trainer's venv. The repo is used from PYTHONPATH, not installed.
# Usage: .ci/install_tpu.sh [DIR]. Idempotent: does nothing when DIR/bin/python imports libtpu.
set -euo pipefail

DIR="${1:-$PWD/.venv-tpu}"
PY="${PYTHON:-python3}"
root="$(cd "$(dirname "$0")/.." && pwd)"
# jax/libtpu from constraints/tpu.txt; flax, optax and friends as the trainer's venv has them.
pin=(-c "$root/constraints/tpu.txt" -c "$root/constraints/test.txt")
if [ "${GRPO_JAX_CONSTRAINTS:-}" = none ]; then pin=(); fi

if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import libtpu, flax, optax" 2>/dev/null; then
  echo "libtpu already importable from $DIR/bin/python; nothing to do"
  exit 0
fi

start=$(date +%s)
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet "${pin[@]}" "jax[tpu]" flax optax numpy pyyaml
"$DIR/bin/python" -c "import jax, libtpu; print('jax', jax.__version__, 'libtpu', \
  getattr(libtpu, '__version__', '?'))"
echo "installed jax[tpu] into $DIR in $(( $(date +%s) - start )) s"
