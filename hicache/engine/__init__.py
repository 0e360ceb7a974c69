"""Engine-side helpers: what an engine integrating hicache needs on its side.

The request-row table (with a recurrent-state slot per row for hybrid models), paged slot assignment for extend and decode, the CSR
``kv_indices`` an attention backend reads, and exporting the engine's KV pool to the
daemon (a sealed memfd handed over as a descriptor in CPU mode, CUDA IPC handles on GPUs).
"""

from hicache.engine.kv_pool import ExportedKVPool, export_kv_pool
from hicache.engine.req_to_token import PADDING_ROW, PADDING_SLOT, HybridReqToTokenPool, ReqToTokenPool
from hicache.kernels.kv_indices import KvIndices, build_kv_indices, build_kv_page_indices
from hicache.kernels.slot_alloc import SlotAssignment, alloc_decode, alloc_extend

__all__ = [
    "PADDING_ROW",
    "PADDING_SLOT",
    "HybridReqToTokenPool",
    "ExportedKVPool",
    "KvIndices",
    "ReqToTokenPool",
    "SlotAssignment",
    "alloc_decode",
    "alloc_extend",
    "build_kv_indices",
    "build_kv_page_indices",
    "export_kv_pool",
]
