"""Fixtures of the vLLM connector's step tests."""

from __future__ import annotations

import pytest

from daemon_util import DaemonProcess


@pytest.fixture
def daemon(tmp_path):
    """A real daemon (64 MiB of host pages, no disk) for one test."""
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False}).start()
    yield d
    if d.proc is not None:
        d.stop()
