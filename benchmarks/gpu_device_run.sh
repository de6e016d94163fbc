#!/usr/bin/env bash
# The GPU checks of issue 21 in one prepared run, for a GPU machine with torch, xxhash, fsspec,
# numpy, rich and pytest installed, no network and no virtual environment. From the repo root:
#
#     OUT=/some/dir benchmarks/gpu_device_run.sh [gpu_bench.py options...]
#     PART=tests OUT=... benchmarks/gpu_device_run.sh     # only the tests (about 4 minutes)
#     PART=bench OUT=... benchmarks/gpu_device_run.sh     # only the benchmark (about 6 minutes)
#     PART=quick OUT=... benchmarks/gpu_device_run.sh     # about 8-9 minutes: see below
#
# Each tests/gpu scenario runs in its own python process (a CUDA failure in one cannot hide the
# others; JOBS=8 at a time), then all of them in one process (the acceptance: one process stays
# healthy), then benchmarks/gpu_bench.py. PART=quick runs $QUICK_TESTS (default all of
# tests/gpu, about 2.5 minutes) in one process, then the benchmark's saves (3 repetitions), its
# memory check and training (variants dv25,dv10,dv10w4: 4 whole-run repetitions, whose spread is
# wide, and 8 paired segments each; no DCP training run); options given after it win (e.g.
# --variants dv25,tp25). Under $OUT:
# tests.log (every scenario's output), a summary (one PASS/FAIL/SKIP line per scenario), bench.log
# and bench.json. The exit status is non-zero when a scenario failed or the benchmark did.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the directory for logs and results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1 TIERPOINT_TIMEOUT="${TIERPOINT_TIMEOUT:-120}"
# a step past its time gets SIGTERM (the bench writes its figures and removes its files), and
# SIGKILL this much later: a step stuck on SIGTERM must not hold the unattended run to its end
KILL_AFTER="${KILL_AFTER:-15}"

{
    echo "== $(date -u +%FT%TZ) $(uname -n)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    df -h /dev/shm 2>&1 | tail -1
    # hyperthreads decide whether the worker's copy lanes share the training thread's core
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\))'
} | tee "$OUT/summary"

status=0
PART="${PART:-all}"
if [ "$PART" = quick ]; then
    QUICK_TESTS="${QUICK_TESTS:-tests/gpu}"
    echo "==== $QUICK_TESTS in one process" >>"$OUT/tests.log"
    # shellcheck disable=SC2086  # QUICK_TESTS: one or more pytest paths
    if timeout -k "$KILL_AFTER" "${TESTS_TIMEOUT:-230}" "$PY" -m pytest -q -p no:cacheprovider $QUICK_TESTS \
        >>"$OUT/tests.log" 2>&1; then
        echo "PASS $QUICK_TESTS in one process" | tee -a "$OUT/summary"
    else
        echo "FAIL $QUICK_TESTS in one process" | tee -a "$OUT/summary"
        status=1
    fi
    set -- --reps 3 --parts saves,memory,training --variants dv25,dv10,dv10w4 --train-reps 4 \
        --pairs 8 "$@"
    # what the tests left of 575 s (at least 340: they stop at 230), so that a 590 s device
    # call ends with every figure the benchmark had time for (KILL_AFTER included)
    BENCH_TIMEOUT="${BENCH_TIMEOUT:-$((575 - SECONDS))}"
fi
if [ "$PART" != bench ] && [ "$PART" != quick ]; then
scenarios=$("$PY" -m pytest --collect-only -q -p no:cacheprovider tests/gpu 2>>"$OUT/tests.log" | grep '::')
if [ -z "$scenarios" ]; then
    echo "FAIL collecting tests/gpu (see tests.log)" | tee -a "$OUT/summary"
    status=1
fi
# each scenario in its own process, JOBS at a time (separate processes: no shared CUDA state)
work=$(mktemp -d)
i=0
for node in $scenarios; do
    i=$((i + 1))
    printf '%s %s\n' "$i" "$node"
done | xargs -P "${JOBS:-8}" -L 1 bash -c '
    timeout -k '"$KILL_AFTER"' 300 "$0" -m pytest -q -x -p no:cacheprovider "$2" >"'"$work"'/$1.log" 2>&1
    echo $? >"'"$work"'/$1.rc"' "$PY"
i=0
for node in $scenarios; do
    i=$((i + 1))
    rc=$(cat "$work/$i.rc" 2>/dev/null || echo 1)
    { echo "==== $node"; cat "$work/$i.log"; } >>"$OUT/tests.log"
    case $rc in
        0) grep -q "skipped" <(tail -3 "$work/$i.log") && verdict=SKIP || verdict=PASS ;;
        124) verdict="FAIL (timed out)"; status=1 ;;
        *) verdict="FAIL (exit $rc)"; status=1 ;;
    esac
    echo "$verdict $node" | tee -a "$OUT/summary"
done
rm -rf "$work"

echo "==== all of tests/gpu in one process" >>"$OUT/tests.log"
if timeout -k "$KILL_AFTER" 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu >>"$OUT/tests.log" 2>&1; then
    echo "PASS all of tests/gpu in one process" | tee -a "$OUT/summary"
else
    echo "FAIL all of tests/gpu in one process" | tee -a "$OUT/summary"
    status=1
fi

fi

if [ "$PART" != tests ]; then
echo "==== benchmarks/gpu_bench.py $*" | tee -a "$OUT/summary"
if timeout -k "$KILL_AFTER" "${BENCH_TIMEOUT:-540}" "$PY" benchmarks/gpu_bench.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"; then
    echo "PASS gpu_bench (figures in bench.log, bench.json)" | tee -a "$OUT/summary"
else
    echo "FAIL gpu_bench (see bench.log)" | tee -a "$OUT/summary"
    status=1
fi
fi
ls /dev/shm | grep -i tierpoint >>"$OUT/summary" && echo "(left in /dev/shm, above)" >>"$OUT/summary"
exit $status
