#!/usr/bin/env bash
# A venv with TRL 1.16 (and the CPU torch), apart from grpo-jax's: the side-by-side comparison
# (tools/side_by_side.py) runs TRL's GRPOTrainer in it. Usage: bash tools/install_trl.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-$PWD/.venv-trl}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import trl, torch" 2>/dev/null; then
    exit 0
fi
"${PYTHON:-python3}" -m venv "$VENV"
# torch first and pinned: the local CPU wheel (an unpinned torch pulls a CUDA build).
"$VENV/bin/pip" install -q -c constraints/test.txt "torch==2.13.0"
"$VENV/bin/pip" install -q -c constraints/test.txt "trl==1.16.0" transformers datasets accelerate
