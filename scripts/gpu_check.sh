#!/usr/bin/env bash
# GPU checks, for a machine with a CUDA device (never run by CI):
#   - CUDA IPC pool export / import between two processes (a description whose storage
#     reaches past its allocation refused once opened: cuMemGetAddressRange), pinned host pool,
#     interprocess layer events, Triton kernels compiled for real vs their references
#     (pytest -m gpu tests/gpu);
#   - an engine-owned pool (vLLM-shaped layout) in CUDA memory: IPC registration,
#     vLLM-shaped caches shared as the vLLM connector shares them (vllm_kv),
#     store / load_into through a real daemon (tests/gpu too);
#   - H2D / D2H bandwidth of the page kernels next to a plain pinned copy_ of the same
#     bytes (benchmarks/bench_copy.py --device cuda).
# Uses the machine's own torch / triton (a venv with --system-site-packages), installs
# hicache itself without dependencies, so it needs no network. Packages the machine
# lacks come as wheels in .whl/ (scripts/gpu_wheels.sh makes them where pip works).
# On the device tool, from here:
#   scripts/gpu_wheels.sh, then run with carry [".whl"] and the command
#   PYTHONUNBUFFERED=1 scripts/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_CHECK_VENV:-/tmp/hicache-gpu-venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE_PYTHON" -m venv "$VENV"
    # The machine's packages stay visible behind ours. --system-site-packages is not
    # enough: where python3 is itself a venv (the device image's is), a venv made from
    # it sees the base interpreter's packages, not that venv's torch.
    "$BASE_PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine_site.pth"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$VENV/bin/python" -m pip install -q --no-index --no-deps .whl/*.whl
fi
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
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
status=0
"$VENV/bin/python" -m pytest -q -m gpu tests/gpu -p no:cacheprovider || status=$?
"$VENV/bin/python" benchmarks/bench_copy.py --device cuda --pages "${PAGES:-512}" --pool-pages "${POOL_PAGES:-1024}" --json || status=$?
exit $status
