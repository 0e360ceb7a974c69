"""Running a real daemon process for tests, engines that talk to it, and KV events subscribers."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import zmq

from zmq.utils.monitor import recv_monitor_message

from hicache import fdpass
from hicache.auth import ClientKeys
from hicache.client import CacheClient
from hicache import protocol as p
from hicache.errors import Unavailable
from hicache.keys import key_self_test, namespace_id
from hicache.spec import KVSpec
from kv_event_shapes import BlockStored, decode
from tiers_util import SPEC, Engine

HICACHE = str(Path(sys.executable).parent / "hicache")
ZYGOTE = str(Path(__file__).with_name("daemon_zygote.py"))


@contextmanager
def clean_daemon(tmp_path: Path, **sections: dict) -> Iterator["DaemonProcess"]:
    """A started daemon that, at the end, stops with status 0 (unless the test stopped
    it) and logged no traceback and no internal error — what the hostile-input tests
    hold every daemon to."""
    proc = DaemonProcess(tmp_path, **sections).start()
    yield proc
    if proc.proc is not None:
        assert proc.stop() == 0, proc.log.read_text()[-3000:]
    log = proc.log.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def write_config(directory: Path, **sections: dict) -> Path:
    """A TOML config for a daemon living in ``directory``; ``sections`` override."""
    base = {
        "server": {"socket": str(directory / "hicache.sock"), "lease_s": 1.0, "drain_timeout_s": 20.0},
        "host": {"ratio": 1.0},
        "disk": {"path": str(directory / "lmdb"), "capacity_bytes": 256 * SPEC.host_page_bytes},
        "metrics": {"enabled": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    tables = []  # [[section.key]]: a list of tables, written after the plain keys
    for name, values in base.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
                tables.extend((f"{name}.{key}", v) for v in value)
                continue
            lines.append(f"{key} = {_toml(value)}")
    for name, values in tables:
        lines.append(f"[[{name}]]")
        lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
    path = directory / "hicache.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def scraped(port: int, name: str, **labels: str) -> float:
    """The sum of a daemon's ``/metrics`` samples ``name`` (on 127.0.0.1:``port``) whose
    labels include ``labels``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def io_threads(pid: int | str = "self") -> dict[int, int]:
    """Thread id -> scheduling policy of each ZeroMQ I/O thread of a process (Linux)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if task.joinpath("comm").read_text().startswith("ZMQbg/IO"):
                out[int(task.name)] = os.sched_getscheduler(int(task.name))
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return out


def engine_processes() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for engines in processes of their own: a fork
    server's, its heavy imports (torch, the client library) done once, in the server. A
    spawned child imported them anew, ~2 s each; like a spawned one, a child shares no
    thread, socket or descriptor with the test process."""
    ctx = multiprocessing.get_context("forkserver")
    # (a no-op once the fork server runs: it is one for the whole test run)
    ctx.set_forkserver_preload(["hicache.client", "hicache.engine.kv_pool", "hicache.tree"])
    return ctx


class DaemonProcess:
    """``hicache serve`` in a subprocess."""

    def __init__(self, directory: Path, *, probe: dict | None = None, env: dict | None = None,
                 **sections: dict) -> None:
        """``probe``: how to reach it to see it is up (``endpoint`` and client
        arguments such as CURVE keys; default: its socket, plainly). ``env``: variables
        added to its environment (``NOTIFY_SOCKET``: a socket the test listens on, as
        systemd's)."""
        self.directory = directory
        self.env = dict(env or {})
        self.config = write_config(directory, **sections)
        self.endpoint = f"ipc://{directory / 'hicache.sock'}"
        self.probe = dict(probe or {})
        self.proc: subprocess.Popen | None = None
        self.log = directory / "daemon.log"

    def start(self, timeout_s: float = 30.0) -> "DaemonProcess":
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> "DaemonProcess":
        """Start the process, not waiting for it to serve (:meth:`wait_ready`): daemons
        of separate directories then start side by side. Forked from the zygote (see
        :mod:`daemon_zygote`) when its environment allows, else the console script."""
        env = {**os.environ, "HICACHE_HOME": str(self.directory)}
        env.pop("NOTIFY_SOCKET", None)
        env.update(self.env)
        argv = [HICACHE, "--log-level", "INFO", "serve", "--config", str(self.config)]
        zygote = _Zygote.get()
        if zygote.can_fork(env):
            self.proc = zygote.fork(argv, env, self.log, self.log)
        else:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> "DaemonProcess":
        """Until the launched daemon answers ``health``."""
        deadline = time.monotonic() + timeout_s
        args = {"endpoint": self.endpoint, **self.probe}
        probe = CacheClient(args.pop("endpoint"), timeout_s=0.5, heartbeat=False, **args)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
                try:
                    probe.health()
                    return self
                except Unavailable:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"daemon did not come up:\n{self.log.read_text()}") from None
        finally:
            probe.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout_s)
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def rewrite(self, **sections: dict) -> None:
        """A new config file in place (for a reload)."""
        write_config(self.directory, **sections)


class _Zygote:
    """The test run's :mod:`daemon_zygote`, started at its first daemon and ended with
    the run."""

    _instance: "_Zygote | None" = None
    # What hicache reads from the environment at run time (hicache.config, hicache.auth,
    # the sd_notify socket), and the test pytest names in it: a daemon's may differ
    # from the zygote's there, nowhere else.
    _RUNTIME_PREFIXES = ("HICACHE_", "NOTIFY_SOCKET", "PYTEST_CURRENT_TEST")

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, ZYGOTE, HICACHE, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdout=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._exited: dict[int, int] = {}

    @classmethod
    def get(cls) -> "_Zygote":
        if cls._instance is None:
            cls._instance = cls()
            atexit.register(cls._instance.close)
        return cls._instance

    def can_fork(self, env: dict[str, str]) -> bool:
        if self.proc.poll() is not None:
            return False
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(self._RUNTIME_PREFIXES) for k in differ)

    def fork(self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> "_Forked":
        """``argv`` (a ``hicache`` command) in a child, its output appended to the files."""
        with self._lock:
            self._conn.send({"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(stdout),
                             "stderr": str(stderr)})
            while True:
                kind, pid, code = self._conn.recv()
                if kind == "started":
                    # (an exit recorded under this pid was an earlier child's: the
                    # zygote reports in order, and had reaped it to fork this one)
                    self._exited.pop(pid, None)
                    return _Forked(self, pid)
                self._exited[pid] = code

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        """``pid``'s exit code, waiting up to ``timeout_s`` (None: for good) for it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while pid not in self._exited:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._conn.poll(left):
                    return None
                _, exited, code = self._conn.recv()
                self._exited[exited] = code
            return self._exited[pid]

    def close(self) -> None:
        self._conn.close()
        self.proc.wait(30)


class _Forked:
    """A daemon forked by the zygote: what the tests use of :class:`subprocess.Popen`."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(HICACHE, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (as Popen: never a process that took its pid since)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_hicache(*commands: list[str], timeout_s: float = 60.0,
                env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``hicache`` commands (``[HICACHE, ...]``) run side by side, each to its end, their
    output read as text: forked from the zygote like the daemons, so that each costs no
    import of torch. ``env``: variables added to their environment. Raises
    :class:`subprocess.TimeoutExpired` (a hang guard) when one has not ended within
    ``timeout_s``, the others killed too."""
    env = {**os.environ, **(env or {})}
    zygote = _Zygote.get()
    with tempfile.TemporaryDirectory(prefix="hicache-run-") as tmp:
        outputs = [(Path(tmp) / f"{i}.out", Path(tmp) / f"{i}.err") for i in range(len(commands))]
        if zygote.can_fork(env):
            procs = [zygote.fork(command, env, out, err) for command, (out, err) in zip(commands, outputs)]
        else:
            procs = []
            for command, (out, err) in zip(commands, outputs):
                with open(out, "wb") as stdout, open(err, "wb") as stderr:
                    procs.append(subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env))
        deadline = time.monotonic() + timeout_s
        try:
            codes = [proc.wait(max(0.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        return [subprocess.CompletedProcess(command, code, out.read_text() if out.exists() else "",
                                            err.read_text() if err.exists() else "")
                for command, code, (out, err) in zip(commands, codes, outputs)]


class ClientEngine:
    """An engine with a shared-memory pool, driving the daemon through the client."""

    def __init__(self, endpoint: str, num_pages: int = 24, **client_args) -> None:
        self.engine = Engine(num_pages)
        self.client = CacheClient(endpoint, **client_args)
        try:
            self.client.register(SPEC, [self.engine.exported.handle])
        except BaseException:
            # Closed now: a client left to the collector takes its ZeroMQ context with it,
            # whose term() can then block the test run wherever collection happens.
            self.close()
            raise

    def ns(self, extra_key: str = "") -> bytes:
        return namespace_id(SPEC.fingerprint, extra_key or None)

    def prefill(self, tokens: list[int], extra_key: str = "", *, wait_for_pages: bool = False) -> tuple:
        """match, lock, load, alloc, compute, insert, unlock: one request. Returns the
        match and the insert's canonical pages, after checking every page's bytes.
        ``wait_for_pages``: an allocation the daemon cannot serve yet (backpressure: its
        pages wait for room below) is retried, as an engine's scheduler would."""
        ps = SPEC.page_size
        m = self.client.match(tokens, extra_key)
        self.client.lock(m.handle)
        try:
            loaded = self.client.load(m.handle)
            for layer in range(SPEC.num_layers):
                self.client.wait_layer(loaded.wait, layer, timeout_s=30)
            self.engine.check(self.ns(extra_key), tokens, loaded.device_pages)
            need = len(tokens) // ps - len(loaded.device_pages)
            new = self.client.alloc(need)
            deadline = time.monotonic() + 60
            while new is None and wait_for_pages and time.monotonic() < deadline:
                time.sleep(0.005)
                new = self.client.alloc(need)
            assert new is not None, "the daemon had no pages"
            pages = np.concatenate((loaded.device_pages, new))
            self.engine.compute(self.ns(extra_key), tokens, pages)
            inserted = self.client.insert(tokens, pages, extra_key)
            self.engine.check(self.ns(extra_key), tokens, inserted.device_pages)
        finally:
            self.client.unlock(m.handle)
        return m, loaded, inserted

    def close(self) -> None:
        self.client.close()
        self.engine.close()


class RawPeer:
    """A bare DEALER connection to the daemon, for messages the client library would
    never send. ``session()`` says hello (and registers an engine's pool) on it."""

    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._context = context or zmq.Context()
        self._own_context = context is None
        self.sock = self._context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._ids = 1 << 40

    @property
    def fd_socket(self) -> str:
        return str(fdpass.socket_path_for(self.endpoint[len("ipc://"):]))

    def send(self, payload: bytes) -> None:
        self.sock.send(payload)

    def recv(self, timeout_s: float = 10.0) -> p.Reply:
        assert self.sock.poll(int(timeout_s * 1000)), "the daemon stopped answering"
        return p.decode_reply(self.sock.recv())

    def call(self, message) -> p.Reply:
        self._ids += 1
        message.id = self._ids
        self.send(p.encode(message))
        reply = self.recv()
        assert reply.id == message.id, (reply, message)
        return reply

    def hello(self) -> int:
        reply = self.call(p.Hello(id=0, version=p.PROTOCOL_VERSION, client="raw"))
        assert isinstance(reply, p.HelloReply), reply
        return reply.session

    def register(self, session: int, pools: list[dict], spec: KVSpec = SPEC, in_use: bytes = b"") -> p.Reply:
        return self.call(p.Register(id=0, session=session, spec=spec.to_dict(), fingerprint=spec.fingerprint,
                                    key_check=key_self_test(spec.fingerprint, spec.page_size), pools=pools,
                                    in_use=in_use))

    def offer(self, fd: int) -> bytes:
        return fdpass.offer(self.fd_socket, fd)

    def session(self, engine: Engine) -> int:
        """hello + register ``engine``'s pool on this connection; the session id."""
        session = self.hello()
        handle = engine.exported.handle
        reply = self.register(session, [handle.to_dict() | {"token": self.offer(handle.fd)}])
        assert isinstance(reply, p.RegisterReply), reply
        return session

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_context:
            self._context.term()


_HANDSHAKES = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
               zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused"}


def events_socket(kind: int, endpoint: str, keys: dict | None = None, who: str = "") -> tuple[zmq.Socket, zmq.Socket]:
    """A KV events socket (SUB, subscribed to everything, or a replay DEALER)
    connected to ``endpoint`` (with ``who``'s CURVE key from ``keys``, if any: test_auth's
    fixture), and the monitor that tells how its handshake went (see :func:`handshake`)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if who:
        ClientKeys.load(keys["server"]["public"], keys[who]["secret"]).apply(sock)
    monitor = sock.get_monitor_socket(sum(_HANDSHAKES))
    if kind == zmq.SUB:
        sock.subscribe(b"")
    sock.connect(endpoint)
    return sock, monitor


def handshake(monitor: zmq.Socket) -> str:
    """How the socket's first handshake went: "admitted" or "refused" (a refused
    subscriber can never have received anything)."""
    assert monitor.poll(30_000), "no handshake"
    return _HANDSHAKES[recv_monitor_message(monitor)["event"]]


def token_ids(payloads: list[bytes]) -> set[int]:
    """The token ids of every BlockStored of these batches."""
    return {t for payload in payloads for event in decode(payload).events if isinstance(event, BlockStored)
            for t in event.token_ids}


def replayed(sock: zmq.Socket, topic: str | None = None) -> list[bytes]:
    """The batches still in the ring of the stream of ``topic`` (none: the first stream,
    vLLM's request — a start seq alone); none for a topic no stream has."""
    if topic is None:
        sock.send((0).to_bytes(8, "big"))
    else:
        sock.send_multipart([topic.encode(), (0).to_bytes(8, "big")])
    payloads = []
    while True:
        assert sock.poll(30_000), "no answer from the replay socket"
        frames = sock.recv_multipart()
        if frames[-2] == (-1).to_bytes(8, "big", signed=True):
            return payloads
        payloads.append(frames[-1])
