#!/usr/bin/env bash
# Creates ./.venv and installs prime-node into it (editable, with the test extras).
# torch is installed first, pinned to 2.13.0: on these machines that is a CPU build already on disk,
# whereas an unpinned torch would pull several GB of CUDA packages. Idempotent: rerunning is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
