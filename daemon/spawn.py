"""Start ``hicache serve`` as a child process (the demo, the benchmarks)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_daemon(directory: Path, config_toml: str, *, name: str = "hicache", timeout_s: float = 30.0,
                 log_level: str = "WARNING") -> subprocess.Popen:
    """Write ``config_toml`` to ``directory/hicache.toml``, start ``hicache serve`` on it
    (the ``hicache`` next to this Python) and wait until its socket,
    ``directory/hicache.sock`` (the config must say so), exists. Exits with a message
    naming ``name`` if the daemon dies or does not bind in ``timeout_s``."""
    config = directory / "hicache.toml"
    config.write_text(config_toml)
    daemon = subprocess.Popen([str(Path(sys.executable).parent / "hicache"), "--log-level", log_level, "serve",
                               "--config", str(config)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not (directory / "hicache.sock").exists():
        if time.monotonic() > deadline or daemon.poll() is not None:
            daemon.kill()
            raise SystemExit(f"{name}: the daemon did not start")
        time.sleep(0.05)
    return daemon


def stop_daemon(daemon: subprocess.Popen, directory: Path, timeout_s: float = 120.0) -> None:
    """Stop a daemon :func:`start_daemon` started (SIGTERM: its drain and close), wait
    up to ``timeout_s`` for it, and remove ``directory``."""
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout_s)
    shutil.rmtree(directory, ignore_errors=True)
