#!/usr/bin/env bash
# On a CUDA machine: every kernel once (benchmarks/sanitize.py) under compute-sanitizer's memcheck, racecheck
# and synccheck; one summary file per tool in $OUT (default sanitizer-out), the last lines of each printed.
#   OUT=out bash benchmarks/run_sanitizers.sh
set -uo pipefail
OUT=${OUT:-sanitizer-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
python benchmarks/sanitize.py > "$OUT/plain.txt" 2>&1  # compiles every kernel once, outside the sanitizer
echo "plain exit $?" >> "$OUT/plain.txt"
for tool in memcheck racecheck synccheck; do
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" "${extra[@]}" --print-limit 20 \
    python benchmarks/sanitize.py > "$OUT/$tool.txt" 2>&1
  echo "$tool exit $?" >> "$OUT/$tool.txt"
done
for f in plain memcheck racecheck synccheck; do echo "== $f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit|FAIL|Error" "$OUT/$f.txt" | tail -6; done
