#!/usr/bin/env bash
# Install FlowEngine and everything it needs into the current Python (>= 3.11).
#
#   bash scripts/install.sh          # the engine, the server and the test tools
#
# On a machine without CUDA it installs the CPU build of torch first, so that pip does
# not pull a multi-GB CUDA build to satisfy `torch>=2.5`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install "torch>=2.5"
  else
    # A CPU wheel from a local wheel store or index if one is configured (pip's
    # find-links), else PyTorch's CPU index.
    pip_install "torch==2.13.0+cpu" 2>/dev/null ||
      pip_install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip_install -e ".[test]"
"$PY" -c "import flowengine, torch; print('flowengine', flowengine.__version__, '| torch', torch.__version__)"
