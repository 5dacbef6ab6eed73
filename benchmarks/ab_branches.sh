#!/usr/bin/env bash
# Kernel variants on branches, tested and timed against a base in one GPU call. The GPU machine gets a copy of the
# working tree without git, so the packages are cut here first and carried:
#   bash benchmarks/ab_branches.sh prepare main dq-qregs~1 dq-qregs        (here: _ab/<name>/sparse_flash each)
#   OUT=out ROWS="--row 4,16,16,4096,128,butterfly,false" bash benchmarks/ab_branches.sh run main dq-qregs~1 dq-qregs
#   (on the GPU, with _ab carried: for each variant after the first, its GPU tests (TESTS: one file, or none for a
#   variant whose outputs must equal the base's bit for bit, which the A/B's max diff shows; KEXPR) on the
#   variant's package, then `ab_kernels.py --base-package` of the first against it on ROWS; EXTRA: more ab_kernels
#   arguments; ROW_TIMEOUT: seconds one row may take, compiles included, before the variant's run ends with its
#   stack (default 150: a hung kernel shows as a wait on the device). Each variant's log and results land in
#   $OUT as they come, with a line per step of each row; a summary table prints last)
set -uo pipefail
mode=${1:?prepare or run}
shift
name_of() { echo "$1" | tr '~^/' '---'; }  # a folder name for a git ref
if [ "$mode" = prepare ]; then
  for ref in "$@"; do
    dir=_ab/$(name_of "$ref")
    rm -rf "$dir" && mkdir -p "$dir" && git archive "$ref" sparse_flash | tar -x -C "$dir" || exit 1
    echo "$ref -> $dir/sparse_flash ($(git rev-parse --short "$ref"))"
  done
  exit 0
fi
[ "$mode" = run ] || { echo "mode must be prepare or run, got $mode" >&2; exit 2; }
OUT=${OUT:-ab-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
repo=$PWD
base=_ab/$(name_of "$1")
shift
for ref in "$@"; do
  name=$(name_of "$ref")
  variant=$PWD/_ab/$name
  [ -d "$variant/sparse_flash" ] || { echo "no package for $ref: run prepare first" >&2; continue; }
  # from inside the variant's folder: `python -m` puts the current folder first on the path, so the tests import
  # the variant's package (the file it came from is the log's first line)
  if [ "${TESTS:-}" != none ]; then
    (cd "$variant" && python -c "import sparse_flash; print(sparse_flash.__file__)" && timeout "${TEST_TIMEOUT:-240}" \
      python -m pytest -q -x -p no:cacheprovider --rootdir "$repo" "$repo/${TESTS:-tests/test_gpu.py}" \
      -k "${KEXPR:-hopper}") > "$OUT/tests_$name.txt" 2>&1
    echo "$ref tests: $(head -1 "$OUT/tests_$name.txt"): $(tail -1 "$OUT/tests_$name.txt")" | tee -a "$OUT/summary.txt"
  fi
  (cd benchmarks && PYTHONPATH=$variant timeout "${AB_TIMEOUT:-240}" python ab_kernels.py \
    --base-package "../$base/sparse_flash" --row-timeout "${ROW_TIMEOUT:-150}" ${ROWS:-} ${EXTRA:-} \
    --out "$OUT/ab_$name.json" > "$OUT/ab_$name.txt" 2>&1)
  echo "$ref ab exit $?" | tee -a "$OUT/summary.txt"
  grep -v "^{" "$OUT/ab_$name.txt" | grep -v "^\[" | tail -20 >> "$OUT/summary.txt"
  grep "^\[" "$OUT/ab_$name.txt" | tail -1 | sed "s|^|$ref last step: |" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
