#!/usr/bin/env bash
# Re-test against the newest versions on PyPI and, if the whole suite passes, make them the
# pinned set: `bash tools/refresh_constraints.sh [pytest args]`.
#
# Builds two fresh venvs under a temporary directory (the trainer's and the vLLM server's),
# installs without constraints (GRPO_JAX_CONSTRAINTS=none), runs tests/run.sh, and only on a
# pass rewrites constraints/test.txt and constraints/vllm.txt from `pip freeze`. On a failure the
# pinned files stay as they are and the venvs are kept for a look (the path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(mktemp -d "${TMPDIR:-/tmp}/grpo_jax-refresh.XXXXXX")
echo "fresh venvs in $root"
"${PYTHON:-python3}" -m venv "$root/venv"
"$root/venv/bin/python" -m pip install --quiet --upgrade pip
export GRPO_JAX_CONSTRAINTS=none GRPO_JAX_VLLM_VENV="$root/vllm"
if ! (. "$root/venv/bin/activate" && bash tests/run.sh "$@"); then
  echo "the newest versions fail the suite: constraints/ unchanged; venvs kept in $root" >&2
  exit 1
fi
freeze() {  # the venv's packages, minus this project and pip's own tooling
  "$1" -m pip freeze --exclude-editable | grep -viE '^(pip|setuptools|wheel|grpo-jax)=='
}
{ echo "# Versions the suite last passed with (tools/refresh_constraints.sh, $(date -u +%F))."
  freeze "$root/venv/bin/python"; } > constraints/test.txt
{ echo "# The vLLM CPU server venv's versions when the suite last passed ($(date -u +%F))."
  freeze "$root/vllm/bin/python"; } > constraints/vllm.txt
rm -rf "$root"
echo "constraints/ refreshed; review with git diff constraints/ and commit"
