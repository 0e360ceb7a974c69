"""Sharing CUDA memory between processes (engine -> daemon) with CUDA IPC handles.

Built on torch's own tensor sharing (``torch.multiprocessing.reductions``), which pairs
the ``cudaIpcMemHandle`` of the allocation with a shared reference counter so that the
exporting process keeps the block alive while an importer maps it. We keep only the
plain fields (ints, bytes, bools) so that a handle travels in a msgpack message.

Torch's ``rebuild_cuda_tensor`` trusts every field, and an engine's message is
untrusted input: the daemon checks them all before anything is opened
(:func:`checked`), and right after opening what only the driver knows
(:func:`open_tensor`):

* ``ref_counter_handle``, ``ref_counter_offset``: when the mapping goes, torch opens
  ``/dev/shm/<name>`` (``shm_open``: no symlink followed, nothing created), maps
  :data:`REF_COUNTER_FILE_BYTES` of it — growing a shorter file to that — and
  decrements int64 counter number ``ref_counter_offset`` after a 64-byte header. So the
  name is one entry of /dev/shm, a regular file of the registering user at least that
  long, and the index one of its :data:`REF_COUNTERS` counters. (The engine can put
  another file under that name later, one of its own only: /dev/shm is sticky, and
  ``fs.protected_hardlinks`` keeps it from linking another user's file there.)
* ``storage_size_bytes``, ``storage_offset_bytes``: where the storage lies in the
  allocation the handle opens: non-negative here, and inside the allocation the driver
  reports (``cuMemGetAddressRange``) once opened, before any copy can reach it.
* ``size``, ``stride``, ``offset``: one contiguous run of at least the bytes the pool
  needs, inside the storage.
* ``event_handle``: a 64-byte ``cudaIpcEventHandle_t`` when ``event_sync_required``
  (torch reads 64 bytes of it).
* ``device_uuid`` (optional, absent from older engines): the GPU's UUID. ``device`` is
  the engine's index of it, and the daemon's may differ — an engine started with
  ``CUDA_VISIBLE_DEVICES=3`` calls it ``cuda:0``, a daemon that sees every GPU of the
  node ``cuda:3`` — so the handle is opened on the daemon's index of that UUID
  (:func:`local_device`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hicache.errors import InvalidArgument, PermissionDenied

_FIELDS = (
    "size", "stride", "offset", "device", "handle", "storage_size_bytes", "storage_offset_bytes",
    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
)
_OPTIONAL_FIELDS = ("device_uuid",)
SHM_DIR = Path("/dev/shm")
REF_COUNTERS = 10_000  # torch::CUDA_IPC_REF_COUNTER_FILE_SIZE: the int64 counters of one file
REF_COUNTER_FILE_BYTES = 64 + 8 * REF_COUNTERS  # at::RefcountedMapAllocator's header, then the counters
EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle_t is 64 bytes; torch's expandable-segment form more
_REF_COUNTER_NAME = re.compile(rb"/[A-Za-z0-9._-]{1,255}")  # torch's: /torch_<pid>_<random>_<n>
_I62 = 1 << 62  # sizes and offsets beyond this are nonsense (and would overflow int64 sums)
MAX_UUID_CHARS = 64  # str() of a CUDA UUID: 36, or 40 as "GPU-<uuid>"


def device_uuid(index: int) -> str:
    """What names GPU ``index`` of this process in every process: its UUID, whatever
    ``CUDA_VISIBLE_DEVICES`` makes its index."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device(index: int, uuid: str | None) -> int:
    """This process's index of the GPU another process calls ``index`` and names
    ``uuid`` (:func:`device_uuid`). Without a UUID — a peer older than it — the index
    is taken as it is, which is right only where both processes see the same GPUs.
    Raises ``InvalidArgument`` for a GPU this process does not see."""
    if uuid is None:
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidArgument(f"no CUDA device {index} here")
        return index
    wanted = _same_gpu(uuid)
    for here in range(torch.cuda.device_count()):
        if _same_gpu(device_uuid(here)) == wanted:
            return here
    raise InvalidArgument(f"GPU {uuid} is not visible here")


def _same_gpu(uuid: str) -> str:
    """``uuid`` as every spelling of that GPU's UUID reads: the engine's torch may print
    it otherwise than the daemon's (case, nvidia-smi's ``GPU-`` prefix, dashes)."""
    text = uuid.strip().lower().removeprefix("gpu-")
    try:
        return str(UUID(text))
    except ValueError:  # (not a UUID: compared as it is)
        return text


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A msgpack-able IPC description of a CUDA tensor (keep the tensor alive)."""
    if not tensor.is_cuda:
        raise InvalidArgument("only CUDA tensors have IPC handles")
    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, _, device, handle, storage_size, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    values = (list(size), list(stride), offset, device, handle, storage_size, storage_offset,
              ref_handle, ref_offset, event_handle, event_sync)
    return dict(zip(_FIELDS, values)) | {"device_uuid": device_uuid(device)}


_TYPES = {
    "size": list, "stride": list, "offset": int, "device": int, "handle": bytes, "storage_size_bytes": int,
    "storage_offset_bytes": int, "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": bytes,
    "event_sync_required": bool, "device_uuid": str,
}


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle:
    """A description whose fields make sense (:func:`parse`): a flat byte tensor of
    ``size`` bytes from byte ``offset`` of a storage of ``storage_size_bytes`` bytes,
    which starts at byte ``storage_offset_bytes`` of the allocation ``handle`` opens."""

    size: int
    offset: int
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str | None = None

    @property
    def segment_id(self) -> tuple:
        """What tells one exported allocation (and offset in it) from another."""
        return ("cuda", self.device, self.handle, self.storage_offset_bytes)


def _bad(what: str) -> InvalidArgument:
    return InvalidArgument(f"bad CUDA IPC description: {what}")


def parse(description: Any) -> CudaIpcHandle:
    """Every field present, of its type, and sound on its own. Opens nothing."""
    names = set(description) if isinstance(description, dict) else set()
    if not set(_FIELDS) <= names <= {*_FIELDS, *_OPTIONAL_FIELDS}:
        raise _bad("not a mapping of exactly the fields of export_tensor()")
    for name, kind in _TYPES.items():
        if name not in names:
            continue
        value = description[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _bad(f"{name} has type {type(value).__name__}")
    for name in ("size", "stride"):
        if len(description[name]) != 1 or not all(type(x) is int for x in description[name]):
            raise _bad(f"{name} must be one int (a flat buffer)")
    if description["stride"] != [1]:
        raise _bad(f"stride must be [1] (contiguous bytes), got {description['stride']}")
    fields = {k: description[k] for k in names - {"size", "stride"}}
    h = CudaIpcHandle(size=description["size"][0], **fields)
    for name in ("size", "offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
        if not 0 <= getattr(h, name) < _I62:
            raise _bad(f"{name} must be in [0, 2^62), got {getattr(h, name)}")
    if not h.storage_size_bytes:
        raise _bad("storage_size_bytes must be positive")
    if h.storage_offset_bytes + h.storage_size_bytes > _I62:
        raise _bad("storage_offset_bytes + storage_size_bytes past 2^62")
    if h.offset + h.size > h.storage_size_bytes:
        raise _bad(f"offset {h.offset} + size {h.size} past the storage's {h.storage_size_bytes} bytes "
                   "(storage_size_bytes)")
    if h.device_uuid is not None and not 0 < len(h.device_uuid) <= MAX_UUID_CHARS:
        raise _bad(f"device_uuid must be 1 to {MAX_UUID_CHARS} characters, got {len(h.device_uuid)}")
    if not 0 < len(h.handle) <= MAX_HANDLE_BYTES:
        raise _bad(f"handle must be 1 to {MAX_HANDLE_BYTES} bytes, got {len(h.handle)}")
    if len(h.event_handle) not in (0, EVENT_HANDLE_BYTES) or (
            h.event_sync_required and len(h.event_handle) != EVENT_HANDLE_BYTES):
        raise _bad(f"event_handle must be {EVENT_HANDLE_BYTES} bytes (a cudaIpcEventHandle_t) when "
                   f"event_sync_required, or empty; got {len(h.event_handle)}")
    if h.ref_counter_offset >= REF_COUNTERS:
        raise _bad(f"ref_counter_offset must index one of a file's {REF_COUNTERS} counters, "
                   f"got {h.ref_counter_offset}")
    name = h.ref_counter_handle
    if not _REF_COUNTER_NAME.fullmatch(name) or name in (b"/.", b"/.."):
        raise _bad(f"ref_counter_handle must name one file of {SHM_DIR} as torch does (/<name>), got {name[:64]!r}")
    return h


def _check_ref_counter(h: CudaIpcHandle, uid: int) -> None:
    """The reference-counter file is a regular file of ``uid`` that torch can decrement
    counter ``h.ref_counter_offset`` of without growing it. Opens nothing (``lstat``)."""
    shown = h.ref_counter_handle.decode()
    try:
        st = os.lstat(SHM_DIR / shown[1:])
    except OSError as exc:
        raise _bad(f"ref_counter_handle {shown}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f"ref_counter_handle {shown} is not a regular file")
    if st.st_uid != uid:
        raise PermissionDenied(f"ref_counter_handle {shown} belongs to uid {st.st_uid}, not to the registering "
                               f"user (uid {uid})")
    if st.st_size < REF_COUNTER_FILE_BYTES:
        raise _bad(f"ref_counter_handle {shown} holds {st.st_size} bytes, not the {REF_COUNTER_FILE_BYTES} "
                   "of a torch reference-counter file")


def checked(description: Any, nbytes: int, *, uid: int) -> CudaIpcHandle:
    """Everything that can be checked before the handle is opened: :func:`parse`, at
    least ``nbytes`` bytes (what the pool needs), and a reference-counter file of user
    ``uid`` (the registering engine's). Raises ``InvalidArgument``, or
    ``PermissionDenied`` for another user's file; opens and changes nothing."""
    h = parse(description)
    if h.size < nbytes:
        raise _bad(f"size {h.size} is less than the {nbytes} bytes the pool needs")
    _check_ref_counter(h, uid)
    return h


def segment_id(description: dict[str, Any]) -> tuple:
    """What tells one exported allocation (and offset in it) from another."""
    return parse(description).segment_id


def open_tensor(description: dict[str, Any] | None, nbytes: int, *, uid: int) -> torch.Tensor:
    """Map a tensor exported by :func:`export_tensor` in a process of user ``uid`` (a
    flat uint8 tensor of at least ``nbytes`` bytes): :func:`checked` first, and once
    opened, refused unless its storage lies inside the allocation the handle opened.
    It is opened on this process's index of the engine's GPU (:func:`local_device`)."""
    h = checked(description, nbytes, uid=uid)
    if not torch.cuda.is_available():
        raise InvalidArgument("this daemon has no CUDA device: it cannot map a cuda_ipc pool")
    device = local_device(h.device, h.device_uuid)
    try:
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([h.size]), (1,), h.offset, torch.storage.TypedStorage, torch.uint8, device,
            h.handle, h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required,
        )
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"cannot open the CUDA IPC handle: {exc}") from None
    outside = _outside_allocation(tensor, h, device)
    if outside is not None:
        del tensor  # unmapped (and the engine's counter decremented) now, not whenever the traceback goes
        raise InvalidArgument(outside)
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < nbytes:
        raise InvalidArgument("the CUDA IPC tensor is not the flat byte buffer described")
    return tensor


def _outside_allocation(tensor: torch.Tensor, h: CudaIpcHandle, device: int) -> str | None:
    """Why the opened storage is not inside the allocation the handle mapped on
    ``device`` (the driver's word, not the engine's), or ``None``."""
    storage = tensor.untyped_storage()
    mapped = storage.data_ptr() - h.storage_offset_bytes  # where the handle's allocation was mapped
    base, size = allocation_range(mapped, device)
    if mapped < base or storage.data_ptr() + storage.nbytes() > base + size:
        return (f"bad CUDA IPC description: the storage (bytes {h.storage_offset_bytes} to "
                f"{h.storage_offset_bytes + storage.nbytes()}: storage_offset_bytes, storage_size_bytes) lies "
                f"outside the {size}-byte allocation the handle opens")
    return None


def allocation_range(address: int, device: int) -> tuple[int, int]:
    """``(start, size)`` of the CUDA allocation holding device address ``address``: the
    driver's ``cuMemGetAddressRange``, in ``device``'s primary context (torch's)."""
    cuda = _driver()
    dev, ctx, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    _driver_call("cuInit", cuda.cuInit(0))
    _driver_call("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), device))
    _driver_call("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    try:
        _driver_call("cuCtxPushCurrent", cuda.cuCtxPushCurrent_v2(ctx))
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _driver_call("cuMemGetAddressRange",
                         cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address))
            return base.value, size.value
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise InvalidArgument(f"cannot check a CUDA IPC handle without the CUDA driver: {exc}") from None
    c_int, p_void = ctypes.c_int, ctypes.c_void_p
    signatures = {
        "cuInit": (ctypes.c_uint,),
        "cuDeviceGet": (ctypes.POINTER(c_int), c_int),
        "cuDevicePrimaryCtxRetain": (ctypes.POINTER(p_void), c_int),
        "cuDevicePrimaryCtxRelease_v2": (c_int,),
        "cuCtxPushCurrent_v2": (p_void,),
        "cuCtxPopCurrent_v2": (ctypes.POINTER(p_void),),
        "cuMemGetAddressRange_v2": (ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                    ctypes.c_uint64),
    }
    for name, argtypes in signatures.items():
        function = getattr(cuda, name)
        function.argtypes, function.restype = argtypes, c_int
    return cuda


def _driver_call(name: str, result: int) -> None:
    if result != 0:  # CUDA_SUCCESS
        raise InvalidArgument(f"cannot check the CUDA IPC handle's allocation: {name} failed with CUDA error {result}")
