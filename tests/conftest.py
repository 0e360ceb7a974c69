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
