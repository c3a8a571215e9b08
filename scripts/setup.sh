#!/usr/bin/env bash
# Creates ./.venv and installs prime-node into it (editable, with the test extras).
# torch is installed first, pinned to 2.13.0: on these machines that is a CPU build already on disk,
# whereas an unpinned torch would pull several GB of CUDA packages. Idempotent: rerunning is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Code environments run untrusted programs in bubblewrap (node/environments/sandbox.py) and refuse to start
# without it. Installed here where apt is available and we are root; otherwise say how, and go on.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 \
      || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
           && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1; } \
      || echo "setup: could not install bubblewrap with apt-get; code environments will refuse to start" >&2
  else
    echo "setup: bubblewrap (bwrap) is not installed; code environments need it (apt-get install bubblewrap)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
