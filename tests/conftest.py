"""Suite-wide set-up.

Triton kernels run on the CPU under the interpreter when there is no CUDA device. The
interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must be set
before any kernel module is imported — which is why it is set here, at collection.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_mooncake() -> None:
    """Skip without Mooncake Store — except under CI, where a missing install step must
    fail loudly (``.ci/run`` installs ``libibverbs1``; ``make test`` the ``remote`` extra)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Mooncake Store is not installed: {exc}")


@pytest.fixture
def mooncake_store(tmp_path):
    """A real Mooncake Store on loopback (:class:`hicache.storage.mooncake_local.LocalMooncake`:
    a master and a segment holder), objects leased 200 ms: tests overwrite them."""
    require_mooncake()
    from hicache.storage.mooncake_local import LocalMooncake

    store = LocalMooncake(tmp_path, lease_ms=200).start()
    yield store
    store.stop()
