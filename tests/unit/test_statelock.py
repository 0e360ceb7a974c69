"""One daemon per socket and per store."""

import os
import subprocess
import sys

import pytest

from hicache.config import DaemonConfig
from hicache.daemon.statelock import AlreadyRunning, StateLock


def config(tmp_path, socket_dir="run", store="lmdb", disk=True):
    return DaemonConfig.load(overrides={"server.socket": str(tmp_path / socket_dir / "hicache.sock"),
                                        "disk.path": str(tmp_path / store), "disk.enabled": disk})


def test_the_socket_and_the_store_are_each_one_daemons(tmp_path):
    first = StateLock.for_config(config(tmp_path))
    assert oct((tmp_path / "run").stat().st_mode & 0o777) == "0o750"
    assert oct((tmp_path / "lmdb").stat().st_mode & 0o777) == "0o700"
    lock = tmp_path / "lmdb" / "hicache.lock"
    assert lock.read_text().strip() == str(os.getpid()) and oct(lock.stat().st_mode & 0o777) == "0o600"
    for other in (config(tmp_path, store="elsewhere"), config(tmp_path, socket_dir="run2"),
                  config(tmp_path, store="elsewhere", disk=False)):
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}"):
            StateLock.for_config(other)
    # A refused daemon let go of what it had taken: the other store is free.
    StateLock.for_config(config(tmp_path, socket_dir="run4", store="elsewhere")).release()
    StateLock.for_config(config(tmp_path, socket_dir="run3", store="other")).release()  # other state: fine
    first.release()
    StateLock.for_config(config(tmp_path)).release()


def test_a_dead_daemons_lock_is_free(tmp_path):
    code = ("import sys; from hicache.config import DaemonConfig; from hicache.daemon.statelock import StateLock;"
            f"StateLock.for_config(DaemonConfig.load(overrides={{'server.socket': {str(tmp_path / 'hicache.sock')!r},"
            f"'disk.path': {str(tmp_path / 'lmdb')!r}}})); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)  # took the locks and died holding them
    StateLock.for_config(config(tmp_path, socket_dir=".")).release()
