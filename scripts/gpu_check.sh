#!/usr/bin/env bash
# GPU checks, for a machine with a CUDA device (never run by CI):
#   - CUDA IPC pool export / import between two processes, pinned host pool,
#     interprocess layer events, Triton kernels compiled for real vs their references
#     (pytest -m gpu tests/gpu);
#   - an engine-owned pool (vLLM-shaped layout) in CUDA memory: IPC registration,
#     store / load_into through a real daemon (tests/gpu too);
#   - H2D / D2H bandwidth of the page kernels next to a plain pinned copy_ of the same
#     bytes (benchmarks/bench_copy.py --device cuda).
# Uses the machine's own torch / triton (a venv with --system-site-packages), installs
# hicache itself without dependencies, so it needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_CHECK_VENV:-/tmp/hicache-gpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
"$VENV/bin/python" - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, device {torch.cuda.get_device_name(0)}")
PY
status=0
"$VENV/bin/python" -m pytest -q -m gpu tests/gpu -p no:cacheprovider || status=$?
"$VENV/bin/python" benchmarks/bench_copy.py --device cuda --pages "${PAGES:-512}" --pool-pages "${POOL_PAGES:-1024}" --json || status=$?
exit $status
