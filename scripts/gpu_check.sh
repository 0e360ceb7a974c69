#!/usr/bin/env bash
# GPU checks, for a machine with a CUDA device (never run by CI):
#   - CUDA IPC pool export / import between two processes (a description whose storage
#     reaches past its allocation refused once opened: cuMemGetAddressRange), pinned host pool,
#     interprocess layer events, Triton kernels compiled for real vs their references
#     (pytest -m gpu tests/gpu), and the kernel tests' cases compiled for real;
#   - an engine-owned pool (vLLM-shaped layout) in CUDA memory: IPC registration,
#     vLLM-shaped caches shared as the vLLM connector shares them (vllm_kv),
#     store / load_into through a real daemon (tests/gpu too);
#   - H2D / D2H bandwidth of the page kernels next to a plain pinned copy_ of the same
#     bytes, and a layer-wise load's time to first layer as an engine process sees it
#     through the counters' CUDA events (benchmarks/bench_copy.py --device cuda).
# Uses the machine's own torch / triton (a venv with --system-site-packages), installs
# hicache itself without dependencies, so it needs no network. Packages the machine
# lacks come as wheels in .whl/ (scripts/gpu_wheels.sh makes them where pip works).
# Each step is time-boxed (BENCH_TIMEOUT_S, TESTS_TIMEOUT_S, TEST_TIMEOUT_S a test),
# so that the whole script ends well inside a 10-minute lease, and one that fails or
# hangs does not keep the others from running: the benchmark comes first (its figures
# are what an operator needs, whatever the tests say), and a summary of every step,
# with the benchmark's figures, is printed last. Exits non-zero if any step failed.
# GPU_CHECK_STEPS picks steps (default "bench tests kernels"): a rerun after a fix
# within the same lease budget may need one only.
# On the device tool, from here:
#   scripts/gpu_wheels.sh, then run with carry [".whl"] and the command
#   PYTHONUNBUFFERED=1 scripts/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_CHECK_VENV:-/tmp/hicache-gpu-venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-150}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-240}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-150}
KERNELS_TIMEOUT_S=${KERNELS_TIMEOUT_S:-90}
# Which steps to run (a lease is short: a rerun after a fix may need one step only).
STEPS=" ${GPU_CHECK_STEPS:-bench tests kernels} "
PIP=("$VENV/bin/python" -m pip)
if [ ! -x "$VENV/bin/python" ]; then
    # A base Python without ensurepip (Debian's, without python3-venv) makes no venv
    # with pip in it: make one without, and install into it with the base's own pip.
    if ! "$BASE_PYTHON" -m venv "$VENV"; then
        rm -rf "$VENV"
        "$BASE_PYTHON" -m venv --without-pip "$VENV"
    fi
    # The machine's packages stay visible behind ours. --system-site-packages is not
    # enough: where python3 is itself a venv (the device image's is), a venv made from
    # it sees the base interpreter's packages, not that venv's torch.
    "$BASE_PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine_site.pth"
fi
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    PIP=("$BASE_PYTHON" -m pip --python "$VENV/bin/python")
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "${PIP[@]}" install -q --no-index --no-deps .whl/*.whl
fi
"${PIP[@]}" install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
# Every import hicache and its GPU tests need, named when missing (not a traceback
# from the middle of a test).
"$VENV/bin/python" - <<'PY'
import importlib, sys
missing = []
for name in ("torch", "triton", "numpy", "zmq", "msgspec", "lmdb", "xxhash", "prometheus_client",
             "pytest", "hypothesis"):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if missing:
    sys.exit("missing here: " + ", ".join(missing) + " -- carry wheels (scripts/gpu_wheels.sh)")
import torch, triton
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name(0)}")
PY
unset TRITON_INTERPRET
command -v nvidia-smi >/dev/null && nvidia-smi -L || true

# step KEY NAME SECONDS COMMAND...: run one step (if KEY is in GPU_CHECK_STEPS) under
# its time box (its process group killed past it), note how it ended for the summary,
# and go on whatever happened.
status=0
summary=()
step() {
    local key=$1 name=$2 seconds=$3 rc=0
    shift 3
    if [[ $STEPS != *" $key "* ]]; then
        summary+=("$name: not asked for (GPU_CHECK_STEPS)")
        return
    fi
    echo "== $name (at most ${seconds} s)"
    timeout -k 10 "$seconds" "$@" || rc=$?
    case $rc in
        0) summary+=("$name: ok") ;;
        124 | 137) summary+=("$name: TIMED OUT after ${seconds} s"); status=1 ;;
        *) summary+=("$name: FAILED (exit $rc)"); status=1 ;;
    esac
}

export BENCH_LOG
BENCH_LOG=$(mktemp)
step bench "bench_copy --device cuda" "$BENCH_TIMEOUT_S" bash -c '"$@" 2>&1 | tee "$BENCH_LOG"; exit "${PIPESTATUS[0]}"' _ \
    "$VENV/bin/python" benchmarks/bench_copy.py --device cuda --pages "${PAGES:-512}" --pool-pages "${POOL_PAGES:-1024}" --json
# A test that hangs in Python is stopped by pytest-timeout where the machine has it (the
# rest still run); one stuck in a CUDA call, by the step's time box.
per_test=()
if "$VENV/bin/python" -c "import pytest_timeout" 2>/dev/null; then
    per_test=(--timeout "$TEST_TIMEOUT_S")
fi
step tests "pytest -m gpu tests/gpu" "$TESTS_TIMEOUT_S" \
    "$VENV/bin/python" -m pytest -q -rA -m gpu tests/gpu -p no:cacheprovider "${per_test[@]}"

# The kernel tests that put their tensors on the CUDA device when there is one: the
# compiled kernels against their references over the same cases (hypothesis's too) that
# CI runs under the interpreter.
step kernels "kernel tests, compiled" "$KERNELS_TIMEOUT_S" \
    "$VENV/bin/python" -m pytest -q -rfE tests/kernels/test_kv_indices.py tests/kernels/test_slot_alloc.py \
    -p no:cacheprovider "${per_test[@]}"

echo "== summary"
printf '%s\n' "${summary[@]}"
figures=$(grep '^{' "$BENCH_LOG" 2>/dev/null | tail -n 1 || true)
if [ -n "$figures" ]; then
    "$VENV/bin/python" -c 'import json, sys
for key, value in json.loads(sys.argv[1]).items():
    print(f"  {key} = {value:.2f}" if isinstance(value, float) else f"  {key} = {value}")' "$figures"
else
    echo "  (no benchmark figures)"
fi
rm -f "$BENCH_LOG"
exit $status
