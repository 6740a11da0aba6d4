#!/usr/bin/env bash
# One GPU session's checks in one call, for a lent GPU machine (see CONTRIBUTING.md, "GPU"):
# the gpu-marked tests, benchmarks/gpu_check.py and the whole suite, each under its own time
# limit, logs under $OUT (or ./gpu_out). Wheels for packages the machine lacks (blinker, Optuna)
# are installed from .whl/ when that folder exists.
#   usage: [STAGES="tests check suite"] [GPU_CHECK_ARGS="--rounds 3"] [GPU_TESTS_S=240] \
#          bash benchmarks/gpu_session.sh [--cpu-dry-run] [gpu_check seconds] [suite seconds]
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY="--cpu-dry-run"; shift; fi
CHECK_S="${1:-240}"
SUITE_S="${2:-200}"
OUT="${OUT:-gpu_out}"
STAGES="${STAGES:-tests check suite}"
has() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# A stage stopped by its time limit says so (its log ends where it was cut, without a total).
# The script exits with the last failing stage's status (0 when every stage passed).
STATUS=0
note_cut() {
    if [ "$1" = 124 ]; then echo "== $2 stopped at its time limit ($3 s): what is above is partial"; fi
    if [ "$1" != 0 ]; then STATUS="$1"; fi
    return 0
}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "$DRY" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=python3
[ -n "$DRY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
$PY - <<'PY'
import importlib.util, shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
# inductor: triton (and a C compiler for its launchers) on CUDA; a C++ compiler for the CPU
# kernels of a compiled optimizer step (the 0-d CPU learning rate, Adam's CPU step counts)
triton = importlib.util.find_spec("triton") is not None
print("triton", __import__("triton").__version__ if triton else "MISSING",
      {name: shutil.which(name) or "MISSING" for name in ("cc", "gcc", "g++")})
PY
XDIST_OK=""
$PY -c "import xdist" 2>/dev/null && XDIST_OK=1
if [ -z "$DRY" ] && has tests; then
    # Six workers: the compiled and captured tests spend most of their time compiling on the
    # CPU (16 cores there); the GPU has room for six processes' small models.
    echo "== pytest -m gpu"
    timeout "${GPU_TESTS_S:-240}" $PY -m pytest -v -p no:cacheprovider -m gpu -rfEs \
        ${XDIST_OK:+-n 6} 2>&1 | tee "$OUT/pytest_gpu.txt" | grep -E "(FAILED|ERROR) |passed|failed" | tail -40
    note_cut "${PIPESTATUS[0]}" "pytest -m gpu" "${GPU_TESTS_S:-240}"
fi
if has check; then
    echo "== gpu_check.py $DRY"
    timeout "$CHECK_S" $PY benchmarks/gpu_check.py $DRY ${GPU_CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.txt" | tail -80
    note_cut "${PIPESTATUS[0]}" "gpu_check.py" "$CHECK_S"
fi
if [ -z "$DRY" ] && has suite; then
    echo "== the whole suite"
    NPROC=$($PY -c "import os; print(min(12, os.cpu_count() or 1))")
    XDIST=""
    [ -n "$XDIST_OK" ] && XDIST="-n $NPROC"
    # -v logs each result as it comes, so failures are known even if the time limit cuts the run
    timeout "$SUITE_S" $PY -m pytest -v -p no:cacheprovider $XDIST -rfE -W ignore 2>&1 \
        | tee "$OUT/suite.txt" | grep -E "(FAILED|ERROR) |passed|failed" | tail -40
    note_cut "${PIPESTATUS[0]}" "the whole suite" "$SUITE_S"
fi
exit "$STATUS"
