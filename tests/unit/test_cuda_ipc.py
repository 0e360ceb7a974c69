"""CUDA IPC descriptions an engine sends: checked field by field before torch opens
anything (torch's ``rebuild_cuda_tensor`` trusts them all). No GPU here: a stand-in for
torch records what would have been opened; tests/gpu checks the allocation bounds."""

import os

import pytest
import torch

from cuda_ipc_util import another_users, description, hostile, ref_counters
from hicache import cuda_ipc
from hicache import protocol as p
from hicache.config import DaemonConfig
from hicache.daemon.service import Daemon
from hicache.errors import ErrorCode
from hicache.fdpass import FdExchange
from hicache.keys import key_self_test
from hicache.pools import DeviceLayout
from hicache.spec import KVSpec
from owned_util import OWNED_SPEC, layer_major
from tiers_util import SPEC, wired

LAYOUT = DeviceLayout.build(SPEC, 8)
OWNED = layer_major(4)


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def daemon(tmp_path):
    made = Daemon(DaemonConfig.load(overrides={"disk.enabled": False, "server.socket": str(tmp_path / "s.sock"),
                                               "host.ratio": 1.0}),
                  clock=Clock(), fds=FdExchange(tmp_path / "fds"))
    yield made
    made.close()


@pytest.fixture
def opened(monkeypatch):
    """A daemon that believes it has one CUDA device; what reached torch's rebuild (which
    raises here, so that a description that gets that far is refused after it)."""
    calls = []

    def rebuild(*args):
        calls.append(args)
        raise RuntimeError("opened by the test's stand-in for torch")

    monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return calls


def register(daemon, spec: KVSpec, *, pools=(), owned=None):
    """A register on the daemon's one session (a refused one leaves it free to try again)."""
    if not hasattr(daemon, "test_session"):
        daemon.test_session = daemon.handle(p.Hello(id=1, version=p.PROTOCOL_VERSION, client="test")).session
    return wired(daemon, p.Register(id=2, session=daemon.test_session, spec=spec.to_dict(),
                                    fingerprint=spec.fingerprint, key_check=key_self_test(spec.fingerprint,
                                                                                          spec.page_size),
                                    pools=list(pools), **({} if owned is None else {"owned": owned})))


def native(cuda: dict) -> dict:
    """register()'s arguments for a pool of hicache's layout in that CUDA memory."""
    return {"spec": SPEC, "pools": [{"kind": "cuda_ipc", "layout": LAYOUT.to_dict(), "nbytes": LAYOUT.nbytes,
                                     "cuda_ipc": cuda}]}


def owned(cuda: dict) -> dict:
    """register()'s arguments for an engine-owned pool of one allocation in it."""
    size = OWNED.allocations[0].size
    return {"spec": OWNED_SPEC, "owned": {"layout": OWNED.to_dict() | {"spec": OWNED_SPEC.to_dict()},
                                         "buffers": [{"kind": "cuda_ipc", "nbytes": size, "cuda_ipc": cuda}]}}


POOLS = {"native": (native, LAYOUT.nbytes), "owned": (owned, OWNED.allocations[0].size)}


def refused(reply, code: ErrorCode, field: str) -> p.Error:
    assert isinstance(reply, p.Error) and reply.code == code, reply
    assert field in reply.message, reply.message
    return reply


@pytest.mark.parametrize("kind", POOLS)
def test_a_sane_description_reaches_torch(daemon, opened, kind):
    make, nbytes = POOLS[kind]
    with ref_counters() as files:
        cuda = description(nbytes, files.file())
        refused(register(daemon, **make(cuda)), ErrorCode.INVALID_ARGUMENT, "cannot open the CUDA IPC handle")
    assert len(opened) == 1
    assert cuda["ref_counter_handle"] in opened[0] and cuda["storage_size_bytes"] in opened[0]


@pytest.mark.parametrize("kind", POOLS)
def test_a_hostile_description_is_refused_before_anything_is_opened(daemon, opened, kind):
    """Each wrong field, alone: refused naming it, torch never called, /dev/shm as it was."""
    make, nbytes = POOLS[kind]
    with ref_counters() as files:
        cases = hostile(nbytes, files)
        before = files.snapshot()
        replies, reached_torch = [], []
        for what, cuda, field in cases:
            replies.append(register(daemon, **make(cuda)))
            if opened:
                reached_torch.append(what)
                opened.clear()
        assert not reached_torch, f"torch was asked to open these {len(reached_torch)} of {len(cases)}"
        for (what, _, field), reply in zip(cases, replies):
            refused(reply, ErrorCode.INVALID_ARGUMENT, field)
        assert files.snapshot() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
@pytest.mark.parametrize("kind", POOLS)
def test_another_users_reference_counter_is_permission_denied(daemon, opened, kind):
    """The daemon decrements a counter in that file when it lets the pool go: never in a
    file of a user other than the registering session's."""
    make, nbytes = POOLS[kind]
    with ref_counters() as files:
        cuda = another_users(nbytes, files)
        before = files.snapshot()
        reply = register(daemon, **make(cuda))
        assert not opened, f"torch was asked to open {opened[-1]}"
        refused(reply, ErrorCode.PERMISSION_DENIED, "ref_counter_handle")
        assert files.snapshot() == before
