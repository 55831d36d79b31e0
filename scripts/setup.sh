#!/usr/bin/env bash
# Installs flowexec (editable) and what it needs. `setup.sh test` adds the test extras.
# A torch that is already installed is kept; otherwise the CPU/CUDA build of torch 2.13.0 is pinned,
# so that a bare requirement never pulls an unexpected multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -q --no-build-isolation -e ".${extra}"
# The native call check (flowexec/runtime/fastcall.py): built once per machine, ~30 s; without a
# compiler flowexec still works (calls take the Python path), so a failed build only says so.
"$PY" -m flowexec.runtime.build_native || echo "setup: the native call check was not built; calls use the Python path" >&2
