"""Attacks and buggy engines against a real daemon process over its real socket (one
test per reproduction of issue 14). After each: the daemon answers ``health``, ``check``
passes, the victim engine's pages read back byte-exact, and the attacker got a stable
error code, never INTERNAL."""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from daemon_util import HICACHE, ClientEngine, DaemonProcess, RawPeer, clean_daemon, engine_processes, run_hicache
from hicache import fdpass
from hicache.client import CacheClient
from hicache import protocol as p
from hicache.errors import ErrorCode, Unavailable
from hicache.keys import key_self_test
from hicache.spec import KVSpec
from hicache.pools import DeviceLayout
from hicache.shm import SharedBuffer
from tiers_util import SPEC, Engine

PS = SPEC.page_size
SEQ = list(range(100, 100 + 6 * PS))


def error(reply, code: ErrorCode) -> p.Error:
    assert isinstance(reply, p.Error) and reply.code == code, reply
    return reply


def eventually(predicate, what: str, timeout_s: float = 20.0):
    """Poll ``predicate`` until it holds (a bound on waiting, not on how long it took)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


class Victim:
    """An engine holding a locked, loaded path and private pages being written."""

    def __init__(self, endpoint: str) -> None:
        self.engine = ClientEngine(endpoint)
        self.engine.prefill(SEQ)
        self.match = self.engine.client.match(SEQ)
        self.engine.client.lock(self.match.handle)
        self.held = self.engine.client.load(self.match.handle)
        self.private = self.engine.client.alloc(2).tolist()
        for i, page in enumerate(self.private):
            self.engine.engine.write(page, bytes([i + 1]) * 16)
        self.before = [self.engine.engine.read(page) for page in self.private]

    def assert_intact(self) -> None:
        """Its cached pages and private pages hold its bytes; it is still served."""
        self.engine.engine.check(self.engine.ns(), SEQ, self.held.device_pages)
        assert [self.engine.engine.read(page) for page in self.private] == self.before
        again = self.engine.client.match(SEQ)
        assert again.num_device_pages == 6 and not self.engine.client.degraded
        self.engine.engine.check(self.engine.ns(), SEQ, again.device_pages)
        self.engine.client.check()
        assert self.engine.client.health().state == "serving"

    def close(self) -> None:
        self.engine.client.release(self.private)
        self.engine.client.unlock(self.match.handle)
        self.engine.close()


@pytest.fixture
def daemon(tmp_path):
    with clean_daemon(tmp_path) as proc:
        yield proc


@pytest.fixture
def victim(daemon):
    v = Victim(daemon.endpoint)
    yield v
    v.assert_intact()
    v.close()


@pytest.fixture
def raw(daemon):
    peer = RawPeer(daemon.endpoint)
    yield peer
    peer.close()


def test_deep_nesting_anywhere_is_a_bad_request(daemon, victim, raw):
    """~1 KB messages of 1,000 nested arrays or maps: at the top, inside a register's
    spec, inside an unknown field (which the decoder skips on its way to the tag)."""
    session = raw.hello()
    nests = [b"\x91" * 1000 + b"\xc0", b"\x81\xa1k" * 400 + b"\xc0"]
    spec_head = b"\x87\xa2op\xa8register\xa2id\x05\xa7session" + p.encode(session)
    for nest in nests:
        raw.send(nest)
        error(raw.recv(), ErrorCode.INVALID_ARGUMENT)
        raw.send(b"\x83\xa7unknown" + nest + b"\xa2op\xa6health\xa2id\x09")
        error(raw.recv(), ErrorCode.INVALID_ARGUMENT)
        raw.send(spec_head + b"\xa4spec\x81\xa6layers" + nest + b"\xabfingerprint\xc4\x00\xa9key_check\xc4\x00"
                 + b"\xa5pools\x90\xa6in_use\xc4\x00")
        error(raw.recv(), ErrorCode.INVALID_ARGUMENT)
    assert raw.call(p.Health(id=0)).state == "serving"


@pytest.fixture
def ring_fds(monkeypatch):
    """Copies of the counter-ring descriptors clients fetch (a rogue engine keeps them)."""
    kept = []
    fetch = fdpass.fetch

    def keep(*args, **kwargs):
        fd = fetch(*args, **kwargs)
        kept.append(os.dup(fd))
        return fd

    monkeypatch.setattr(fdpass, "fetch", keep)
    yield kept
    for fd in kept:
        os.close(fd)


def test_the_counter_ring_cannot_be_written_by_its_engine(daemon, victim, raw, ring_fds):
    """The ring comes read-only and sealed against any writer but the daemon's mapping;
    a rogue engine can neither scribble on it (even reopened through /proc) nor shrink
    it under the daemon's stamps."""
    rogue = ClientEngine(daemon.endpoint)
    try:
        rogue.prefill(SEQ[: 3 * PS])
        ring = rogue.client.waiter._shared
        with pytest.raises(ValueError):
            ring.array[:8] = 1  # the mapping is read-only
        rw = os.open(f"/proc/self/fd/{ring_fds[-1]}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, ring.nbytes, access=mmap.ACCESS_WRITE)
            with pytest.raises(PermissionError):
                os.write(rw, os.urandom(64))
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
        rogue.prefill(SEQ)  # loads keep stamping the ring
    finally:
        rogue.close()


def test_an_engine_scribbling_over_and_shrinking_its_own_pool_harms_only_itself(daemon, victim):
    rogue = ClientEngine(daemon.endpoint)
    try:
        rogue.prefill(SEQ[: 4 * PS])
        pool = rogue.engine.pool
        fd = rogue.engine.exported.handle.fd
        for _ in range(3):
            pool.buffer.copy_(torch_random(pool.buffer.numel()))  # its own KV: garbage from now on
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)  # sealed: the daemon's copies can never fault
            m = rogue.client.match(SEQ)
            rogue.client.lock(m.handle)
            loaded = rogue.client.load(m.handle)
            for layer in range(SPEC.num_layers):
                rogue.client.wait_layer(loaded.wait, layer, timeout_s=30)
            rogue.client.unlock(m.handle)
            victim.assert_intact()
    finally:
        rogue.close()


def torch_random(n: int):
    import torch

    return torch.from_numpy(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))


def test_only_a_sealed_memory_file_of_the_right_size_is_mapped(daemon, victim, raw, tmp_path):
    engine = Engine(8)
    handle = engine.exported.handle
    try:
        session = raw.hello()

        def register_fd(fd: int) -> p.Reply:
            reply = raw.register(session, [handle.to_dict() | {"token": raw.offer(fd)}])
            os.close(fd)
            return reply

        unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, handle.nbytes)
        error(register_fd(unsealed), ErrorCode.INVALID_ARGUMENT)  # it could be shrunk under us
        unsealable = os.memfd_create("unsealable")
        os.ftruncate(unsealable, handle.nbytes)
        error(register_fd(unsealable), ErrorCode.INVALID_ARGUMENT)
        small = SharedBuffer.create(handle.nbytes // 2)
        error(register_fd(os.dup(small.fd)), ErrorCode.INVALID_ARGUMENT)
        small.close()
        plain = tmp_path / "plain-file"
        plain.write_bytes(b"\0" * handle.nbytes)
        error(register_fd(os.open(plain, os.O_RDWR)), ErrorCode.INVALID_ARGUMENT)
        write_sealed = os.memfd_create("write-sealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(write_sealed, handle.nbytes)
        fcntl.fcntl(write_sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        error(register_fd(write_sealed), ErrorCode.INVALID_ARGUMENT)  # the daemon could not load into it
        error(raw.register(session, [handle.to_dict() | {"token": os.urandom(16)}]), ErrorCode.INVALID_ARGUMENT)
        # Refused every time, the session is as it was: its own pool registers now, once.
        token = raw.offer(handle.fd)
        assert isinstance(raw.register(session, [handle.to_dict() | {"token": token}]), p.RegisterReply)
        hello2 = raw.hello()
        error(raw.register(hello2, [handle.to_dict() | {"token": token}]), ErrorCode.INVALID_ARGUMENT)  # used once
    finally:
        engine.close()


def test_a_pool_is_its_owners(daemon, victim, raw, ring_fds):
    """Another session cannot register the victim's pool (its descriptor reached the
    attacker, e.g. through /proc), nor its own read-only counter ring as a pool."""
    victim_fd = os.open(f"/proc/{os.getpid()}/fd/{victim.engine.engine.exported.handle.fd}", os.O_RDWR)
    handle = victim.engine.engine.exported.handle
    session = raw.hello()
    try:
        error(raw.register(session, [handle.to_dict() | {"token": raw.offer(victim_fd)}]),
              ErrorCode.INVALID_ARGUMENT)
    finally:
        os.close(victim_fd)
    mine = Engine(8)
    try:
        me = raw.session(mine)
        error(raw.call(p.Alloc(id=0, session=me, num_pages=10**6)), ErrorCode.INVALID_ARGUMENT)
        registered = raw.register(raw.hello(), [mine.exported.handle.to_dict()
                                                | {"token": raw.offer(mine.exported.handle.fd)}])
        error(registered, ErrorCode.INVALID_ARGUMENT)  # our own pool, already registered
        # A pool whose descriptor is our own counter ring (read-only, sealed): refused.
        other = Engine(8)
        try:
            client = CacheClient(daemon.endpoint, heartbeat=False)
            client.register(SPEC, [other.exported.handle])
            fake = other.exported.handle.to_dict() | {"nbytes": client.waiter._shared.nbytes}
            error(raw.register(raw.hello(), [fake | {"token": raw.offer(ring_fds[-1])}]),
                  ErrorCode.INVALID_ARGUMENT)
            client.close()
        finally:
            other.close()
    finally:
        mine.close()


def test_node_handles_are_capabilities(daemon, victim, raw):
    """Handles cannot be enumerated or borrowed: small ids, random values and the
    victim's own handle are all UNKNOWN_NODE for another session."""
    attacker = Engine(24)
    try:
        me = raw.session(attacker)
        for guess in [*range(0, 300), *np.random.default_rng(5).integers(1, 2**63, 300).tolist(), -1, 2**63 - 1]:
            error(raw.call(p.Lock(id=0, session=me, node=guess)), ErrorCode.UNKNOWN_NODE)
        for op in (p.Lock, p.Unlock, p.Load):
            error(raw.call(op(id=0, session=me, node=victim.match.handle.node)), ErrorCode.UNKNOWN_NODE)
        # Through its own match the attacker gets its own handle, usable by it alone.
        raw.call(p.Flush(id=0))
        mine = raw.call(p.Match(id=0, session=me, tokens=np.asarray(SEQ, "<i4").tobytes()))
        assert mine.node not in (-1, victim.match.handle.node)
        assert isinstance(raw.call(p.Lock(id=0, session=me, node=mine.node)), p.Ok)
        assert isinstance(raw.call(p.Unlock(id=0, session=me, node=mine.node)), p.Ok)
        error(raw.call(p.Unlock(id=0, session=me, node=mine.node)), ErrorCode.LOCK_UNDERFLOW)
    finally:
        attacker.close()


def test_a_session_id_works_only_on_its_own_connection_and_is_never_logged(daemon, victim, raw):
    sid = victim.engine.client._session
    pages = np.asarray(victim.private, "<i4").tobytes()
    for message in (p.Match(id=0, session=sid, tokens=np.asarray(SEQ, "<i4").tobytes()),
                    p.Lock(id=0, session=sid, node=victim.match.handle.node),
                    p.Unlock(id=0, session=sid, node=victim.match.handle.node),
                    p.Release(id=0, session=sid, pages=pages), p.Alloc(id=0, session=sid, num_pages=1),
                    p.Heartbeat(id=0, session=sid), p.Bye(id=0, session=sid)):
        error(raw.call(message), ErrorCode.UNKNOWN_SESSION)
    victim.assert_intact()  # not ended by the foreign bye, its pages its own
    log = daemon.log.read_text()
    assert str(sid) not in log and f"{sid:x}" not in log and "session #" in log


def _engine_then_wait(conn, endpoint):
    engine = ClientEngine(endpoint)
    engine.prefill(SEQ[: 3 * PS])
    conn.send(("ready", os.getpid()))
    time.sleep(3600)  # killed here


def _daemon_pools(pid: int) -> int:
    """Engine pools the daemon process maps."""
    return sum("memfd:hicache-kv" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_nothing_outlives_its_owner(tmp_path):
    before = _shm()
    daemon = DaemonProcess(tmp_path).start()
    try:
        victim = Victim(daemon.endpoint)
        # An engine that says bye is unmapped at once; one that is killed, at its lease's end.
        polite = ClientEngine(daemon.endpoint)
        polite.prefill(SEQ[: 2 * PS])
        assert _daemon_pools(daemon.proc.pid) == 2
        polite.close()
        assert _daemon_pools(daemon.proc.pid) == 1
        ctx = engine_processes()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_then_wait, args=(child, daemon.endpoint))
        proc.start()
        assert parent.poll(60) and parent.recv()[0] == "ready"
        assert _daemon_pools(daemon.proc.pid) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        eventually(lambda: _daemon_pools(daemon.proc.pid) == 1, "the killed engine's pool unmapped")
        assert victim.engine.client.stats()["sessions"] == 1
        victim.assert_intact()
        assert _shm() == before, _shm() - before
        victim.engine.client.flush()  # on disk, for after the restart
        # A killed daemon leaves nothing in /dev/shm either, and comes back.
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(10)
        daemon.proc = None
        assert _shm() == before, _shm() - before
        daemon.start()
        again = victim.engine.client.match(SEQ)  # reconnects, re-registers, hits disk
        assert again.num_tokens == len(SEQ)
        victim.close()
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]
    assert _shm() == before


def test_one_daemon_per_state_directory(daemon, victim, tmp_path):
    (second,) = run_hicache([HICACHE, "serve", "--config", str(daemon.config)], env={"HICACHE_HOME": str(tmp_path)})
    assert second.returncode == 1
    assert re.search(r"another hicache daemon \(pid %d\) is serving" % daemon.proc.pid, second.stderr), second.stderr
    assert "serving on" not in second.stdout
    # The first still owns its socket: a new engine reaches it.
    newcomer = ClientEngine(daemon.endpoint)
    newcomer.prefill(SEQ)
    assert newcomer.client.stats()["sessions"] == 2
    newcomer.close()


def test_a_refused_register_leaves_the_session_unregistered(daemon, victim, raw):
    engine = Engine(8)
    handle = engine.exported.handle
    try:
        session = raw.hello()
        bad_in_use = np.asarray([3, 99], "<i4").tobytes()
        error(raw.register(session, [handle.to_dict() | {"token": raw.offer(handle.fd)}], in_use=bad_in_use),
              ErrorCode.INVALID_ARGUMENT)
        error(raw.register(session, [handle.to_dict() | {"token": raw.offer(handle.fd)}],
                           in_use=np.asarray([3, 3], "<i4").tobytes()), ErrorCode.INVALID_ARGUMENT)
        error(raw.call(p.Match(id=0, session=session, tokens=b"")), ErrorCode.INVALID_ARGUMENT)
        error(raw.call(p.Alloc(id=0, session=session, num_pages=1)), ErrorCode.INVALID_ARGUMENT)
        assert isinstance(raw.register(session, [handle.to_dict() | {"token": raw.offer(handle.fd)}],
                                       in_use=np.asarray([3], "<i4").tobytes()), p.RegisterReply)
        pages = raw.call(p.Alloc(id=0, session=session, num_pages=7)).pages  # every free page
        assert 3 not in np.frombuffer(pages, "<i4").tolist() and len(pages) == 7 * 4  # page 3 stays in use
    finally:
        engine.close()


def test_pool_handles_naming_memory_are_invalid(daemon, victim, raw):
    """A CUDA IPC handle with zeroed fields, and the old way of naming a pool by a file
    under /dev/shm (over-long, or another's): INVALID_ARGUMENT, never INTERNAL."""
    fields = ("size", "stride", "offset", "device", "handle", "storage_size_bytes", "storage_offset_bytes",
              "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    layout = DeviceLayout.build(SPEC, 8)  # a CUDA pool's description: no memory needed here
    for description in ({k: 0 for k in fields}, {k: b"\0" * 64 for k in fields},
                        {**{k: 0 for k in fields}, "size": [layout.nbytes], "stride": [1], "handle": b"\0" * 64,
                         "ref_counter_handle": b"", "event_handle": b"", "event_sync_required": False}):
        pool = {"kind": "cuda_ipc", "layout": layout.to_dict(), "nbytes": layout.nbytes, "cuda_ipc": description}
        error(raw.register(raw.hello(), [pool]), ErrorCode.INVALID_ARGUMENT)
    for name in ("x" * 300, "hicache-host-1", "../../etc/passwd"):
        pool = {"kind": "shm", "shm_name": name, "layout": layout.to_dict(), "nbytes": layout.nbytes}
        error(raw.register(raw.hello(), [pool]), ErrorCode.INVALID_ARGUMENT)


def test_cuda_ipc_descriptions_are_checked_before_anything_is_opened(daemon, victim, raw):
    """A daemon without CUDA, sent CUDA IPC descriptions (a native pool's and an
    engine-owned pool's) each wrong in one field: refused naming the field — another
    user's reference-counter file PERMISSION_DENIED — /dev/shm left as it was; a sane
    one is refused for want of a device. The victim is untouched (its fixture checks)."""
    from cuda_ipc_util import another_users, description, hostile, ref_counters
    from owned_util import OWNED_SPEC, layer_major

    layout, owned_layout = DeviceLayout.build(SPEC, 8), layer_major(4)
    session = raw.hello()

    def native(cuda: dict) -> p.Reply:
        return raw.register(session, [{"kind": "cuda_ipc", "layout": layout.to_dict(), "nbytes": layout.nbytes,
                                       "cuda_ipc": cuda}])

    def owned(cuda: dict) -> p.Reply:
        buffers = [{"kind": "cuda_ipc", "nbytes": owned_layout.allocations[0].size, "cuda_ipc": cuda}]
        return raw.call(p.Register(id=0, session=session, spec=OWNED_SPEC.to_dict(),
                                   fingerprint=OWNED_SPEC.fingerprint,
                                   key_check=key_self_test(OWNED_SPEC.fingerprint, OWNED_SPEC.page_size), pools=[],
                                   owned={"layout": owned_layout.to_dict(), "buffers": buffers}))

    def refused(reply: p.Reply, code: ErrorCode, words: str) -> None:
        error(reply, code)
        assert words in reply.message, reply.message

    with ref_counters() as files:
        for register, nbytes in ((native, layout.nbytes), (owned, owned_layout.allocations[0].size)):
            cases = hostile(nbytes, files)
            others = another_users(nbytes, files) if os.geteuid() == 0 else None
            sane = description(nbytes, files.file("sane"))
            before = files.snapshot()
            for what, cuda, field in cases:
                refused(register(cuda), ErrorCode.INVALID_ARGUMENT, field)
            if others is not None:
                refused(register(others), ErrorCode.PERMISSION_DENIED, "ref_counter_handle")
            refused(register(sane), ErrorCode.INVALID_ARGUMENT, "no CUDA device")
            assert files.snapshot() == before
    assert raw.call(p.Health(id=0)).state == "serving"


def _memory_kib(pid: int) -> dict[str, int]:
    """A process's VmRSS and VmData, in KiB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if k in ("VmRSS", "VmData")}


def test_a_pool_claiming_2_31_pages_costs_the_daemon_no_memory(daemon, victim, raw):
    """A pool of 2^31 - 2 pages in a sealed memfd that holds none: free to the engine.
    The daemon refuses it ([server].max_pool_pages) before it sizes anything by it —
    its resident memory does not grow — and keeps serving. (Its data segment is capped
    for the test: were the pool's ~12 GiB of bookkeeping allocated after all, that
    would be a MemoryError, not the machine's OOM killer.)"""
    import resource

    pid = daemon.proc.pid
    before = _memory_kib(pid)
    _, hard = resource.prlimit(pid, resource.RLIMIT_DATA)
    resource.prlimit(pid, resource.RLIMIT_DATA, (before["VmData"] * 1024 + (2 << 30), hard))
    layout = DeviceLayout.build(SPEC, (1 << 31) - 2)
    fd = os.memfd_create("hicache-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, layout.nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        pool = {"kind": "memfd", "layout": layout.to_dict(), "nbytes": layout.nbytes, "token": raw.offer(fd)}
        reply = raw.register(raw.hello(), [pool])
    finally:
        os.close(fd)
    error(reply, ErrorCode.INVALID_ARGUMENT)
    assert "[server].max_pool_pages" in reply.message, reply.message
    grown_kib = _memory_kib(pid)["VmRSS"] - before["VmRSS"]
    assert grown_kib < 64 << 10, f"the daemon's resident memory grew by {grown_kib} KiB"
    assert raw.call(p.Health(id=0)).state == "serving"


def test_unregistered_sessions_are_cheap_to_refuse(tmp_path):
    daemon = DaemonProcess(tmp_path, server={"max_unregistered_per_peer": 3, "register_within_s": 0.5}).start()
    raw = RawPeer(daemon.endpoint)
    try:
        victim = Victim(daemon.endpoint)
        for _ in range(3):
            raw.hello()
        error(raw.call(p.Hello(id=0, version=p.PROTOCOL_VERSION)), ErrorCode.RESOURCE_EXHAUSTED)
        assert raw.call(p.Health(id=0)).sessions == 4
        # Heartbeats do not keep an unregistered session: they lapse, and hello works again.
        eventually(lambda: raw.call(p.Health(id=0)).sessions == 1, "unregistered sessions lapsed")
        assert isinstance(raw.call(p.Hello(id=0, version=p.PROTOCOL_VERSION)), p.HelloReply)
        victim.assert_intact()
        victim.close()
    finally:
        raw.close()
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]


def test_degraded_mode_misses_at_once_until_the_daemon_answers_again(tmp_path):
    daemon = DaemonProcess(tmp_path).start()
    engine = ClientEngine(daemon.endpoint, timeout_s=1.0, reconnect_interval_s=0.1)
    try:
        engine.prefill(SEQ)
        engine.client.flush()  # on disk, for after the restart
        daemon.kill()
        calls = []
        real = engine.client._send_locked
        engine.client._send_locked = lambda message: calls.append(message.__struct_config__.tag) or real(message)
        assert engine.client.match(SEQ).handle is None and engine.client.degraded  # this one waited
        assert calls == ["match"]
        for _ in range(6):  # these do not: nothing is sent while the daemon is gone
            assert engine.client.match(SEQ).handle is None
            with pytest.raises(Unavailable):
                engine.client.alloc(1)
        assert calls == ["match"]
        daemon.start()
        eventually(lambda: engine.client._answering.is_set(), "a probe found the daemon back")
        assert engine.client.match(SEQ).num_tokens == len(SEQ) and not engine.client.degraded
        assert calls[1:4] == ["hello", "register", "match"]
    finally:
        engine.close()
        assert daemon.stop() == 0, daemon.log.read_text()[-3000:]


def test_engine_owned_pool_messages_from_a_hostile_peer(daemon, victim, raw):
    """Attach, store, load_into and owned registrations that are wrong in every way get
    their error, and the victim is untouched (its fixture checks it after)."""
    from hicache.engine.kv_pool import export_owned_pool
    from owned_util import OWNED_SPEC, OwnedEngine, layer_major

    owner = OwnedEngine(daemon.endpoint, layer_major(16), name="owned")
    try:
        owner.compute(SEQ[: 2 * OWNED_SPEC.page_size], [1, 2])
        owner.client.store(SEQ[: 2 * OWNED_SPEC.page_size], [1, 2])
        session = raw.hello()
        bad = ErrorCode.INVALID_ARGUMENT
        error(raw.call(p.Store(id=0, session=session, tokens=b"\0" * 8, pages=b"")), bad)  # not registered
        error(raw.call(p.LoadInto(id=0, session=session, node=1, pages=b"")), bad)
        for name in ("", "nobody", "x" * 100_000, "owned\0"):
            error(raw.call(p.Attach(id=0, session=session, name=name)), bad)
        # A spec of the most layers a spec may have, in as many allocations as allowed.
        wide = KVSpec.mha(num_layers=4096, num_kv_heads=1, head_dim=8, page_size=1, dtype="uint8", layout="x")
        bb = wide.page_bytes(0)
        allocations = [{"size": 4 * bb * 4, "layers": list(range(i * 4, i * 4 + 4)), "layer_stride": 2 * bb,
                        "block_stride": bb} for i in range(1024)]
        exported = export_owned_pool(layer_major(4))
        try:
            for owned in (
                {"layout": {"spec": wide.to_dict(), "num_blocks": 2, "block_bytes": bb, "allocations": allocations},
                 "buffers": [{"kind": "memfd", "nbytes": 4 * bb * 4, "token": b"t" * 16}] * 1024},
                {"layout": {"spec": OWNED_SPEC.to_dict(), "num_blocks": 1 << 40, "block_bytes": 1,
                            "allocations": []}, "buffers": []},
                {"layout": {"spec": OWNED_SPEC.to_dict(), "num_blocks": 4, "block_bytes": -1,
                            "allocations": [{"size": 1 << 62, "layers": [0, 1, 2], "layer_stride": 1 << 61,
                                             "block_stride": 1 << 60}]},
                 "buffers": [{"kind": "memfd", "nbytes": 1 << 62, "token": raw.offer(exported.handle.buffers[0].fd)}]},
            ):
                spec = KVSpec.from_dict(owned["layout"]["spec"])
                reply = raw.call(p.Register(id=0, session=session, spec=spec.to_dict(), fingerprint=spec.fingerprint,
                                            key_check=key_self_test(spec.fingerprint, spec.page_size), pools=[],
                                            owned=owned))
                error(reply, bad)
            # A pool's KV events and token-count switches take a bool and nothing else.
            junk = ("no", 0, None, [False], {"off": True}, b"\0", 2**64 - 1)
            for switch, value in [("kv_events", v) for v in junk] + [("counts_tokens", v) for v in junk]:
                owned = {"layout": layer_major(4).to_dict(), switch: value,
                         "buffers": [{"kind": "memfd", "nbytes": exported.handle.buffers[0].nbytes,
                                      "token": raw.offer(exported.handle.buffers[0].fd)}]}
                reply = raw.call(p.Register(id=0, session=session, spec=OWNED_SPEC.to_dict(),
                                            fingerprint=OWNED_SPEC.fingerprint, pools=[], owned=owned,
                                            key_check=key_self_test(OWNED_SPEC.fingerprint, OWNED_SPEC.page_size)))
                error(reply, bad)
        finally:
            exported.close()
        # The owner's pool, its pages and its name are still there.
        assert owner.client.match(SEQ[: 2 * OWNED_SPEC.page_size]).num_host_pages == 2
    finally:
        owner.close()


def test_a_flood_of_checks_that_never_reads_its_replies(daemon, victim, raw):
    """``check`` reads the store on a thread of its own: 300 of them sent at once, with
    junk between them, cost the daemon one read at a time — the victim is served
    meanwhile (and checked by the fixture) — and each gets its own answer, in order."""
    ids = []
    for n in range(300):
        ids.append((1 << 41) + n)
        raw.send(p.encode(p.Check(id=ids[-1])))
        if n % 50 == 0:
            raw.send(b"\xc1" * (n + 1))  # (never valid msgpack: an error reply, id 0)
    assert victim.engine.client.match(SEQ).num_device_pages == 6  # answered while the checks wait
    assert victim.engine.client.health().state == "serving"
    replies = [raw.recv(timeout_s=60.0) for _ in range(300 + 6)]
    checks = [r for r in replies if r.id]
    assert [r.id for r in checks] == ids and all(isinstance(r, p.Ok) for r in checks), checks[:3]
    assert all(isinstance(r, p.Error) and r.code == ErrorCode.INVALID_ARGUMENT for r in replies if not r.id)
