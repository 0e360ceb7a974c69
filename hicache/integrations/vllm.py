"""vLLM (0.32) KV connector: hicache as the host / disk tier below vLLM's own prefix cache.

Use it with::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "HicacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"hicache.endpoint": "ipc:///run/hicache/hicache.sock"}}'

or ``LLM(..., kv_transfer_config=KVTransferConfig(...))`` with the same fields. Extra
config keys (all optional): ``hicache.endpoint`` (default: the daemon's default socket),
``hicache.timeout_s`` (1.0: how long a call waits for a daemon that may be gone),
``hicache.load_timeout_s`` (5.0: a ``load_into`` that reads disk, then as long again for its layers), ``hicache.pool_name`` (default ``vllm``; the pool is
``<pool_name>-<engine_id>``, under TP ``...-tp<rank>``: what the scheduler attaches by), ``hicache.recompute_on_load_error`` (true: sets vLLM's
``kv_load_failure_policy`` to ``recompute``, so that a short load is recomputed, never a
failed request), ``hicache.server_key`` / ``hicache.key_file`` (CURVE: the daemon's
public key or its ``.key`` file, and this engine's ``.key_secret``; default
``HICACHE_SERVER_KEY`` / ``HICACHE_CLIENT_KEY_FILE``), ``hicache.tenant`` (one of the
identity's tenants; default its first).

How the two sides work (they are separate processes):

* **Worker** (``register_kv_caches``): vLLM allocated its KV cache as one flat buffer per
  ``KVCacheTensor``; on the CPU each is moved into a sealed memfd segment (copied, then
  every layer view rebound onto it at its own offset, so vLLM computes in shared
  memory), on CUDA each is shared by an IPC handle as it is (:mod:`hicache.integrations.vllm_kv`);
  the pool is registered with the daemon as an *engine-owned* pool in vLLM's own layout
  (:mod:`hicache.foreign`), named so the scheduler can attach. On CUDA a step's stores
  wait for vLLM's stream first, and layer waits are stream waits on the daemon's events. After each step
  (``wait_for_save``) it stores the blocks of newly completed whole prompt pages (chunked
  prefill included; generated tokens are not stored): the daemon copies those not yet on host and answers when done. It
  waits, per layer, on the tickets of the loads the scheduler started
  (``wait_for_layer_load``) until the daemon starts no more copies of them, and reports
  blocks whose load fell short or failed (``get_block_ids_with_load_errors``) so that
  vLLM recomputes them — a late one once it is over (:meth:`HicacheConnector._give_up`),
  since the request may end or be preempted and its blocks go to another; a store stops before
  the first such block (it holds what it held before, and the blocks after it were
  computed on top of it), and the scheduler stores those pages again once vLLM has
  recomputed them. vLLM keeps those blocks in its own prefix cache meanwhile (under
  ``recompute`` it evicts nothing), so the scheduler remembers them
  (``update_connector_output``) until a request computes them again, and has a request
  that takes one from vLLM's prefix cache as computed report it too, so that vLLM
  recomputes it rather than read (and hicache store) stale KV. Under vLLM's asynchronous
  scheduling a step is built before the previous step's output comes back, so the
  scheduler also lists the blocks a request counts as computed whose load it has no
  outcome of yet (``check``), and the worker, which ran that load's step already,
  reports those whose load failed (it remembers them until the scheduler has that
  step's output). The store is synchronous
  on purpose: vLLM frees a preempted request's blocks inside ``schedule()`` and may hand
  them at once to a request whose ``update_state_after_alloc`` starts a ``load_into``
  them, before any worker hook runs (``handle_preemptions`` comes later), so a store
  still reading them would cache another prompt's KV. On this CPU a store of 62 fresh
  pages costs the step about 10 ms, 1.4 % of a 2,000-token prefill.
* **Scheduler** (attached to the worker's pool): ``get_num_new_matched_tokens`` matches the
  prompt beyond vLLM's own hit — whole blocks, never the last prompt token — and
  ``update_state_after_alloc`` starts ``load_into`` the blocks vLLM allocated (before
  the forward: a synchronous load, ``load_async=False``) in one round trip, without a
  lock of its own (the load holds the path until it lands; what was evicted since the
  match loads short; a load not answered within ``hicache.load_timeout_s`` is given up,
  its blocks recomputed, and the daemon writes nothing of it later); the tickets travel
  to the worker in the connector metadata, and the loaded pages count as stored (a step
  stores only what hicache lacks).

Tensor parallelism: each TP rank's worker registers a pool of its own,
``<pool_name>-<engine_id>-tp<rank>``, whose spec names the rank's shard (ranks never
share pages); the scheduler attaches to all of them (:class:`RankClients`), matches on
each — a prefix is a hit as far as every rank holds it — and loads on every rank what
the rank that holds least brought. A load's tickets travel per rank; a worker waits on
its own rank's, and reports what any rank failed to bring once its own copies into
those blocks are over. Rank 0's pool speaks for the engine: the others register with
no KV event stream and no token figures (the daemon's hits and misses count each token
once). (Pipeline parallelism: not yet — the connector turns itself off.)

vLLM's ``kv_role`` is honoured: ``kv_producer`` (a prefill instance of a disaggregated
deployment) stores and never matches, ``kv_consumer`` (a decode instance) matches and
loads and never stores, ``kv_both`` does both.

The namespace (``extra_key``) has what else vLLM's own prefix cache keys blocks on: the
cache salt, the LoRA adapter (name and path), the multimodal inputs (identifier and
place) and prompt embeddings (:func:`extra_key_of`); the spec's model identity has what
else changes the KV of one checkpoint: quantization, KV cache dtype, the model's config
and ``hf_overrides`` (:func:`model_identity`). Weights changed in place (a training
loop's update) are the engine's to tell: vLLM's ``reset_prefix_cache(reset_connector=True)``
— which ``pause_generation(clear_cache=True)`` makes — moves the scheduler to a new
cache epoch (:meth:`HicacheConnector.reset_cache`), and nothing stored before is matched
by that engine again.

A daemon that is down or restarting means misses, never a failed or hung request, and
never a scheduler loop or a worker step that waits for it: each side registers
(attaches) once when the engine starts, and if the daemon does not answer, a thread of
the connector retries every second while matches miss and steps store nothing, at once.
A daemon that goes away later costs one call its ``hicache.timeout_s``; then the client
answers at once until the daemon is back, and the worker's thread registers the pool
again as soon as it answers. ``shutdown`` stops that thread before it closes a client.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from hicache.client import CacheClient, load_into_each, match_each
from hicache.config import ServerConfig
from hicache.counters import Ticket
from hicache.errors import HicacheError, InvalidArgument, WaitTimeout
from hicache.foreign import ForeignLayout, OwnedPoolHandle
from hicache.integrations.vllm_kv import SharedKV, layout_of, share_kv_caches
from hicache.protocol import monotonic_ns
from hicache.spec import KVSpec

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_RETRY_ATTACH_S = 1.0


@dataclass
class LoadMeta:
    """One request's load, started by the scheduler: ``blocks`` should receive KV; the
    first ``num_loaded`` do on every TP rank, layer by layer. Per rank (index: the TP
    rank; none, or no tickets: no load started for it): its load's ``tickets``, and
    when the daemon starts no more of its copies (``copies_end_ns``; ``None``: it does
    not say). A rank's load may bring more than ``num_loaded`` pages: the blocks past it
    are reported all the same (every rank recomputes them), once that rank's copies
    into them are over."""

    req_id: str
    blocks: list[int]
    num_loaded: int
    tickets: list[list[tuple[int, int]]] = field(default_factory=list)
    copies_end_ns: list[int | None] = field(default_factory=list)

    def of_rank(self, rank: int) -> tuple[list[tuple[int, int]], int | None]:
        """``rank``'s tickets and copies' end (none: nothing was copied for it)."""
        if rank >= len(self.tickets):
            return [], None
        return self.tickets[rank], self.copies_end_ns[rank]


class Hit(NamedTuple):
    """A match on every TP rank: their handles, the pages all of them can load, and
    those pages by tier along the path — on host (with any on the device of a pool of
    hicache's own), then on disk alone, then just brought from the remote tier (the
    shortest rank's match; the host pages of a path come before its disk-only ones:
    host copies leave leaf first)."""

    handles: list[Any]
    pages: int
    tiers: tuple[int, int, int] = (0, 0, 0)

    def sources(self, first: int, count: int) -> dict[CacheHitSource, int]:
        """Pages ``first`` .. ``first + count`` of the path by the tier that supplies
        them, as vLLM counts its prompt tokens cached by source (remote: a remote store,
        which vLLM files as ``external_unspecified``); only those not 0."""
        out: dict[CacheHitSource, int] = {}
        start = 0
        for source, n in zip((CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED),
                             self.tiers):
            overlap = min(start + n, first + count) - max(start, first)
            if overlap > 0:
                out[source] = overlap
            start += n
        return out


@dataclass
class StoreMeta:
    tokens: list[int]  # whole pages, from the first
    blocks: list[int]  # one per page
    extra_key: str


@dataclass
class HicacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadMeta] = field(default_factory=list)
    stores: list[StoreMeta] = field(default_factory=list)
    invalid: set[int] = field(default_factory=set)  # stale blocks a request counts as computed: reported
    step: int = 0  # this metadata's number, from 0 (the scheduler's)
    # Blocks a request counts as computed whose latest load (in a step after
    # ``confirmed``, the last one whose output the scheduler has seen) may have failed:
    # the worker reports those whose load did.
    check: set[int] = field(default_factory=set)
    confirmed: int = -1


@dataclass
class HicacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Back to the scheduler from a step that had loads: that step's outcome is in.
    ``off``: a worker runs without hicache (it could not share its KV cache), said once:
    the scheduler stops trying to attach to a pool nobody will register."""

    step: int
    off: bool = False

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if not isinstance(other, HicacheWorkerMetadata):
            return self
        # (a step is in once every worker has run it; hicache is off if one worker is)
        return HicacheWorkerMetadata(min(self.step, other.step), self.off or other.off)


@dataclass
class _Request:
    """What the scheduler side keeps of a running request."""

    tokens: list[int]
    extra_key: str
    blocks: list[int] = field(default_factory=list)
    stored_pages: int = 0


def extra_key_of(request: "Request", epoch: str = "") -> str:
    """The namespace part a request adds ("" for a plain prompt): everything besides its
    token ids that vLLM's own prefix cache keys its blocks on
    (``kv_cache_utils.generate_block_hash_extra_keys``) — the LoRA adapter (its name and
    its path: a name pointed at another adapter must not reuse the old one's KV, and
    hicache outlives the engine), the cache salt, each multimodal input's identifier and
    place (an image's positions hold the same placeholder ids for every image) and the
    prompt embeddings (their positions hold a sentinel id). The name and salt are
    spelled out (KV events carry them); the rest goes in as one digest. ``epoch``: the
    engine's cache epoch, once it reset its caches (see
    :meth:`HicacheConnector.reset_cache`)."""
    parts, inputs = [], []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or ""
        parts.append(f"lora={name}")
        inputs.append(("lora", name, str(getattr(lora, "lora_path", None) or "")))
    salt = getattr(request, "cache_salt", None) or ""
    if salt:
        parts.append(f"salt={salt}")
    for feature in getattr(request, "mm_features", None) or ():
        place = feature.mm_position
        inputs.append(("mm", str(feature.identifier), int(place.offset), int(place.length)))
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        mask = getattr(request, "prompt_is_token_ids", None)
        inputs.append(("embeds", _tensor_digest(embeds), None if mask is None else bytes(map(bool, mask)).hex()))
    if inputs:
        parts.append("in=" + hashlib.blake2b(repr(inputs).encode(), digest_size=16).hexdigest())
    if epoch:
        parts.append(f"epoch={epoch}")
    return "vllm:" + ":".join(parts) if parts else ""


def _tensor_digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous()
    h = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    h.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


# Keys of a Hugging Face config that name or date the checkpoint rather than change
# what it computes (the model's name and revision are in the identity already).
_NOT_MODEL_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                             "_attn_implementation_autoset"})


def model_identity(config: "VllmConfig") -> str:
    """The spec's weights identity: ``model@revision#digest``, the digest over what else
    changes the K/V one checkpoint computes for the same tokens in the same cache
    geometry — the quantization (an fp8 engine of a bf16 checkpoint), the KV cache
    dtype, the model's config as vLLM loaded it (rope scaling and theta, with
    ``hf_overrides`` applied) and the overrides themselves."""
    model = config.model_config

    def plain(value: Any) -> Any:  # what json cannot write: named by type, never by address
        if callable(value):
            return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        return f"{type(value).__module__}.{type(value).__qualname__}:{value}"

    factors: dict[str, Any] = {
        "quantization": getattr(model, "quantization", None),
        "cache_dtype": str(getattr(config.cache_config, "cache_dtype", "") or ""),
        "hf_overrides": getattr(model, "hf_overrides", None) or None,
    }
    hf_config = getattr(model, "hf_config", None)
    if hf_config is not None:
        values = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        factors["hf_config"] = {k: v for k, v in values.items() if k not in _NOT_MODEL_KEYS}
    text = json.dumps(factors, sort_keys=True, default=plain)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return f"{model.model}@{model.revision or ''}#{digest}"


def tp_shard(config: "VllmConfig") -> tuple[int, int]:
    """(this process's TP rank, the TP size). vLLM numbers a worker's global rank
    (``parallel_config.rank``, set before the connector is made) data-parallel rank,
    pipeline stage, TP rank, most significant first; with one stage the TP rank is the
    rank modulo the TP size. (The scheduler is rank 0: it speaks for every rank.)"""
    parallel = config.parallel_config
    size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return int(getattr(parallel, "rank", 0) or 0) % size, size


class RankClients:
    """The scheduler's clients, one per TP rank, each attached to that rank's pool.

    Each rank's worker caches its own shard of every page in a pool of its own (the
    shard is in the spec: ranks never share pages), so a prefix is hicache's only as
    far as every rank holds it: a match is the shortest of the ranks' matches, and a
    load is as long as the shortest of the ranks' loads. Each call goes to every rank
    at once (about one round trip for all: ``match_each``, ``load_into_each``). The
    ranks' pools age alike (every match, load and store touches each of them), but one may
    have evicted a page another keeps; the shorter match wins."""

    def __init__(self, clients: list[CacheClient], names: list[str]) -> None:
        self.clients, self.names = clients, names
        self._attached = [False] * len(clients)

    def attach(self) -> None:
        """Attach every rank's client not attached yet (a retry starts where the last
        attempt stopped: the workers register their pools one by one)."""
        for i, (client, name) in enumerate(zip(self.clients, self.names)):
            if not self._attached[i]:
                client.attach(name)
                self._attached[i] = True

    def match(self, tokens: list[int], extra_key: str) -> Hit:
        """Every rank's handle and the pages all of them can load (0 and no handles: a
        miss on some rank), by tier as the shortest rank's match has them. The ranks'
        matches are under way at once (one round trip's wait for all:
        :func:`hicache.client.match_each`)."""
        hit = Hit([], 0)
        for m in match_each(self.clients, tokens, extra_key):
            n = m.num_device_pages + m.num_host_pages + m.num_disk_pages
            if m.handle is None or not n:
                return Hit([], 0)
            hit.handles.append(m.handle)
            if not hit.pages or n < hit.pages:
                remote = m.num_remote_pages
                hit = Hit(hit.handles, n, (m.num_device_pages + m.num_host_pages - remote, m.num_disk_pages, remote))
        return hit

    def load_into(self, handles: list[Any], load: LoadMeta, first: int) -> None:
        """Start every rank's ``load_into`` ``load.blocks``, all at once; fills in
        ``load``: the blocks every rank loads. A rank whose load fails (evicted meanwhile,
        daemon gone) fails the request's load (vLLM recomputes); the other ranks keep
        their tickets, so that their workers wait until their copies are over before they
        report the blocks."""
        n = len(load.blocks)
        if not n:
            load.num_loaded = 0
            return
        # (unlocked: one round trip; what was evicted since the match loads short)
        for rank, done in enumerate(load_into_each(self.clients, handles, load.blocks, first, locked=False)):
            if isinstance(done, HicacheError):
                logger.info("hicache: load for %s failed on TP rank %d: %s", load.req_id, rank, done)
                n = 0
                load.tickets.append([])
                load.copies_end_ns.append(None)
                continue
            n = min(n, done.num_loaded_pages)
            load.tickets.append([tuple(t) for t in done.wait])
            load.copies_end_ns.append(done.copies_end_ns)
        load.num_loaded = n

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _unsupported_kv_cache(kv_cache_config: "KVCacheConfig | None") -> str | None:
    """Why hicache cannot hold this KV cache (``None``: it can, as far as the config
    tells). Both roles have the engine's config: the worker runs without hicache for
    such a cache and registers no pool, and its scheduler, seeing the same, does not
    try to attach to one for the engine's whole life."""
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
        # Sliding-window or recurrent layers beside full attention: each group's
        # blocks are its own, and a page of one layer spec is not all of the KV.
        return (f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (a hybrid model): "
                "one group of full-attention layers only, for now")
    return None


def _request_amx() -> None:
    """Ask Linux for the AMX tile state now, before this connector starts any thread.

    A process may use AMX only after ``arch_prctl(ARCH_REQ_XCOMP_PERM)``; without it
    the first tile instruction is SIGILL. vLLM's CPU attention runs AMX kernels for
    bf16 caches with block sizes divisible by 32, and on a Xeon with AMX the worker died
    with SIGILL in ``cpu_attention_with_kv_cache`` at the first step that used blocks
    hicache had loaded (the same engine without the connector ran its own prefix hits
    fine; why nothing asked in time with the connector is not established). Asking here
    made every vLLM test engine pass. torch's ``_init_amx`` makes the request
    (idempotent; ``False`` where the CPU has no AMX); where torch lacks it, nothing."""
    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init_amx is not None:
        try:
            init_amx()
        except Exception:  # noqa: BLE001 - not fatal: vLLM then picks what it can run
            logger.debug("hicache connector: AMX permission request failed", exc_info=True)


class HicacheConnector(KVConnectorBase_V1):
    """See the module docstring."""

    _cache_hit_source = CacheHitSource.HOST  # (what get_external_cache_hit_sources says when it cannot tell)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _request_amx()
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self._endpoint = str(extra.get("hicache.endpoint") or ServerConfig().endpoints[0])
        self._timeout_s = float(extra.get("hicache.timeout_s", 1.0))
        self._load_timeout_s = float(extra.get("hicache.load_timeout_s", 5.0))
        # Qualified by the engine's id (which its scheduler and workers share, and vLLM
        # draws at random unless told): engines started from one configuration register
        # pools of their own. A name alone let a second engine's worker be refused and its
        # scheduler attach to the first engine's pool — and load into its blocks.
        self._pool_name = f"{extra.get('hicache.pool_name') or 'vllm'}-{transfer.engine_id}"
        # CURVE keys and tenant, passed to every client of this connector (None: the environment's).
        self._client_args = {"server_key": extra.get("hicache.server_key") or None,
                             "key_file": extra.get("hicache.key_file") or None,
                             "tenant": extra.get("hicache.tenant") or None}
        self._block_size = vllm_config.cache_config.block_size
        self._vllm_config = vllm_config
        self._kv_cache_config_ = kv_cache_config
        # The worker's client, or the scheduler's clients (one per TP rank).
        self._client: CacheClient | RankClients | None = None
        self._rank, self._tp_size = tp_shard(vllm_config)
        self._enabled = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) == 1
        if not self._enabled:
            logger.warning("hicache connector: pipeline parallelism is not supported yet; running without hicache")
        elif role == KVConnectorRole.SCHEDULER and (reason := _unsupported_kv_cache(kv_cache_config)):
            # (the worker says so too, and runs without hicache: see register_kv_caches)
            logger.warning("hicache: cannot hold this KV cache (%s); running without hicache", reason)
            self._enabled = False
        # ``_client`` is published (under ``_lock``) only once it is registered or
        # attached; until then a thread of this connector (``_connecting``) owns its
        # client and makes every further attempt, so that neither vLLM's scheduler loop
        # nor the worker's step waits for a daemon that is not there. On the worker the
        # same thread then brings the pool back after a daemon restart, and the step's
        # calls take ``_lock`` too.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connecting: threading.Thread | None = None
        if role == KVConnectorRole.SCHEDULER:
            if extra.get("hicache.recompute_on_load_error", True) and transfer.kv_load_failure_policy != "recompute":
                # A best-effort cache: a load that falls short is recomputed, never an error.
                transfer.kv_load_failure_policy = "recompute"
            # vLLM's kv_role: a "kv_producer" (a prefill instance) stores and never loads,
            # a "kv_consumer" (a decode instance) loads and never stores; "kv_both" does both.
            kv_role = getattr(transfer, "kv_role", None) or "kv_both"
            self._consumes = kv_role != "kv_producer"
            self._produces = kv_role != "kv_consumer"
            self._requests: dict[str, _Request] = {}
            self._epoch = ""  # the cache epoch: see reset_cache
            self._matches: dict[str, tuple[Hit, int]] = {}  # req id -> (its match, num_computed_tokens)
            # req id -> the tokens of its load by source, from its alloc until vLLM asks
            self._sources: dict[str, dict[CacheHitSource, int]] = {}
            self._loads: list[LoadMeta] = []
            self._stale: set[int] = set()  # blocks whose load failed, not computed again since
            self._step = 0  # the number of the next metadata
            self._confirmed = -1  # the last step with loads whose output came back
            # block -> the step that last loaded into it, while that step's output is not
            # back (asynchronous scheduling) and no request has computed the block since
            self._unconfirmed: dict[int, int] = {}
            if self._enabled:  # (vLLM makes the scheduler after the workers registered their pools)
                names = [self._rank_pool_name(rank) for rank in range(self._tp_size)]
                clients = RankClients([self._new_client("vllm-scheduler") for _ in names], names)
                self._start_connecting(clients, clients.attach, f"attach to pool{'s' * (len(names) > 1)} "
                                       + ", ".join(map(repr, names)))
        else:
            self._shared: SharedKV | None = None  # vLLM computes in it: kept as long as the connector
            self._cuda = False
            self._layer_index: dict[str, int] = {}
            self._pending: list[LoadMeta] = []
            # The layers waited for since loads were last added to ``_pending`` (every
            # pending load has each of them landed): the step's end waits for the rest.
            self._waited: set[int] = set()
            self._load_errors: set[int] = set()
            # The blocks this step reported already, until it ends: an engine with a draft
            # model collects the step's output before its stores run (``_valid_pages``).
            self._reported: set[int] = set()
            # block -> the step whose load into it (its latest) failed, until the scheduler
            # has that step's output (``confirmed``): what ``meta.check`` is answered from
            self._failed: dict[int, int] = {}
            self._clock: Callable[[], int] = monotonic_ns  # times a step's layer waits (tests inject one)
            self._num_layers = 0
            self._said_off = False  # (running without hicache: told the scheduler)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing must be delivered

    def _rank_pool_name(self, rank: int) -> str:
        """TP rank ``rank``'s pool (one rank: the engine's pool name as it is)."""
        return self._pool_name if self._tp_size == 1 else f"{self._pool_name}-tp{rank}"

    # ------------------------------------------------------- connecting (both sides)

    def _new_client(self, name: str) -> CacheClient:
        return CacheClient(self._endpoint, timeout_s=self._timeout_s, load_timeout_s=self._load_timeout_s,
                           name=name, reconnect_interval_s=_RETRY_ATTACH_S, **self._client_args)

    def _start_connecting(self, client: CacheClient | RankClients, register: Callable[[], None], what: str,
                          then: Callable[[CacheClient], None] | None = None) -> None:
        """``register()`` once now, at the engine's start (the daemon is usually there,
        and the first request then finds the pool), and if that fails again in a
        thread of this connector every ``_RETRY_ATTACH_S`` until it succeeds; then
        ``then(client)`` on that thread, if given. Misses meanwhile, at once."""
        connected = self._attempt(register, what, warn=True)
        if connected:
            self._client = client
        if connected and then is None:
            return
        self._connecting = threading.Thread(target=self._connecting_main,
                                            args=(client, register, what, connected, then),
                                            name="hicache-connect", daemon=True)
        self._connecting.start()

    def _attempt(self, register: Callable[[], None], what: str, warn: bool) -> bool:
        try:
            register()
        except HicacheError as exc:
            log = logger.warning if warn else logger.debug
            log("hicache: cannot %s at %s yet (%s): misses until it can", what, self._endpoint, exc)
            return False
        logger.info("hicache: %s at %s: done", what, self._endpoint)
        return True

    def _connecting_main(self, client: CacheClient | RankClients, register: Callable[[], None], what: str,
                         connected: bool,
                         then: Callable[[CacheClient], None] | None) -> None:
        while not connected:
            if self._stop.wait(_RETRY_ATTACH_S):
                client.close()  # (never published: this thread's own)
                return
            if self._attempt(register, what, warn=False):
                with self._lock:
                    if self._stop.is_set():
                        client.close()
                        return
                    self._client = client
                connected = True
        if then is not None:
            then(client)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self._block_size
        tokens = list(request.prompt_token_ids or ())
        limit = (len(tokens) - 1) // bs * bs  # whole blocks, never the last prompt token
        self._matches.pop(request.request_id, None)
        if limit <= num_computed_tokens or not self._consumes:
            return 0, False
        client = self._client  # None: not attached yet (a thread is at it): a miss, at once
        if client is None:
            return 0, False
        known = self._requests.get(request.request_id)
        try:
            hit = client.match(tokens[:limit],
                               known.extra_key if known is not None else extra_key_of(request, self._epoch))
        except HicacheError as exc:
            logger.warning("hicache: match failed: %s", exc)
            return 0, False
        if hit.pages * bs <= num_computed_tokens:
            return 0, False
        self._matches[request.request_id] = (hit, num_computed_tokens)
        return hit.pages * bs - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        req_id = request.request_id
        matched = self._matches.pop(req_id, None)
        if not num_external_tokens or matched is None:
            return
        hit, num_computed = matched
        handles = hit.handles
        bs = self._block_size
        first = num_computed // bs
        self._sources[req_id] = {source: pages * bs
                                 for source, pages in hit.sources(first, num_external_tokens // bs).items()}
        block_ids = list(blocks.get_block_ids()[0])
        target = block_ids[first : first + num_external_tokens // bs]
        self._stale.difference_update(target)  # (new blocks: a failed load reports them again)
        for block in target:  # (this step's load: its own failure is reported, no check needed)
            self._unconfirmed.pop(block, None)
        load = LoadMeta(req_id, target, 0)
        client = self._client
        if client is not None:
            client.load_into(handles, load, first)
        req = self._requests.get(req_id)
        if req is not None and load.num_loaded:
            # hicache holds the prefix up to the last page loaded (a match is a prefix):
            # storing it again would be a round trip that copies nothing. A load that
            # fails in the worker after all makes vLLM recompute from the failed block,
            # and _store_if_due stores from there again.
            req.stored_pages = max(req.stored_pages, first + load.num_loaded)
        self._loads.append(load)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int,
                                       ) -> dict[CacheHitSource, int]:
        """The request's hit by the tier it comes from (host, disk, the remote tier):
        vLLM's ``vllm:prompt_tokens_cached_by_source``. Asked once its load started."""
        sources = self._sources.pop(request.request_id, None)
        if sources is None or sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HicacheConnectorMetadata(loads=self._loads, step=self._step, confirmed=self._confirmed)
        self._loads = []
        self._step += 1
        if self._enabled:
            self._collect_stores(scheduler_output, meta)
        for load in meta.loads:
            self._unconfirmed.update(dict.fromkeys(load.blocks, meta.step))
        return meta

    def _collect_stores(self, out: "SchedulerOutput", meta: HicacheConnectorMetadata) -> None:
        """Stores for the whole prompt pages this step completes."""
        scheduled = out.num_scheduled_tokens
        steps: list[tuple[_Request, int, int]] = []  # (request, tokens computed before the step, scheduled)
        for new in out.scheduled_new_reqs:
            if new.req_id not in scheduled:
                continue
            req = self._requests.get(new.req_id)
            if req is None:  # (on_new_request saw it first: its cache salt is there)
                continue
            req.blocks = list(new.block_ids[0])
            steps.append((req, new.num_computed_tokens, scheduled[new.req_id]))
        cached = out.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None or req_id not in scheduled:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in resumed:
                    req.blocks = list(new_blocks[0])
                else:
                    req.blocks.extend(new_blocks[0])
            steps.append((req, cached.num_computed_tokens[i], scheduled[req_id]))
        if self._stale:
            self._report_stale(steps, meta)
        if self._unconfirmed:
            self._check_unconfirmed(steps, meta)
        if self._produces:
            for req, num_computed, num_scheduled in steps:
                self._store_if_due(req, num_computed, num_scheduled, meta)

    def _report_stale(self, steps: list[tuple["_Request", int, int]], meta: HicacheConnectorMetadata) -> None:
        """Blocks whose load failed hold stale KV until a request computes them again, yet
        with ``kv_load_failure_policy = "recompute"`` vLLM keeps them in its prefix cache
        (``Scheduler._handle_invalid_blocks`` evicts them only under "fail"), so that a
        request aborted or preempted before its recompute leaves them to the next prompt
        with those tokens as computed. A block a request computes from this step on is
        good again; one it counts as computed is reported as a failed load again
        (``meta.invalid``): vLLM recomputes it, and the worker stores nothing from it."""
        bs = self._block_size
        for req, num_computed, _ in steps:
            self._stale.difference_update(req.blocks[num_computed // bs :])
        for req, num_computed, _ in steps:
            meta.invalid.update(b for b in req.blocks[: num_computed // bs] if b in self._stale)

    def _check_unconfirmed(self, steps: list[tuple["_Request", int, int]], meta: HicacheConnectorMetadata) -> None:
        """Under asynchronous scheduling (vLLM's default on GPUs) vLLM builds a step
        before the previous one's output comes back, and it put a load's blocks in its
        prefix cache when it allocated them (``KVCacheManager.allocate_slots``): a
        request of this step may count as computed a block whose load is failing in a
        step this side has no output of yet, which :meth:`_report_stale` cannot know.
        The worker runs the steps in order and knows by then: ``meta.check`` asks it
        about those blocks, and it reports the ones whose load failed. A block a request
        computes from this step on no longer depends on its load."""
        bs = self._block_size
        for req, num_computed, _ in steps:
            for block in req.blocks[num_computed // bs :]:
                self._unconfirmed.pop(block, None)
        for req, num_computed, _ in steps:
            meta.check.update(b for b in req.blocks[: num_computed // bs] if b in self._unconfirmed)

    def _store_if_due(self, req: _Request, num_computed: int, num_scheduled: int,
                      meta: HicacheConnectorMetadata) -> None:
        """Store the whole prompt pages the step completes. A step that starts below the
        pages stored already recomputes them: vLLM found blocks whose load failed (the
        worker stored nothing from the first of them on) and truncated the request, or
        resumed it; those pages are stored again (the daemon copies only what it lacks)."""
        bs = self._block_size
        req.stored_pages = min(req.stored_pages, num_computed // bs)
        pages = min(num_computed + num_scheduled, len(req.tokens)) // bs
        pages = min(pages, len(req.blocks))
        if pages <= req.stored_pages:
            return
        req.stored_pages = pages
        meta.stores.append(StoreMeta(req.tokens[: pages * self._block_size], req.blocks[:pages], req.extra_key))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """The blocks the workers reported as failed loads (``invalid_block_ids``) are
        stale until computed again (see :meth:`_report_stale`); the loads of the step
        the output is of, and of the steps before it, need no check any more (see
        :meth:`_check_unconfirmed`). vLLM hands over only outputs that are not empty:
        a step with loads sends its number (:class:`HicacheWorkerMetadata`)."""
        if not self._enabled:
            return
        done = connector_output.kv_connector_worker_meta
        if isinstance(done, HicacheWorkerMetadata) and done.off:
            logger.warning("hicache: the workers run without hicache; the scheduler stops trying to attach")
            self._enabled = False
            self._stop.set()  # (the connecting thread ends: it closes a client it never published)
            with self._lock:
                client, self._client = self._client, None
            if client is not None:
                client.close()
            return
        self._stale.update(connector_output.invalid_block_ids or ())
        if isinstance(done, HicacheWorkerMetadata) and done.step > self._confirmed:
            self._confirmed = done.step
            self._unconfirmed = {b: step for b, step in self._unconfirmed.items() if step > done.step}

    def on_new_request(self, request: "Request") -> None:
        if self._enabled:
            self._requests[request.request_id] = _Request(list(request.prompt_token_ids or ()),
                                                          extra_key_of(request, self._epoch))

    def reset_cache(self) -> bool | None:
        """vLLM empties its caches — ``reset_prefix_cache(reset_connector=True)``, and
        ``pause_generation(clear_cache=True)`` around a weight update — and counts on the
        connector to: the KV hicache holds of this engine's prompts may be of other
        weights. The scheduler moves to a new cache epoch, a random part of every
        namespace it names from now on: nothing stored before is matched by this engine
        again (the daemon evicts it in time; an engine not reset goes on hitting it),
        and what it stores from now on is shared with no engine but itself. The requests
        admitted before store nothing more (their blocks may hold KV of the old
        weights); a request vLLM resumes matches in the new epoch. True: done (None on a
        worker, which vLLM does not ask: it keeps no cache of its own)."""
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        self._epoch = secrets.token_hex(8)
        self._requests.clear()
        self._matches.clear()
        self._sources.clear()
        logger.info("hicache: caches reset: nothing stored before is loaded by this engine again")
        return True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Stores are synchronous in the worker's step: nothing of this request is in flight.
        self._requests.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        return False, None

    def take_events(self):
        return ()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self._enabled:
            return
        try:
            spec, layout = self._describe(kv_caches)
            self._shared = share_kv_caches(kv_caches, self._kv_cache_config_.kv_cache_tensors)
        except InvalidArgument as exc:  # a model or layout hicache cannot hold yet
            logger.warning("hicache: cannot hold this KV cache (%s); running without hicache", exc)
            self._enabled = False
            return
        except Exception:
            logger.exception("hicache: cannot share this KV cache; running without hicache")
            self._enabled = False
            return
        self._cuda = next(iter(kv_caches.values())).is_cuda
        name = self._rank_pool_name(self._rank)
        # One KV event stream per engine, and its tokens counted once: rank 0's (the
        # ranks' pools age alike, and hold shards of the same tokens).
        first = self._rank == 0
        handle = OwnedPoolHandle(layout, self._shared.memory, name, kv_events=first, counts_tokens=first)
        client = self._new_client("vllm-worker")
        self._start_connecting(client, lambda: client.register_owned(spec, handle),
                               f"register pool {name!r} ({layout.num_blocks} blocks, spec "
                               f"{spec.fingerprint_hex})", then=self._keep_registered)

    def _keep_registered(self, client: CacheClient) -> None:
        """Re-register the pool as soon as a daemon that went away answers again, so
        that the scheduler can attach before the next request comes. Registered once,
        the client has its probing thread: ``revive()`` reconnects only when a probe
        found the daemon answering, and answers at once otherwise."""
        while not self._stop.wait(_RETRY_ATTACH_S):
            if not client.degraded:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if client.revive():
                        logger.info("hicache: pool %r registered again", self._rank_pool_name(self._rank))
                except Exception:  # noqa: BLE001 - tried again in a second
                    logger.debug("hicache: revive failed", exc_info=True)

    def _describe(self, kv_caches: dict[str, torch.Tensor]) -> tuple[KVSpec, ForeignLayout]:
        """The spec and foreign layout of vLLM's KV cache (from ``KVCacheTensor``)."""
        from vllm.model_executor.models.utils import extract_layer_index

        config = self._vllm_config
        model = config.model_config
        kv_config = self._kv_cache_config_
        reason = _unsupported_kv_cache(kv_config)
        if reason is not None:
            raise InvalidArgument(reason)
        names = sorted(kv_caches, key=extract_layer_index)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._num_layers = len(names)
        first = kv_caches[names[0]]
        dtype = str(first.dtype).removeprefix("torch.")
        heads = model.get_num_kv_heads(config.parallel_config)
        head_size = model.get_head_size()
        layout_name = f"vllm/{first.device.type}/{getattr(kv_config, 'kv_cache_layout', '')}/{self._isa(first)}"
        if self._tp_size > 1:  # (each rank's blocks hold its shard of the heads: its own namespace)
            layout_name += f"/tp{self._rank}of{self._tp_size}"
        spec = KVSpec.mha(num_layers=len(names), num_kv_heads=heads, head_dim=head_size,
                          page_size=self._block_size, dtype=dtype,
                          model=model_identity(config), layout=layout_name)
        return spec, layout_of(spec, kv_config.num_blocks, kv_config.kv_cache_tensors, self._layer_index)

    def _isa(self, tensor: torch.Tensor) -> str:
        """How the CPU backend packs a block (it differs between ISAs)."""
        if tensor.device.type != "cpu":
            return "native"
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return _get_attn_isa(tensor.dtype, self._block_size, self._vllm_config.model_config.get_head_size())
        except Exception:  # noqa: BLE001 - an unknown packing is its own namespace
            return "unknown"

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        self._load_errors.update(meta.invalid)
        if self._failed:
            self._failed = {b: step for b, step in self._failed.items() if step > meta.confirmed}
            self._load_errors.update(b for b in meta.check if b in self._failed)
        for load in meta.loads:
            if self._client is None or not load.of_rank(self._rank)[0]:
                self._load_errors.update(load.blocks)
                continue
            self._load_errors.update(load.blocks[load.num_loaded:])
            self._pending.append(load)
            self._waited.clear()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._pending or layer in self._waited:
            return
        self._wait(layer)

    def _wait(self, layer: int) -> None:
        with self._lock:
            self._wait_locked(layer)
        self._waited.add(layer)

    def _wait_locked(self, layer: int) -> None:
        """Wait for ``layer`` of every pending load, each until the daemon starts no more
        of its copies (``copies_end_ns``; a daemon that does not say: ``load_timeout_s``
        from now). The scheduler started them together: a daemon that stops with many
        loads in flight costs the step about one timeout, not one per load (vLLM kills an
        engine whose step outlasts ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``). Each load is
        judged on its own: one whose layer has landed passes after its deadline too (a
        wait of 0 still looks once). One given up on is reported — vLLM recomputes its
        blocks, or frees them if the request ends — so it must be over first: see
        :meth:`_give_up`."""
        fallback = self._clock() + int(self._load_timeout_s * 1e9)
        kept, late = [], []
        for load in self._pending:
            tickets, copies_end_ns = load.of_rank(self._rank)
            until = copies_end_ns if copies_end_ns is not None else fallback
            try:
                if self._client is None:
                    raise HicacheError("the connector shut down")
                self._client.wait_layer([Ticket(*t) for t in tickets], layer,
                                        timeout_s=max(0.0, (until - self._clock()) / 1e9))
                kept.append(load)
            except WaitTimeout:
                late.append(load)
            except Exception as exc:  # noqa: BLE001 - failed, stale: vLLM recomputes these blocks
                logger.warning("hicache: load for %s failed at layer %d: %s", load.req_id, layer, exc)
                self._load_errors.update(load.blocks[: load.num_loaded])
        if late:
            kept.extend(self._give_up(late, layer))
        self._pending = kept

    def _give_up(self, late: list[LoadMeta], layer: int) -> list[LoadMeta]:
        """Loads whose ``layer`` had not landed when the daemon stopped starting copies:
        a copy it began before then may still be writing their blocks, which vLLM may
        hand to another request once they are reported. Wait for each to be over —
        landed (kept: returned), or the rest failed — ``timeout_s`` for all of them
        between them. One not over by then has a daemon stalled in the middle of a copy:
        reported all the same, since vLLM's step cannot wait for good. (A daemon that
        exited is seen at once — nothing holds its ring any more: its loads fail,
        and are over.)"""
        end = self._clock() + int(self._timeout_s * 1e9)
        kept = []
        for load in late:
            tickets = [Ticket(*t) for t in load.of_rank(self._rank)[0]]
            client = self._client
            over = client is not None and client.wait_over(tickets, timeout_s=max(0.0, (end - self._clock()) / 1e9))
            if over:
                try:
                    client.wait_layer(tickets, layer, timeout_s=0.0)
                    kept.append(load)  # it landed after all
                    continue
                except HicacheError:
                    logger.warning("hicache: load for %s not complete at layer %d in time: given up",
                                   load.req_id, layer)
            else:
                logger.error("hicache: load for %s still copying after its deadline (the daemon is stalled): "
                             "blocks %s are reported, and may be written late", load.req_id,
                             load.blocks[: load.num_loaded])
            self._load_errors.update(load.blocks[: load.num_loaded])
        return kept

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # whole pages are stored after the step (wait_for_save)

    def wait_for_save(self) -> None:
        if self._pending:  # layers that no attention call waited for (nothing should be left)
            for layer in range(self._num_layers):
                if layer not in self._waited:
                    self._wait(layer)
            self._pending = []
        self._waited.clear()
        if self._client is None or not self.has_connector_metadata():
            return
        stores = self._get_connector_metadata().stores
        if stores and self._cuda:
            # The daemon copies on a stream of its own: the forward's writes to these
            # blocks, still queued on vLLM's stream, must have landed first.
            torch.cuda.current_stream().synchronize()
        with self._lock:
            for store in stores:
                pages = self._valid_pages(store)
                if not pages or self._client is None:
                    continue
                try:
                    self._client.store(store.tokens[: pages * self._block_size], store.blocks[:pages],
                                       store.extra_key)
                except HicacheError as exc:
                    logger.warning("hicache: store failed: %s", exc)

    def _valid_pages(self, store: StoreMeta) -> int:
        """The pages of ``store`` before its first block reported this step (its load
        failed, or it is stale: ``meta.invalid``, ``meta.check``): that block holds what
        it held before, and every later one of the request was computed on top of it
        (vLLM recomputes them, and the scheduler stores them then)."""
        for i, block in enumerate(store.blocks):
            if block in self._load_errors or block in self._reported:
                return i
        return len(store.blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The step's reported blocks; the blocks this step loaded into are remembered
        as failed or forgotten (a load into a block is all its hicache KV), for the
        checks of the steps vLLM built before this output reaches the scheduler. They
        stay the step's until it ends: vLLM asks before ``wait_for_save`` in an engine
        with a draft model (it finalizes the connector after the drafter ran), and the
        step's stores must stop before them all the same."""
        errors, self._load_errors = self._load_errors, set()
        self._reported.update(errors)  # (a copy: the set returned is vLLM's to change)
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for load in meta.loads:
                for block in load.blocks:
                    if block in errors:
                        self._failed[block] = meta.step
                    else:
                        self._failed.pop(block, None)
        return errors

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._reported = set()  # (the step ends: see get_block_ids_with_load_errors)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """A step with loads tells the scheduler that its outcome is in, so that it stops
        asking about them; a step without has nothing to confirm (and its output may stay
        empty)."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not self._enabled:
            said, self._said_off = self._said_off, True
            return None if said else HicacheWorkerMetadata(meta.step, off=True)
        return HicacheWorkerMetadata(meta.step) if meta.loads else None

    def shutdown(self) -> None:
        """Stop the connecting thread, then close the client. A thread still inside an
        attempt after the wait closes its own client when the attempt ends; the
        published one is closed under the lock, never while a step or a revive uses it."""
        self._stop.set()
        thread = self._connecting
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._timeout_s + max(self._timeout_s, self._load_timeout_s) + 1.0)
            if thread.is_alive():
                logger.warning("hicache: the %s thread is still in a call to the daemon; it closes its client "
                               "when the call ends", thread.name)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
