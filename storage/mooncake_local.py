"""A Mooncake Store on this machine: ``mooncake_master`` and one ``mooncake_client``
holding the store's memory (a storage node of its own, so that objects outlive the
daemons that stored them), TCP, ``P2PHANDSHAKE``, on free loopback ports. For tests,
benchmarks and trying the fleet setup out — a fleet runs the master and its storage
nodes as services (README, "Fleet")."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    """A Mooncake console script: next to this interpreter (a venv), else on ``PATH``."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed (pip install 'hicache[remote]')")
    return found


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


class LocalMooncake:
    """The master (restartable: :meth:`kill_master`, :meth:`start_master`) and a segment
    holder of ``segment_bytes``; logs in ``workdir``. ``lease_ms``: the master's
    default object lease (reads shorter than it; a shorter one lets objects go sooner)."""

    def __init__(self, workdir: Path, segment_bytes: int = 256 << 20, lease_ms: int = 5000) -> None:
        self.workdir = Path(workdir)
        self.segment_bytes = segment_bytes
        self.lease_ms = lease_ms
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
            [binary("mooncake_master"), f"--rpc_port={self.port}", f"--metrics_port={free_port()}",
             f"--default_kv_lease_ttl={self.lease_ms}"], stdout=log, stderr=log, cwd=self.workdir)
        wait_port(self.port, self._master, "mooncake_master")

    def kill_master(self) -> None:
        if self._master is not None:
            self._master.kill()
            self._master.wait()
            self._master = None

    def start_holder(self) -> None:
        log = self._log("mooncake_client.log")
        port = free_port()
        self._holder = subprocess.Popen(
            [binary("mooncake_client"), f"--global_segment_size={self.segment_bytes}",
             f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
             "--host=127.0.0.1", f"--port={port}"], stdout=log, stderr=log, cwd=self.workdir)
        wait_port(port, self._holder, "mooncake_client")

    def client(self, buffer_bytes: int = 16 << 20):
        """A plain Mooncake client of this store (no segment of its own)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, buffer_bytes, "tcp", "", self.master) != 0:
            raise RuntimeError(f"cannot join the Mooncake Store at {self.master}")
        return store

    def wait_segment(self, timeout_s: float = 30.0) -> None:
        """Until a put lands (the holder's segment is mounted on the current master)."""
        store = self.client(1 << 20)
        try:
            deadline = time.monotonic() + timeout_s
            while store.put("hicache-probe", b"x") != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("no segment mounted in the Mooncake Store")
                time.sleep(0.1)
        finally:
            store.close()

    def start(self) -> "LocalMooncake":
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
