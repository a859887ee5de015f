#!/usr/bin/env bash
# Install the CPU build of torch 2.13.0 when no torch is importable.
# Why: a bare `torch` requirement on a machine without torch makes pip fetch a multi-GB CUDA build;
# torch==2.13.0 is the CPU wheel (available offline on the project's machines). An existing torch is
# left alone, whatever its version, as long as it satisfies the package's range.
set -euo pipefail
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
