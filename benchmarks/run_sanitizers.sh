#!/usr/bin/env bash
# On a CUDA machine: every kernel once (benchmarks/sanitize.py) under compute-sanitizer's memcheck and synccheck
# (all problems in one process each), and racecheck one problem per process with its own time limit (it slows
# kernels by orders of magnitude: one slow problem must not hide the others). One file per tool in $OUT (default
# sanitizer-out; racecheck.txt holds each problem's first 10 reports under a "## problem" line, host frames left
# out, and racecheck-summary.txt every report counted by kernel, source lines and addresses),
# the last lines printed.
#   OUT=out bash benchmarks/run_sanitizers.sh          (SANITIZER_TIMEOUT, RACECHECK_TIMEOUT seconds)
#   RACECHECK_PROBLEMS="hopper causal,hopper sparse" TOOLS=racecheck OUT=out bash benchmarks/run_sanitizers.sh
#   (some problems only, e.g. to spread racecheck over several calls; TOOLS picks among memcheck synccheck racecheck)
set -uo pipefail
OUT=${OUT:-sanitizer-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
python benchmarks/sanitize.py > "$OUT/plain.txt" 2>&1  # compiles every kernel once, outside the sanitizer
echo "plain exit $?" >> "$OUT/plain.txt"
TOOLS=${TOOLS:-memcheck synccheck racecheck}
for tool in memcheck synccheck; do
  [[ " $TOOLS " == *" $tool "* ]] || continue
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" "${extra[@]}" --print-limit 20 \
    python benchmarks/sanitize.py > "$OUT/$tool.txt" 2>&1
  echo "$tool exit $?" >> "$OUT/$tool.txt"
done
if [[ " $TOOLS " == *" racecheck "* ]]; then
  if [ -n "${RACECHECK_PROBLEMS:-}" ]; then echo "$RACECHECK_PROBLEMS" | tr ',' '\n'
  else python -c "import sys; sys.path.insert(0, 'benchmarks'); import sanitize; print(*sanitize.PROBLEMS, sep='\n')"; fi
fi | while read -r problem; do
  echo "## $problem" >> "$OUT/racecheck.txt"
  timeout "${RACECHECK_TIMEOUT:-90}" compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 100000 \
    python benchmarks/sanitize.py "$problem" 2>&1 | grep -v "Host Frame" > "$OUT/racecheck.part"
  echo "racecheck exit ${PIPESTATUS[0]}" >> "$OUT/racecheck.part"
  # every report counted by its sites (kernel, source line of the write and of the read) and shared-memory
  # addresses, so that a report printed first does not stand for the rest; the first 10 reports kept whole
  sites=$(awk '/hazard detected at/ {addr=$0; sub(/.* at __shared__ /, "", addr); sub(/ in block.*/, "", addr)}
    /Write Thread/ {w=$0; sub(/.* at /, "", w); sub(/\+0x[0-9a-f]*/, "", w)}
    /Read Thread/ {r=$0; sub(/.* at /, "", r); sub(/\+0x[0-9a-f]*/, "", r); key="write " w " / read " r;
      n[key]++; if (!(key in lo) || addr < lo[key]) lo[key]=addr; if (addr > hi[key]) hi[key]=addr}
    END {for (k in n) printf "   %d x %s, __shared__ %s-%s\n", n[k], k, lo[k], hi[k]}' "$OUT/racecheck.part")
  awk '/hazard detected at/ {c++} c <= 10' "$OUT/racecheck.part" >> "$OUT/racecheck.txt"
  grep -E 'RACECHECK SUMMARY|racecheck exit' "$OUT/racecheck.part" >> "$OUT/racecheck.txt"
  { echo "== racecheck $problem: $(grep -c 'hazard detected' "$OUT/racecheck.part") hazard reports;" \
      "$(grep -E 'RACECHECK SUMMARY|racecheck exit' "$OUT/racecheck.part" | tr '\n' ' ')"
    [ -n "$sites" ] && echo "$sites"; } >> "$OUT/racecheck-summary.txt"
done
rm -f "$OUT/racecheck.part"
for f in plain memcheck synccheck; do [ -f "$OUT/$f.txt" ] || continue; echo "== $f"; grep -E "ERROR SUMMARY|exit|FAIL|Error" "$OUT/$f.txt" | tail -6; done
[ -f "$OUT/racecheck-summary.txt" ] && cat "$OUT/racecheck-summary.txt"
exit 0
