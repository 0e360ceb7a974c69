"""CUDA IPC descriptions an engine sends: checked field by field before torch opens
anything (torch's ``rebuild_cuda_tensor`` trusts them all). No GPU here: a stand-in for
torch records what would have been opened; tests/gpu checks the allocation bounds."""

import gc
import os
import types
import weakref

import pytest
import torch

from cuda_ipc_util import VisibleGpus, another_users, description, hostile, ref_counters
from hicache import cuda_ipc
from hicache import protocol as p
from hicache.config import DaemonConfig
from hicache.daemon.service import Daemon, PeerCreds
from hicache.errors import ErrorCode, InvalidArgument, PermissionDenied
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


def test_a_session_whose_user_is_not_known_cannot_register_cuda_memory(daemon, opened):
    """On tcp:// the daemon does not know the engine's Unix user, so it cannot know
    whose reference-counter file it would decrement."""
    identity = daemon.identities.local(os.getuid(), os.getgid())
    daemon.peer_creds = lambda peer: PeerCreds(None, None, None, "tcp://127.0.0.1", identity=identity)
    with ref_counters() as files:
        reply = register(daemon, **native(description(LAYOUT.nbytes, files.file())))
    refused(reply, ErrorCode.PERMISSION_DENIED, "ipc://")
    assert not opened


class Opened:
    """Torch's rebuild stood in for by a CPU tensor over ``storage`` bytes (as torch
    builds it from the description), and the driver by ``allocation`` = (start, size)
    relative to where the handle's allocation was mapped."""

    def __init__(self, monkeypatch, allocation: tuple[int, int]) -> None:
        self.allocation = allocation
        self.tensors = []
        self.devices = []
        self.asked = []
        monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", self.rebuild)
        monkeypatch.setattr(cuda_ipc, "allocation_range", self.allocation_range)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def rebuild(self, cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
                storage_offset_bytes, *rest):
        self.devices.append(device)
        storage = torch.zeros(storage_size_bytes, dtype=torch.uint8)
        self.mapped = storage.data_ptr() - storage_offset_bytes
        tensor = storage.as_strided(size, stride, offset)
        self.tensors.append(weakref.ref(tensor))
        return tensor

    def allocation_range(self, address: int, device: int) -> tuple[int, int]:
        self.asked.append((address, device))
        start, size = self.allocation
        return self.mapped + start, size


def test_an_opened_storage_inside_its_allocation_is_kept(monkeypatch):
    with ref_counters() as files:
        cuda = description(4096, files.file())  # storage: bytes 4096 .. 4096 + 4608 of the allocation
        stand_in = Opened(monkeypatch, (0, 4096 + 4608))
        tensor = cuda_ipc.open_tensor(cuda, 4096, uid=os.getuid())
    assert tensor.shape == (4096,) and tensor.dtype == torch.uint8
    assert stand_in.asked == [(stand_in.mapped, 0)]  # asked where the handle itself was mapped


@pytest.mark.parametrize("allocation", [(0, 4096 + 4607), (1, 4096 + 4608), (0, 4096)],
                         ids=["one byte short", "mapped past its start", "the storage outside it"])
def test_an_opened_storage_outside_its_allocation_is_refused_and_let_go(monkeypatch, allocation):
    """The engine's storage_size_bytes / storage_offset_bytes against the allocation's
    real extent: what reaches past it is refused, and the mapping dropped at once."""
    with ref_counters() as files:
        cuda = description(4096, files.file())
        stand_in = Opened(monkeypatch, allocation)
        with pytest.raises(InvalidArgument, match="outside the .*allocation") as refusal:
            cuda_ipc.open_tensor(cuda, 4096, uid=os.getuid())
    gc.collect()
    assert [ref() for ref in stand_in.tensors] == [None]  # even while the error (and its traceback) lives
    assert "storage_size_bytes" in str(refusal.value)


def test_a_description_is_parsed_into_its_fields():
    with ref_counters() as files:
        cuda = description(4096, files.file())
        h = cuda_ipc.checked(cuda, 4096, uid=os.getuid())
        with pytest.raises(InvalidArgument, match="size 4096 is less than the 4097 bytes"):
            cuda_ipc.checked(cuda, 4097, uid=os.getuid())
        with pytest.raises(PermissionDenied):
            cuda_ipc.checked(cuda, 4096, uid=os.getuid() + 1)
    assert (h.size, h.offset, h.storage_size_bytes, h.storage_offset_bytes) == (4096, 256, 4608, 4096)
    assert h.segment_id == cuda_ipc.segment_id(cuda) == ("cuda", 0, b"h" * 64, 4096)
    for bad in (None, [], {}, cuda | {"size": 4096}, cuda | {"offset": True}, cuda | {"extra": 1}):
        with pytest.raises(InvalidArgument):
            cuda_ipc.parse(bad)


@pytest.mark.parametrize("kind", POOLS)
def test_a_pool_is_opened_on_the_gpu_its_engine_names_whatever_its_index_here(daemon, opened, monkeypatch, kind):
    """The common deployment: the engine runs with CUDA_VISIBLE_DEVICES=3 (its GPU is
    its cuda:0) and the daemon, a sidecar for the node, sees every GPU (that one is its
    cuda:3). The description names the GPU by UUID besides the engine's index, and the
    daemon opens it on its own index of that GPU (before, on its cuda:0: another GPU)."""
    make, nbytes = POOLS[kind]
    gpus = VisibleGpus(monkeypatch)
    with ref_counters() as files:
        cuda = description(nbytes, files.file(), device=0, device_uuid=gpus.uuid(3))
        refused(register(daemon, **make(cuda)), ErrorCode.INVALID_ARGUMENT, "cannot open the CUDA IPC handle")
    assert [args[6] for args in opened] == [3]


def test_an_opened_pools_allocation_is_asked_of_the_gpu_it_was_opened_on(monkeypatch):
    with ref_counters() as files:
        cuda = description(4096, files.file(), device=0, device_uuid=VisibleGpus.uuid(2))
        stand_in = Opened(monkeypatch, (0, 4096 + 4608))
        VisibleGpus(monkeypatch, visible=(1, 2))
        cuda_ipc.open_tensor(cuda, 4096, uid=os.getuid())
    assert stand_in.devices == [1] and stand_in.asked == [(stand_in.mapped, 1)]


@pytest.mark.parametrize("kind", POOLS)
def test_a_gpu_not_visible_to_the_daemon_is_refused_before_anything_is_opened(daemon, opened, monkeypatch, kind):
    """The engine's GPU is outside the daemon's CUDA_VISIBLE_DEVICES: no index of the
    daemon's is that GPU, and its cuda:0 (the engine's index) is another."""
    make, nbytes = POOLS[kind]
    gpus = VisibleGpus(monkeypatch, visible=(0, 1))
    with ref_counters() as files:
        cuda = description(nbytes, files.file(), device=0, device_uuid=gpus.uuid(3))
        refused(register(daemon, **make(cuda)), ErrorCode.INVALID_ARGUMENT, f"GPU {gpus.uuid(3)} is not visible here")
    assert not opened


@pytest.mark.parametrize("spelling", [str.upper, lambda text: "GPU-" + text, lambda text: text.replace("-", "")])
def test_a_gpu_uuid_is_found_however_the_other_process_spells_it(monkeypatch, spelling):
    """The engine's torch may print a GPU's UUID otherwise than the daemon's (upper
    case, nvidia-smi's ``GPU-`` prefix, no dashes): the same GPU all the same. A UUID no
    GPU here has stays refused."""
    VisibleGpus(monkeypatch, visible=(2, 3))
    assert cuda_ipc.local_device(0, spelling(VisibleGpus.uuid(3))) == 1
    with pytest.raises(InvalidArgument, match="not visible here"):
        cuda_ipc.local_device(0, spelling(VisibleGpus.uuid(0)))


@pytest.mark.parametrize("kind", POOLS)
def test_a_description_without_a_gpu_uuid_is_opened_on_its_index(daemon, opened, monkeypatch, kind):
    """An engine older than the UUID: its index, as before (right where both processes
    see the same GPUs)."""
    make, nbytes = POOLS[kind]
    VisibleGpus(monkeypatch)
    with ref_counters() as files:
        refused(register(daemon, **make(description(nbytes, files.file(), device=2))), ErrorCode.INVALID_ARGUMENT,
                "cannot open the CUDA IPC handle")
    assert [args[6] for args in opened] == [2]


def test_an_exported_description_names_its_gpu_by_uuid(monkeypatch):
    gpus = VisibleGpus(monkeypatch, visible=(3,))  # the engine's view: CUDA_VISIBLE_DEVICES=3
    torchs = (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"h" * 64,
              4608, 4096, False, b"/torch_1_2_3", 0, b"e" * 64, True)  # reduce_tensor's arguments of a cuda:0 tensor
    monkeypatch.setattr(cuda_ipc, "reduce_tensor", lambda tensor: (cuda_ipc.rebuild_cuda_tensor, torchs))
    exported = cuda_ipc.export_tensor(types.SimpleNamespace(is_cuda=True))
    assert (exported["device"], exported["device_uuid"]) == (0, gpus.uuid(3))
    assert p.as_dict(p.from_dict(p.CudaIpcMsg, exported)) == exported
    assert cuda_ipc.parse(exported).device_uuid == gpus.uuid(3)
