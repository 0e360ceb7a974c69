"""Sharing CUDA memory between processes (engine -> daemon) with CUDA IPC handles.

Built on torch's own tensor sharing (``torch.multiprocessing.reductions``), which pairs
the ``cudaIpcMemHandle`` of the allocation with a shared reference counter so that the
exporting process keeps the block alive while an importer maps it. We keep only the
plain fields (ints, bytes, bools) so that a handle travels in a msgpack message.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hicache.errors import InvalidArgument

_FIELDS = (
    "size", "stride", "offset", "device", "handle", "storage_size_bytes", "storage_offset_bytes",
    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
)


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A msgpack-able IPC description of a CUDA tensor (keep the tensor alive)."""
    if not tensor.is_cuda:
        raise InvalidArgument("only CUDA tensors have IPC handles")
    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, _, device, handle, storage_size, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    values = (list(size), list(stride), offset, device, handle, storage_size, storage_offset,
              ref_handle, ref_offset, event_handle, event_sync)
    return dict(zip(_FIELDS, values))


_TYPES = {
    "size": list, "stride": list, "offset": int, "device": int, "handle": bytes, "storage_size_bytes": int,
    "storage_offset_bytes": int, "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": bytes,
    "event_sync_required": bool,
}


def _checked(description: Any) -> dict[str, Any]:
    """Every field present with its type (an engine's message is untrusted input)."""
    if not isinstance(description, dict) or set(description) != set(_FIELDS):
        raise InvalidArgument("bad CUDA IPC description")
    for name, kind in _TYPES.items():
        value = description[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidArgument(f"bad CUDA IPC description: {name} has type {type(value).__name__}")
    for name in ("size", "stride"):
        if len(description[name]) != 1 or not all(type(x) is int for x in description[name]):
            raise InvalidArgument(f"bad CUDA IPC description: {name} must be one int (a flat buffer)")
    return description


def segment_id(description: dict[str, Any]) -> tuple:
    """What tells one exported allocation (and offset in it) from another."""
    d = _checked(description)
    return ("cuda", d["device"], d["handle"], d["storage_offset_bytes"])


def open_tensor(description: dict[str, Any] | None, nbytes: int) -> torch.Tensor:
    """Map a tensor exported by :func:`export_tensor` in another process (a flat uint8
    tensor of ``nbytes`` bytes)."""
    d = _checked(description)
    if not torch.cuda.is_available():
        raise InvalidArgument("this daemon has no CUDA device: it cannot map a cuda_ipc pool")
    if not 0 <= d["device"] < torch.cuda.device_count():
        raise InvalidArgument(f"no CUDA device {d['device']} here")
    try:
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage,
            torch.uint8, d["device"], d["handle"], d["storage_size_bytes"], d["storage_offset_bytes"], False,
            d["ref_counter_handle"], d["ref_counter_offset"], d["event_handle"], d["event_sync_required"],
        )
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"cannot open the CUDA IPC handle: {exc}") from None
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() < nbytes:
        raise InvalidArgument("the CUDA IPC tensor is not the flat byte buffer described")
    return tensor
