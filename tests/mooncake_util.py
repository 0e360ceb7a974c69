"""A real Mooncake Store on loopback for tests: ``mooncake_master`` and one
``mooncake_client`` holding the memory segment (a storage node of its own, so that the
objects outlive the daemons that stored them), TCP transport, ``P2PHANDSHAKE``.

Without the wheel the tests that need it are skipped — except under CI, where a missing
install step must fail loudly (``.ci/run`` installs ``libibverbs1``; ``make test``
installs the ``remote`` extra)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def require_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Mooncake Store is not installed: {exc}")


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed next to {sys.executable}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


class MooncakeCluster:
    """The master (restartable: :meth:`kill_master`, :meth:`start_master`) and a
    segment holder of ``segment_bytes``."""

    def __init__(self, workdir: Path, segment_bytes: int = 256 << 20) -> None:
        require_mooncake()
        self.workdir = workdir
        self.segment_bytes = segment_bytes
        self.port = free_port()
        self.master = f"127.0.0.1:{self.port}"
        self._master: subprocess.Popen | None = None
        self._holder: subprocess.Popen | None = None
        self._logs: list = []

    def _log(self, name: str):
        f = open(self.workdir / name, "ab")
        self._logs.append(f)
        return f

    def start_master(self) -> None:
        log = self._log("mooncake_master.log")
        self._master = subprocess.Popen(
            [_binary("mooncake_master"), f"--rpc_port={self.port}", f"--metrics_port={free_port()}",
             "--default_kv_lease_ttl=200"], stdout=log, stderr=log, cwd=self.workdir)
        _wait_port(self.port, self._master, "mooncake_master")

    def kill_master(self) -> None:
        if self._master is not None:
            self._master.kill()
            self._master.wait()
            self._master = None

    def start_holder(self) -> None:
        log = self._log("mooncake_client.log")
        port = free_port()
        self._holder = subprocess.Popen(
            [_binary("mooncake_client"), f"--global_segment_size={self.segment_bytes}",
             f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
             "--host=127.0.0.1", f"--port={port}"], stdout=log, stderr=log, cwd=self.workdir)
        _wait_port(port, self._holder, "mooncake_client")

    def wait_segment(self, timeout_s: float = 30.0) -> None:
        """Until a put through a fresh client lands (the holder's segment is mounted)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", self.master) == 0
        try:
            deadline = time.monotonic() + timeout_s
            while store.put("hicache-test-probe", b"x") != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("no segment mounted in the Mooncake Store")
                time.sleep(0.1)
        finally:
            store.close()

    def start(self) -> "MooncakeCluster":
        self.start_master()
        self.start_holder()
        self.wait_segment()
        return self

    def stop(self) -> None:
        for proc in (self._holder, self._master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in self._logs:
            f.close()


@pytest.fixture
def mooncake(tmp_path):
    cluster = MooncakeCluster(tmp_path).start()
    yield cluster
    cluster.stop()
