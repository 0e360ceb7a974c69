"""Forks test daemons (and other ``hicache`` commands) from one interpreter that has
imported ``hicache serve``'s modules.

    python daemon_zygote.py HICACHE FD

A test run starts ~100 daemons; each ``hicache serve`` spent ~2.5 s of a core importing
torch before it did anything, and the machines CI runs on have two cores. This process
does those imports once, then serves requests on the socket ``FD`` (from
:mod:`daemon_util`): each request forks a child that becomes the command as the console
script ``HICACHE`` would have run it — its arguments, environment, working directory,
stdout and stderr to the files named, descriptors 0-2 and no others, default signal
handlers — and exits the way that script does (``sys.exit(main())``, so atexit handlers
and finalizers run). Children are reaped here and their exit codes sent back (negative:
the signal that ended one, as :class:`subprocess.Popen` says it).

Only the environment at the zygote's start is seen by imports; :mod:`daemon_util` forks
from here only while a daemon's environment differs from that in what hicache reads at
run time (``HICACHE_*``, ``NOTIFY_SOCKET``), and starts the console script otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection, wait

# As the console script's: its own directory first on the path, not tests/.
sys.path[0] = os.path.dirname(sys.argv[1])

import hicache.daemon.cli  # noqa: E402
import hicache.daemon.server  # noqa: E402,F401
import hicache.storage.lmdb_backend  # noqa: E402,F401


def _open_onto(path: str, *fds: int) -> None:
    opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    for fd in fds:
        os.dup2(opened, fd)
    os.close(opened)


def _become_hicache(conn: Connection, wakeup: tuple[int, int], argv: list[str], env: dict[str, str],
                    cwd: str, stdout: str, stderr: str) -> int:
    """In the forked child: what the console script's process would be, then its main."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.close()
    for fd in wakeup:
        os.close(fd)
    if stderr == stdout:  # (one open file, as Popen's stderr=STDOUT)
        _open_onto(stdout, 1, 2)
    else:
        _open_onto(stdout, 1)
        _open_onto(stderr, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    return hicache.daemon.cli.main()


def _reap(conn: Connection) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


def main() -> int:
    conn = Connection(int(sys.argv[2]))
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up fd tells the loop)
    while True:
        ready = wait([conn, wakeup[0]])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)
        _reap(conn)
        if conn not in ready:
            continue
        try:
            request = conn.recv()
        except EOFError:  # the test run is over; its daemons are its own to stop
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return _become_hicache(conn, wakeup, **request)
        conn.send(("started", pid, None))


if __name__ == "__main__":
    sys.exit(main())
