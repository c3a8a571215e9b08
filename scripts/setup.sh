#!/usr/bin/env bash
# Creates ./.venv and installs prime-node into it (editable, with the test extras).
# torch is installed first, pinned to 2.13.0: on these machines that is a CPU build already on disk,
# whereas an unpinned torch would pull several GB of CUDA packages. Idempotent: rerunning is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# System packages features need, installed where apt is available and we are root; otherwise say how and go
# on (the tests that need one skip, naming it). bubblewrap: code environments run untrusted programs in it
# (node/environments/sandbox.py) and refuse to start without it. chromium and its driver: the dashboard test
# looks at the validator's page in headless Chromium (tests/test_leaderboard.py). iptables: the home routers
# of the network-namespace harness NAT with it (tests/support/netlab).
apt_install() {  # apt_install COMMAND WHAT PACKAGE...
  local command=$1 what=$2
  shift 2
  command -v "$command" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
      || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
           && apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; } \
      || echo "setup: could not install $* with apt-get; $what" >&2
  else
    echo "setup: $command is not installed; $what (apt-get install $*)" >&2
  fi
}
apt_install bwrap "code environments will refuse to start" bubblewrap
apt_install tc "the network-namespace tests will skip" iproute2
apt_install iptables "the network-namespace tests (tests/support/netlab, docs/network.md) will skip" iptables
apt_install chromedriver "the dashboard's browser test will skip" chromium chromium-driver
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
