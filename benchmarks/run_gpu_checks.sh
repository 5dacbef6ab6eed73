#!/usr/bin/env bash
# On a CUDA machine, in one go: the test-suite (bf16 included, errors recorded per dtype, memory at
# 65,536 tokens), then the benchmark. Everything lands in $OUT/results.tgz, failures also in $OUT/failures.txt
# as they happen (a run cut by its time limit still names them); a short summary prints last.
#   OUT=out bash benchmarks/run_gpu_checks.sh [--quick] [--no-tests] [--no-bench]
#   (TESTS=files to test, KEXPR=a pytest -k expression, WORKERS, TEST_TIMEOUT and BENCH_TIMEOUT seconds, CODEGEN=1:
#   the ahead-of-time compile checks too (left out of a whole-suite run: CPU work that CI does),
#   SPARSE_FLASH_SHARD=i/n: the i-th of n shards of the tests, for a suite split over several calls (n = 6: one
#   shard a call of ~5 minutes);
#   BENCH_RESUME=DIR: a folder holding the bench.jsonl of a benchmark cut short by its time limit (the last call's
#   $OUT/bench.jsonl, carried): its finished groups are kept and the rest is timed)
set -uo pipefail
OUT=${OUT:-gpu-out}
RES=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
export SPARSE_FLASH_ERROR_LOG=$RES/errors.json SPARSE_FLASH_MEMORY_LOG=$RES/memory.json
export SPARSE_FLASH_FAILURE_LOG=$OUT/failures.txt  # each failure as it comes, beside the archive
export SPARSE_FLASH_DURATION_LOG=$OUT/durations.txt  # each test's seconds as it ends (a cut run still shows them)
# compiled kernels kept in the checkout (ignored by git): a second call on the same machine compiles nothing again
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
quick="" tests=1 bench=1
for a in "$@"; do
  case $a in --quick) quick=--quick ;; --no-tests) tests=0 ;; --no-bench) bench=0 ;; esac
done
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python -c "from sparse_flash.kernels import settings; print(settings.current())"  # the kernel switches in force
  date -u +%FT%TZ; } | tee "$RES/env.txt"

if [ $tests = 1 ]; then
  workers=$(python -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}" || echo "")
  select=()
  [ -n "${KEXPR:-}" ] && select=(-k "$KEXPR")  # a -k expression with spaces stays one argument
  # the ahead-of-time compile checks (CPU work, ~350 s of the suite's compiles) run in CI and on any machine with
  # Triton 3.6 (docs/testing.md); on the GPU the real launches compile the kernels. CODEGEN=1 keeps them
  [ -z "${TESTS:-}" ] && [ "${CODEGEN:-0}" != 1 ] && select+=(--ignore=tests/test_codegen.py)
  # a test past 150 s dumps every thread's stack into the log (a hang names itself)
  timeout "${TEST_TIMEOUT:-360}" python -m pytest -q $workers -p no:cacheprovider --durations=15 -o faulthandler_timeout=150 "${select[@]}" ${TESTS:-tests/} > "$RES/pytest.log" 2>&1
  echo "pytest exit code $?" >> "$RES/pytest.log"
  pkill -f "python -m pytest" 2>/dev/null; sleep 1  # workers left by a timeout must not share the GPU with the benchmark
  # the tests' seconds as tests/gpu_seconds.json holds them (the shards' split, conftest.py): after a whole suite
  # run in shards, the shards' durations.txt together make the new file (`conftest.gpu_seconds`)
  [ -f "$OUT/durations.txt" ] && python -c "import json, sys; sys.path.insert(0, 'tests'); from conftest import gpu_seconds
json.dump(gpu_seconds(open(sys.argv[1])), open(sys.argv[2], 'w'), indent=1)" "$OUT/durations.txt" "$OUT/gpu_seconds.json"
fi
if [ $bench = 1 ]; then
  resume=""
  if [ -n "${BENCH_RESUME:-}" ]; then
    mkdir -p "$RES/bench" && cp "$BENCH_RESUME/bench.jsonl" "$RES/bench/" && resume=--resume
  fi
  timeout "${BENCH_TIMEOUT:-420}" python benchmarks/bench_attention.py $quick $resume --out "$RES/bench" > "$RES/bench.log" 2>&1
  echo "bench exit code $?" >> "$RES/bench.log"
  cp "$RES/bench/bench.jsonl" "$OUT/" 2>/dev/null  # beside the archive: a run cut short goes on from it (BENCH_RESUME)
fi
tar czf "$OUT/results.tgz" -C "$RES" .
[ -f "$RES/pytest.log" ] && grep -E "passed|failed|error|exit code" "$RES/pytest.log" | tail -3
[ -f "$OUT/failures.txt" ] && { grep -c "^FAILED" "$OUT/failures.txt"; grep "^FAILED" "$OUT/failures.txt" | head -20; }
[ -f "$OUT/durations.txt" ] && { echo "slowest tests (s):"; sort -rn "$OUT/durations.txt" | head -8; }
[ -f "$RES/bench.log" ] && tail -40 "$RES/bench.log"
exit 0
