#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package registry (the device tool's
# machines): the packages hicache needs that such an image may lack, built for its
# Python. Run here, where pip works; gpu_check.sh installs whatever lies in .whl/.
#   scripts/gpu_wheels.sh                 # Python 3.12 (the device image's)
#   PY_VERSION=3.11 scripts/gpu_wheels.sh
# .whl/ is git-ignored: carry it to the device (run's `carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
# The image has torch, triton, numpy, xxhash and prometheus-client (and pytest,
# hypothesis); the first three are hicache's own needs beyond them, at the versions the
# CPU suite runs with here; setuptools (with bdist_wheel built in) builds the editable
# install without a registry.
PACKAGES=${PACKAGES:-"pyzmq==27.3.0 msgspec==0.23.0 lmdb==3.0.0 setuptools==84.2.1"}
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" -d .whl $PACKAGES
ls -l .whl
