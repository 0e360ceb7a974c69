"""What routers decode from KV events: msgspec structs of vLLM's ``KVEventBatch`` shape
(``vllm/distributed/kv_events.py``) and of Dynamo's consumer (its rank required), and a
router's picture built from them."""

from __future__ import annotations

import msgspec


# vLLM's KVEventBatch (vllm/distributed/kv_events.py), as its subscribers decode it.
class VllmEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(VllmEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(VllmEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VllmEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# Dynamo's consumer (lib/llm/src/kv_router/publisher.rs): the rank is required, unknown keys ignored.
class DynamoStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class DynamoRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class DynamoCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class DynamoBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[DynamoStored | DynamoRemoved | DynamoCleared]
    data_parallel_rank: int


DYNAMO_OF = {BlockStored: DynamoStored, BlockRemoved: DynamoRemoved, AllBlocksCleared: DynamoCleared}


def decode(payload: bytes) -> EventBatch:
    """As vLLM's subscribers decode it; Dynamo's consumer must read the same events."""
    batch = msgspec.msgpack.decode(payload, type=EventBatch, strict=True)
    dynamo = msgspec.msgpack.decode(payload, type=DynamoBatch, strict=True)
    assert (dynamo.ts, dynamo.data_parallel_rank) == (batch.ts, batch.data_parallel_rank)
    assert [type(e) for e in dynamo.events] == [DYNAMO_OF[type(e)] for e in batch.events]
    assert [getattr(e, "block_hashes", None) for e in dynamo.events] == [
        getattr(e, "block_hashes", None) for e in batch.events]
    return batch


def apply(blocks: set[tuple[str, int]], batch: EventBatch) -> None:
    """A router's picture: (medium, block hash) pairs."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            blocks.update((event.medium, h) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks.difference_update((event.medium, h) for h in event.block_hashes)
        else:
            blocks.clear()
