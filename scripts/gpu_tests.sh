#!/usr/bin/env bash
# The GPU tests on a CUDA machine where nothing can be installed (the lent H200): run from the
# checkout, and keep every failure's name and message, not just pytest's last line.
#   bash scripts/gpu_tests.sh [pytest args]      # report in ${OUT:-.}/gpu-tests.xml and gpu-tests.txt
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
PYTHONPATH=. python3 -m pytest -q -rfE -p no:cacheprovider --junitxml="$out/gpu-tests.xml" tests/gpu "$@" \
  > "$out/gpu-tests.txt" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$out/gpu-tests.txt" | tail -20
exit $rc
