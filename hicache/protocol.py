"""The wire protocol: every message hicache's daemon and clients exchange.

msgpack on the wire, through msgspec: each message is a typed ``Struct`` tagged by its
``op`` field, and decoding validates every field's type in C as it parses, so a message
either decodes into exactly one of the types below or is rejected with
:class:`ProtocolError` before anything looks at it. The reference is ``docs/protocol.md``.

Frames: a client's DEALER sends one frame (the encoded request); a REQ socket adds an
empty delimiter, which the server keeps and returns. Every request carries an ``id``
that its reply repeats; replies may come out of order (a load that waits for disk).

Token ids and page ids travel as packed little-endian int32 ``bytes``. Node handles are
integers. Load tickets are ``[slot, generation]`` pairs.

Nested values are typed too: a registration's KV spec, pool handles and counters handle
mirror the ``to_dict()`` of :class:`hicache.spec.KVSpec`,
:class:`hicache.pools.PoolHandle` and :class:`hicache.counters.CountersHandle` field for
field (the same map keys, in the same order: the same bytes on the wire), and
:func:`from_dict` / :func:`as_dict` convert between the two. An optional field a peer
left out stays out (``UNSET``), so the domain type's own default applies.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, Union

import msgspec
from msgspec import UNSET, UnsetType

from hicache.errors import ErrorCode, HicacheError
from hicache.spec import MAX_LAYERS

MAX_CHECKPOINTS = 4096  # checkpoints offered with one insert
PROTOCOL_VERSION = 2  # 2: memfd pools over the descriptor socket, per-session node handles


class ProtocolError(HicacheError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


def monotonic_ns() -> int:
    """The clock of :attr:`Store.deadline_ns` and :attr:`LoadInto.deadline_ns`: the
    host's ``CLOCK_MONOTONIC``, which an engine-owned pool's engine shares with the
    daemon (its blocks are in the daemon's host memory, or on its GPUs)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# gc=False: messages hold only bytes, numbers, strings and plain containers of them — never
# a cycle — so the garbage collector need not track the two or three made per request.
class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True, gc=False):
    id: int


class _Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """A value nested in a request: unknown fields are refused, as in a request."""


class MHALayerMsg(_Part, tag_field="kind", tag="mha"):
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | UnsetType = UNSET
    dtype: str | UnsetType = UNSET
    sliding_window: int | UnsetType = UNSET


class MLALayerMsg(_Part, tag_field="kind", tag="mla"):
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str | UnsetType = UNSET


class StateLayerMsg(_Part, tag_field="kind", tag="state"):
    conv_state_shape: list[int]
    temporal_state_shape: list[int]
    conv_dtype: str | UnsetType = UNSET
    temporal_dtype: str | UnsetType = UNSET


LayerMsg = Union[MHALayerMsg, MLALayerMsg, StateLayerMsg]


class KVSpecMsg(_Part, kw_only=True):
    """``KVSpec.to_dict()``; its values are checked by ``KVSpec.from_dict``."""

    format: int
    page_size: int
    tp_size: int | UnsetType = UNSET
    model: str | UnsetType = UNSET
    layers: Annotated[list[LayerMsg], msgspec.Meta(max_length=MAX_LAYERS)]
    layout: str | UnsetType = UNSET


class PoolLayoutMsg(_Part):
    """``DeviceLayout.to_dict()``."""

    spec: KVSpecMsg
    num_pages: int
    num_state_slots: int | UnsetType = UNSET
    checkpoint_slots: int | UnsetType = UNSET


class CudaIpcMsg(_Part):
    """``hicache.cuda_ipc.export_tensor()``: one CUDA allocation's IPC description."""

    size: list[int]
    stride: list[int]
    offset: int
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str | UnsetType = UNSET  # the GPU's UUID: ``device`` is the engine's index of it (older: absent)


class PoolHandleMsg(_Part):
    """``PoolHandle.to_dict()``: a ``memfd`` pool names the descriptor offered under
    ``token``; a ``cuda_ipc`` pool carries its ``cuda_ipc`` description."""

    kind: Literal["memfd", "cuda_ipc"]
    layout: PoolLayoutMsg
    nbytes: int
    rank: int | UnsetType = UNSET
    token: bytes | UnsetType = UNSET
    cuda_ipc: CudaIpcMsg | None | UnsetType = UNSET


class AllocationMsg(_Part):
    """``hicache.foreign.Allocation.to_dict()`` (vLLM's ``KVCacheTensor``)."""

    size: int
    layers: Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)]
    layer_stride: int
    block_stride: int
    offset: int | UnsetType = UNSET


class ForeignLayoutMsg(_Part):
    """``hicache.foreign.ForeignLayout.to_dict()``: an engine's own block geometry."""

    spec: KVSpecMsg
    num_blocks: int
    block_bytes: int
    allocations: Annotated[list[AllocationMsg], msgspec.Meta(max_length=1024)]


class SharedMemoryMsg(_Part):
    """``hicache.foreign.SharedMemory.to_dict()``: one allocation's memory."""

    kind: Literal["memfd", "cuda_ipc"]
    nbytes: int
    token: bytes | UnsetType = UNSET
    cuda_ipc: CudaIpcMsg | None | UnsetType = UNSET


class OwnedPoolMsg(_Part):
    """An engine-owned pool: its layout, one buffer per allocation, and the name the
    engine's other sessions attach by."""

    layout: ForeignLayoutMsg
    buffers: Annotated[list[SharedMemoryMsg], msgspec.Meta(max_length=1024)]
    name: str | UnsetType = UNSET
    # False: no KV event stream of its own (a TP rank but the first: one engine, one
    # stream); sent only to daemons whose hello says ``owned_kv_events``.
    kv_events: bool | UnsetType = UNSET
    # False: its tokens count in no token figure (a TP rank but the first: the first
    # rank's pool counts them); sent only to daemons whose hello says ``owned_counts_tokens``.
    counts_tokens: bool | UnsetType = UNSET


class Hello(_Request, tag="hello"):
    """``replaces``: the id of the last session this client said hello for, which it
    gave up on (a call not answered in time drops its connection, and any ``bye``
    with it): the daemon ends that session now, as its lease's end would — only if
    this hello comes from the same engine (see :meth:`hicache.daemon.sessions.Sessions.replace`); sent only to
    daemons whose ``hello`` says ``replace_sessions``."""

    version: int
    client: str = ""
    pid: int = 0
    replaces: int | UnsetType = UNSET


class Register(_Request, tag="register"):
    """Register the session's engine: its KV spec, the fingerprint and page-key
    self-test the client computed (the daemon recomputes both), one pool handle per TP
    rank, and pages the engine still uses (after a daemon restart: they stay the
    session's private pages)."""

    session: int
    spec: KVSpecMsg
    fingerprint: bytes
    key_check: bytes
    pools: list[PoolHandleMsg]
    in_use: bytes = b""
    owned: OwnedPoolMsg | UnsetType = UNSET  # an engine-owned pool (then ``pools`` is empty)


class Attach(_Request, tag="attach"):
    """Join the engine-owned pool registered under ``name`` by another session of the
    same user (an engine's scheduler process, beside its worker): match, lock, unlock
    and load_into on it, answered like a ``register``."""

    session: int
    name: str


class Match(_Request, tag="match"):
    session: int
    tokens: bytes
    extra_key: str = ""
    tenant: str | UnsetType = UNSET  # one the session's identity may use; left out: its first


class MatchMany(_Request, tag="match_many"):
    session: int
    tokens: list[bytes]
    extra_key: str = ""
    tenant: str | UnsetType = UNSET


class Lock(_Request, tag="lock"):
    session: int
    node: int


class Unlock(_Request, tag="unlock"):
    session: int
    node: int


class Load(_Request, tag="load"):
    session: int
    node: int
    # A spec with state layers: the engine's device state slot (>= 1) the node's
    # checkpoint is copied into before any layer; 0: none.
    state_slot: int = 0


class Alloc(_Request, tag="alloc"):
    session: int
    num_pages: int


class Insert(_Request, tag="insert"):
    session: int
    tokens: bytes
    pages: bytes
    extra_key: str = ""
    tenant: str | UnsetType = UNSET
    # A spec with state layers: [pages before it, device state slot] per checkpoint
    # offered, page counts ascending; the reply comes once the states are copied.
    checkpoints: Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_CHECKPOINTS)] = []
    # Page counts where a later match may well end (a system prompt's, a turn's end),
    # ascending: kept as node boundaries (an SWA spec keeps the window before each).
    ends: Annotated[list[int], msgspec.Meta(max_length=MAX_CHECKPOINTS)] = []


class Release(_Request, tag="release"):
    session: int
    pages: bytes


class Store(_Request, tag="store"):
    """Engine-owned pools: copy the blocks of the whole pages of ``tokens`` (one block
    id per page, from the first) into the host tier; answered once the engine may reuse
    them. ``deadline_ns`` (:func:`monotonic_ns`; only to a daemon whose hello says
    ``store_deadlines``): when the engine stops waiting and may reuse the blocks — a
    store the daemon receives after it is refused (``TIMEOUT``), and one whose copy
    ends after it caches nothing."""

    session: int
    tokens: bytes
    pages: bytes
    extra_key: str = ""
    tenant: str | UnsetType = UNSET
    deadline_ns: int | UnsetType = UNSET


class LoadInto(_Request, tag="load_into"):
    """Engine-owned pools: copy pages ``first ..`` of a locked node's path into the
    engine's blocks ``pages``, layer by layer. ``unlocked`` (only to a daemon whose
    hello says ``load_unlocked``): the session holds no lock on the node — the daemon
    loads what the path still holds (the load holds it while it copies), in one round
    trip instead of lock, load_into and unlock. ``deadline_ns`` (:func:`monotonic_ns`;
    only to a daemon whose hello says ``load_deadlines``): when the engine stops waiting
    and takes the blocks as loaded with nothing — a load_into the daemon receives after
    it is refused (``TIMEOUT``), and one whose disk reads end after it copies nothing.
    ``copy_deadline_ns`` (likewise; only to a daemon whose hello says ``copy_deadlines``):
    when the engine stops waiting for the layers — one the daemon receives after it is
    refused, and no layer starts copying after it (those not copied fail on the ticket:
    an engine that waits until the ticket is over knows that nothing is written later)."""

    session: int
    node: int
    pages: bytes
    first: int = 0
    unlocked: bool | UnsetType = UNSET
    deadline_ns: int | UnsetType = UNSET
    copy_deadline_ns: int | UnsetType = UNSET


class Heartbeat(_Request, tag="heartbeat"):
    session: int


class Bye(_Request, tag="bye"):
    session: int


class Stats(_Request, tag="stats"):
    pass


class Health(_Request, tag="health"):
    pass


class Flush(_Request, tag="flush"):
    pass


class Check(_Request, tag="check"):
    pass


class Reload(_Request, tag="reload"):
    """Re-read the ``[auth]`` section of the daemon's configuration file (what SIGHUP
    does): identities, keys, tenants and quotas. Administrators only."""


class Purge(_Request, tag="purge"):
    """Forget a tenant's cached pages: every namespace of ``tenant`` (whose tenant the
    daemon knows), or the one of ``extra_key`` under it, on every tier and in the remote
    tier's store (every node's copies). Administrators only. What a lock or a transfer
    holds now stays (the reply's ``left_pages``), and so does what the remote tier's
    store could not be asked to remove (``remote_left_namespaces``): purge again."""

    tenant: str
    extra_key: str | UnsetType = UNSET


Request = Union[
    Hello, Register, Attach, Match, MatchMany, Lock, Unlock, Load, Alloc, Insert, Release, Store, LoadInto,
    Heartbeat, Bye, Stats, Health, Flush, Check, Reload, Purge,
]


class _Reply(msgspec.Struct, tag_field="op", kw_only=True, gc=False):
    id: int


class Error(_Reply, tag="error"):
    code: int
    message: str


class Ok(_Reply, tag="ok"):
    pass


class FlushReply(_Reply, tag="flushed"):
    """``flush`` is done: what it wrote, and what is (not) durable now (every spec)."""

    written_pages: int  # pages that reached disk while the flush ran
    on_disk_pages: int
    not_on_disk_pages: int  # cached on device / host only: a crash loses them
    deferred_backups: int  # backups still waiting for host room
    seconds: float


class HelloReply(_Reply, tag="hello"):
    session: int
    version: int
    daemon: str
    lease_s: float
    fd_socket: str = ""  # where CPU pools' descriptors are offered (hicache.fdpass)
    store_deadlines: bool = False  # honours Store.deadline_ns (older daemons: absent, and refuse the field)
    load_unlocked: bool = False  # honours LoadInto.unlocked (likewise)
    load_deadlines: bool = False  # honours LoadInto.deadline_ns (likewise)
    max_message_bytes: int = 0  # the largest request the daemon reads (0: not said)
    replace_sessions: bool = False  # honours Hello.replaces (likewise)
    copy_deadlines: bool = False  # honours LoadInto.copy_deadline_ns (likewise)
    device_uuids: bool = False  # takes CudaIpcMsg.device_uuid (likewise)
    owned_kv_events: bool = False  # takes OwnedPoolMsg.kv_events (likewise)
    owned_counts_tokens: bool = False  # takes OwnedPoolMsg.counts_tokens (likewise)


class CountersMsg(msgspec.Struct, kw_only=True, gc=False):
    """``CountersHandle.to_dict()``: the pool's layer-counter ring (fetched read-only
    by ``token`` on the descriptor socket) and, in GPU mode, its events' IPC handles."""

    token: bytes
    num_slots: int
    num_layers: int
    event_handles: list[bytes] | UnsetType = UNSET
    device: int | UnsetType = UNSET
    writer_lock: bool | UnsetType = UNSET  # holds the ring's flock while it may stamp it (older: absent)
    device_uuid: str | UnsetType = UNSET  # the events' GPU: ``device`` is the daemon's index of it (older: absent)
    log_words: int | UnsetType = UNSET  # the outcome log's words after the slots (older: absent, no log)


class RegisterReply(_Reply, tag="register"):
    pool: int
    counters: CountersMsg
    page_size: int
    num_pages: int


class MatchResult(msgspec.Struct, kw_only=True, gc=False):
    node: int
    device_pages: bytes
    host_pages: int
    disk_pages: int
    wait: list[tuple[int, int]]
    remote_pages: int = 0  # of host_pages: just brought from the remote tier for this match


class MatchReply(_Reply, tag="match"):
    node: int
    device_pages: bytes
    host_pages: int
    disk_pages: int
    wait: list[tuple[int, int]]
    remote_pages: int = 0  # of host_pages: just brought from the remote tier for this match


class MatchManyReply(_Reply, tag="match_many"):
    results: list[MatchResult]


class LoadReply(_Reply, tag="load"):
    node: int
    device_pages: bytes
    loaded_pages: int
    wait: list[tuple[int, int]]
    state: bool = False  # the node's checkpoint is in the state slot asked for


class AllocReply(_Reply, tag="alloc"):
    pages: bytes  # empty: cannot now


class InsertReply(_Reply, tag="insert"):
    node: int
    device_pages: bytes  # the canonical pages of every whole page: write them to req_to_token
    freed: bytes  # the caller's duplicates, already returned to the pool
    prefix_pages: int
    checkpoints: int = 0  # checkpoints taken (copied: their slots are the engine's again)


class StoreReply(_Reply, tag="store"):
    node: int  # the stored prefix's deepest node (-1: nothing cached)
    copied: int  # pages copied from the engine's blocks
    cached: int  # leading pages of the tokens now on host (the rest did not fit)


class LoadIntoReply(_Reply, tag="load_into"):
    loaded_pages: int  # pages that land in the first blocks given; the others get nothing
    wait: list[tuple[int, int]]


class TierAccountMsg(msgspec.Struct, kw_only=True, gc=False):
    """Pages of one place by state (``hicache.tiers.TierAccount``)."""

    free: int
    private: int
    cached_evictable: int
    cached_protected: int
    staging: int


class StorageStatsMsg(msgspec.Struct, kw_only=True, gc=False):
    """The store's figures (``hicache.storage.base.StorageStats``)."""

    records: int
    bytes: int
    capacity_bytes: int
    map_size_bytes: int
    corrupt_records: int
    evicted_records: int
    pending_writes: int


# One spec's figures: "device:<pool>" (each registered pool), "host" and "disk" -> the
# place's pages by state; "nodes" -> the tree's node count. (A map, not a struct: the
# device places are named by pool.)
SpecStats = dict[str, Union[TierAccountMsg, int]]


class LossesMsg(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What the daemon lost since it started: the values of its loss counters, the same
    the metrics export (``hicache.metrics``)."""

    pages_dropped: dict[str, int]  # tier -> pages that left the cache from it (hicache_pages_dropped_total)
    # direction (d2h, host_to_disk) -> pages of backups / disk writes that failed
    # (hicache_transfer_failed_pages_total)
    transfer_failed_pages: dict[str, int]
    remote_put_skipped_pages: int  # pages the remote tier never got (hicache_remote_pages_total{op=put,result=skipped})
    sessions_expired: int  # sessions whose lease ran out (hicache_sessions_ended_total{reason=lease_expired})
    kv_events_dropped: int | None = None  # (hicache_kv_events_dropped_total; absent without [events])
    # (hicache_checkpoint_events_total{event=lost}; absent before a spec with state layers)
    checkpoints_lost: int | None = None


class DaemonStats(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    version: str
    uptime_s: float
    sessions: int
    draining: bool
    requests: dict[str, int]  # "<op>/<status>" -> requests answered
    specs: dict[str, SpecStats]  # spec fingerprint (hex) -> its figures
    storage: StorageStatsMsg | None = None  # absent without a disk tier
    # tenant -> {"host_pages", "disk_pages"} cached for it, every spec together
    # ("unattributed": namespaces whose tenant the daemon does not know)
    tenants: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    losses: LossesMsg | None = None  # (absent from older daemons)


class StatsReply(_Reply, tag="stats"):
    stats: DaemonStats


class ReloadReply(_Reply, tag="reload"):
    identities: int  # identities configured now
    sessions_ended: int  # sessions of identities (or keys, users) no longer allowed


class HealthReply(_Reply, tag="health"):
    state: str  # "serving" or "draining"
    sessions: int
    uptime_s: float
    version: str


class PurgeReply(_Reply, tag="purged"):
    namespaces: int  # the tenant's namespaces found (every spec)
    device_pages: int  # pages dropped from pools of hicache's own
    host_pages: int
    disk_pages: int  # records deleted
    remote_pages: int  # pages the remote tier's store removed (whichever node of the fleet put them)
    left_pages: int  # pages of those namespaces still cached: held by a lock or a transfer
    remote_left_namespaces: int = 0  # namespaces the remote tier's store could not be asked to purge now (down)


Reply = Union[
    Error, Ok, FlushReply, HelloReply, RegisterReply, MatchReply, MatchManyReply, LoadReply, AllocReply,
    InsertReply, StoreReply, LoadIntoReply, StatsReply, HealthReply, ReloadReply, PurgeReply,
]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


encode = _encoder.encode  # a message -> bytes (bound: no Python frame on the request path)

_Msg = TypeVar("_Msg", bound=msgspec.Struct)


def from_dict(cls: type[_Msg], data: Mapping[str, Any]) -> _Msg:
    """The wire form of a domain object's ``to_dict()`` (e.g. ``from_dict(KVSpecMsg,
    spec.to_dict())``); :class:`ProtocolError` if it does not fit, as the daemon would
    answer had it been sent."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from None


def as_dict(message: msgspec.Struct) -> dict[str, Any]:
    """A message value as the plain mapping its domain type's ``from_dict`` reads:
    nested values as mappings and lists, bytes as bytes, fields left out left out."""
    return msgspec.to_builtins(message, builtin_types=(bytes,))


def decode_request(data: bytes) -> Request:
    """A request, or :class:`ProtocolError` for anything else — whatever the bytes. The
    decoder checks declared lengths against the bytes present before allocating, and
    nesting is bounded by the interpreter's recursion limit, which skipping a value on
    the way to ``op`` (or an unknown field's) can reach with a message of a few
    kilobytes: that is a bad request too."""
    try:
        return _request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad request: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad request: nested too deeply") from None
    except MemoryError:
        raise ProtocolError("bad request: too large to decode") from None


class _Offered(msgspec.Struct, gc=False):
    token: bytes = b""


class _OwnedOffers(msgspec.Struct, gc=False):
    buffers: list[_Offered] = []


class _RegisterOffers(msgspec.Struct, gc=False):
    op: str = ""
    pools: list[_Offered] = []
    owned: _OwnedOffers | None = None


_offers_decoder = msgspec.msgpack.Decoder(_RegisterOffers)


def register_tokens(data: bytes) -> list[bytes]:
    """The pool tokens a ``register`` that failed to decode names, if they can be read
    (else none), so that the descriptors offered under them go with its refusal."""
    try:
        message = _offers_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, MemoryError):
        return []
    if message.op != "register":
        return []
    buffers = message.owned.buffers if message.owned is not None else []
    return [part.token for part in (*message.pools, *buffers) if part.token]


def decode_reply(data: bytes) -> Reply:
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad reply: {exc}") from None
    except (RecursionError, MemoryError):
        raise ProtocolError("bad reply: nested too deeply or too large") from None


class _Id(msgspec.Struct, gc=False):
    id: int = 0


_id_decoder = msgspec.msgpack.Decoder(_Id)


def request_id(data: bytes) -> int:
    """The ``id`` of a request that failed to decode, if it can be read (else 0), so that
    its error reply still reaches the right waiter."""
    try:
        rid = _id_decoder.decode(data).id
    except (msgspec.DecodeError, RecursionError, MemoryError):
        return 0
    return rid if 0 <= rid < 2**63 else 0


_MAX_PEEK_ITEMS = 4096  # msgpack items peek_request_id walks at most

# msgpack: the bytes after a scalar's type byte (None: the type byte says it all, or a
# length follows that says how many — str, bin, ext, array and map are read below).
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2,
          0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1), 0xd9: (1, 0),
          0xda: (2, 0), 0xdb: (4, 0)}  # type -> (length bytes, bytes after the length before the data)
_INTS = {0xcc: (1, False), 0xcd: (2, False), 0xce: (4, False), 0xcf: (8, False), 0xd0: (1, True), 0xd1: (2, True),
         0xd2: (4, True), 0xd3: (8, True)}


def peek_request_id(data: bytes) -> int:
    """The ``id`` of a request too large to decode, read without decoding it: its
    top-level map's entries are walked — a string or bytes value skipped by its length,
    a nested value item by item, :data:`_MAX_PEEK_ITEMS` items at most — up to ``id``.
    0 when it cannot be found that way (not a map, no ``id`` within the walk, bad bytes)."""
    view = memoryview(data)
    end = len(view)
    pos, budget = 0, _MAX_PEEK_ITEMS

    def header(at: int) -> tuple[int, int, int] | None:
        """``(kind, count or length, position after the header)`` of the item at
        ``at``: kind 0 a scalar (count: bytes to skip), 1 an array, 2 a map."""
        if at >= end:
            return None
        t = view[at]
        at += 1
        if t <= 0x7f or t >= 0xe0:
            return 0, 0, at
        if 0x80 <= t <= 0x8f:
            return 2, t & 0x0f, at
        if 0x90 <= t <= 0x9f:
            return 1, t & 0x0f, at
        if 0xa0 <= t <= 0xbf:
            return 0, t & 0x1f, at
        if t in (0xdc, 0xdd, 0xde, 0xdf):
            width = 2 if t in (0xdc, 0xde) else 4
            if at + width > end:
                return None
            return (1 if t in (0xdc, 0xdd) else 2), int.from_bytes(view[at:at + width], "big"), at + width
        if t in _FIXED:
            return 0, _FIXED[t], at
        if t in _SIZED:
            width, extra = _SIZED[t]
            if at + width > end:
                return None
            return 0, int.from_bytes(view[at:at + width], "big") + extra, at + width
        return None  # 0xc1: never used

    top = header(pos)
    if top is None or top[0] != 2:
        return 0
    _, entries, pos = top
    for _ in range(entries):
        key = header(pos)
        if key is None or key[0] != 0:
            return 0
        key_start = key[2]
        is_id = (view[pos] == 0xa2 and bytes(view[key_start:key_start + 2]) == b"id")
        pos = key_start + key[1]
        if is_id:
            if pos >= end:
                return 0
            t = view[pos]
            if t <= 0x7f:
                return t
            if t not in _INTS or pos + 1 + _INTS[t][0] > end:
                return 0
            width, signed = _INTS[t]
            rid = int.from_bytes(view[pos + 1:pos + 1 + width], "big", signed=signed)
            return rid if 0 <= rid < 2**63 else 0
        pending = 1  # the value, and whatever it nests
        while pending:
            budget -= 1
            item = header(pos)
            if budget < 0 or item is None:
                return 0
            kind, count, pos = item
            pending -= 1
            if kind == 0:
                pos += count
            else:
                pending += count * kind  # an array's items; a map's keys and values
        if pos > end:
            return 0
    return 0
