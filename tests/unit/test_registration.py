"""``register`` and what the daemon allocates for it: a pool's bookkeeping (its device
allocator's arrays, about 6 bytes a page) is bounded whatever page count an engine
claims — a sparse memfd makes a claim of 2^31 pages cost the engine nothing — and an
engine-owned pool, whose blocks its engine allocates, has none."""

import fcntl
import os
import tracemalloc

import pytest

from hicache import fdpass
from hicache import protocol as p
from hicache.config import DaemonConfig
from hicache.daemon.service import Daemon
from hicache.errors import ErrorCode
from hicache.fdpass import FdExchange
from hicache.keys import key_self_test
from hicache.pages import PageAllocator
from hicache.pools import DeviceLayout
from hicache.shm import SEALS
from hicache.spec import KVSpec
from owned_util import OWNED_SPEC, layer_major
from tiers_util import SPEC, wired

GUARD_PAGES = 1 << 26  # an allocator this large (384 MiB of arrays and more) is recorded, never made


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def make_daemon(tmp_path, **overrides) -> Daemon:
    values = {"disk.enabled": False, "server.socket": str(tmp_path / "s.sock"), "host.bytes": 1 << 20}
    return Daemon(DaemonConfig.load(overrides=values | overrides), clock=Clock(), fds=FdExchange(tmp_path / "fds"))


@pytest.fixture
def daemon(tmp_path):
    made = make_daemon(tmp_path)
    yield made
    made.close()


@pytest.fixture
def allocators(monkeypatch):
    """The page counts the daemon sizes device-pool allocators for (one past
    GUARD_PAGES is refused instead of allocated: this test never takes gigabytes)."""
    sizes = []
    make = PageAllocator.for_device.__func__

    def for_device(cls, num_pages, **kwargs):
        sizes.append(num_pages)
        if num_pages > GUARD_PAGES:
            raise AssertionError(f"a device allocator of {num_pages} pages")
        return make(cls, num_pages, **kwargs)

    monkeypatch.setattr(PageAllocator, "for_device", classmethod(for_device))
    return sizes


class Sparse:
    """A sealed memfd of ``nbytes`` that holds no page yet (what a fresh pool is), offered
    on the daemon's descriptor socket as an engine offers its pool."""

    def __init__(self, daemon: Daemon, nbytes: int) -> None:
        self.fd = os.memfd_create("hicache-test-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        self.token = fdpass.offer(daemon.fds.path, self.fd)

    def close(self) -> None:
        os.close(self.fd)


def register(daemon: Daemon, spec: KVSpec, *, pools=(), owned=None):
    hello = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION, client="test"))
    return wired(daemon, p.Register(id=2, session=hello.session, spec=spec.to_dict(), fingerprint=spec.fingerprint,
                                    key_check=key_self_test(spec.fingerprint, spec.page_size), pools=list(pools),
                                    **({} if owned is None else {"owned": owned})))


def native(daemon: Daemon, num_pages: int, spec: KVSpec = SPEC, **slots) -> tuple[dict, Sparse]:
    layout = DeviceLayout.build(spec, num_pages, **slots)
    segment = Sparse(daemon, layout.nbytes)
    return {"kind": "memfd", "layout": layout.to_dict(), "nbytes": layout.nbytes, "token": segment.token}, segment


def owned(daemon: Daemon, num_blocks: int) -> tuple[dict, Sparse]:
    layout = layer_major(num_blocks)
    segment = Sparse(daemon, layout.allocations[0].size)
    buffer = {"kind": "memfd", "nbytes": layout.allocations[0].size, "token": segment.token}
    return {"layout": layout.to_dict(), "buffers": [buffer]}, segment


def test_a_pool_of_2_31_pages_is_refused_before_its_bookkeeping_is_allocated(daemon, allocators):
    """The page count is the engine's word, and pages it never touches cost it nothing:
    the daemon must not size ~12 GiB of arrays by it."""
    handle, segment = native(daemon, (1 << 31) - 2)  # (the most a device allocator's int32 ids allow)
    try:
        reply = register(daemon, SPEC, pools=[handle])
    finally:
        segment.close()
    assert not allocators, (f"the daemon sized a device allocator for {allocators[0]:,} pages: "
                            f"~{allocators[0] * 6 / 2**30:.0f} GiB of arrays (answered {reply})")
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
    assert "max_pool_pages" in reply.message, reply.message


def test_an_engine_owned_pool_keeps_no_bookkeeping_per_block(daemon, allocators):
    """Its engine allocates its blocks: the daemon keeps no allocator or per-block array
    for them (measured: what Python and numpy allocate while it registers)."""
    first, segment = owned(daemon, 16)  # the spec's tiers, set up by a first pool
    assert isinstance(register(daemon, OWNED_SPEC, owned=first), p.RegisterReply)
    num_blocks = 1 << 22
    big, other = owned(daemon, num_blocks)
    tracemalloc.start()
    try:
        reply = register(daemon, OWNED_SPEC, owned=big)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        segment.close()
        other.close()
    assert isinstance(reply, p.RegisterReply) and reply.num_pages == num_blocks - 1, reply
    assert peak_bytes < num_blocks // 8, f"{peak_bytes:,} bytes allocated to register {num_blocks:,} blocks"
    assert allocators == [], f"device allocators of {allocators} pages for engine-owned pools"


@pytest.mark.parametrize("flag", [1, "false", None, [False], {"x": False}])
def test_counts_tokens_other_than_a_bool_is_refused_and_registers_nothing(daemon, flag):
    handle, segment = owned(daemon, 16)
    try:
        reply = register(daemon, OWNED_SPEC, owned=handle | {"counts_tokens": flag})
    finally:
        segment.close()
    assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
    assert [list(m.pools) for m in daemon.specs.all_managers()] in ([], [[]])


def test_a_pool_that_counts_no_tokens_turns_its_spec_s_token_figures_off(daemon):
    handle, segment = owned(daemon, 16)
    try:
        reply = register(daemon, OWNED_SPEC, owned=handle | {"counts_tokens": False})
    finally:
        segment.close()
    assert isinstance(reply, p.RegisterReply), reply
    (manager,) = daemon.specs.all_managers()
    assert manager.metrics.counts_tokens is False


def test_max_pool_pages_bounds_a_pool_and_the_checkpoint_slots_it_lends(tmp_path):
    from test_checkpoints import SPEC as HYBRID, STATE_SLOTS

    daemon = make_daemon(tmp_path, **{"server.max_pool_pages": 64})
    segments = []
    try:
        for spec, num_pages, slots, fits in ((SPEC, 65, {}, False), (SPEC, 64, {}, True),
                                             (HYBRID, 56, {"checkpoint_slots": 9}, False),
                                             (HYBRID, 56, {"checkpoint_slots": 8}, True)):
            if spec is HYBRID:
                slots["num_state_slots"] = STATE_SLOTS
            handle, segment = native(daemon, num_pages, spec, **slots)
            segments.append(segment)
            reply = register(daemon, spec, pools=[handle])
            if fits:
                assert isinstance(reply, p.RegisterReply) and reply.num_pages == num_pages, reply
            else:
                assert isinstance(reply, p.Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
                assert "at most 64 ([server].max_pool_pages)" in reply.message, reply.message
                assert daemon.fds.take(handle["token"]) is None  # the offer dropped, as for any refusal
    finally:
        for segment in segments:
            segment.close()
        daemon.close()
