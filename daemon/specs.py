"""KV specs: one tier manager per spec, over the daemon's one storage backend.

The first session registering a spec creates its :class:`TierManager` (host pool sized
from ``[host]``, within ``[host].max_bytes`` for every spec together) and rebuilds that
spec's disk tier from the storage metadata; later sessions of the same spec share its
tree, host pool and disk pages. While other engines are being served, that rebuild
(seconds for a large store) runs a slice at a time between their requests, and the
registrations of the spec are answered when it is done; with nobody else to serve it
runs at once.

At most ``[server].max_specs`` specs have a manager at once (each holds threads, its
host pool, and its eviction log once it evicts). A manager no engine uses any more —
no device pool left, no transfer, no timer — is closed when a new spec needs a manager:
at once if its tree is empty (nothing lost), and at the limit, least recently
registered first, if everything it caches is on disk and comes back from there (no
state or sliding-window layers): its pages stay in the store and its next registration
rebuilds them, as after a restart. A manager whose pages are only in memory is kept;
past the limit with nothing to close, a new spec is refused (``RESOURCE_EXHAUSTED``).
"""

from __future__ import annotations

import gc
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hicache.config import DaemonConfig
from hicache.daemon.sessions import Session
from hicache.daemon.store_purge import StoreWalks
from hicache.errors import Draining, InvalidArgument, ResourceExhausted
from hicache.jobs import Completions
from hicache.metrics import CHECKPOINT_EVENTS
from hicache.pools import DevicePool, HostPool
from hicache.spec import KVSpec
from hicache.tiers import TierManager

logger = logging.getLogger(__name__)

_REBUILD_SLICE_S = 0.005  # owner-thread time a background rebuild takes between two looks at the socket
_REBUILD_STEP = 256  # records a rebuild walks between two looks at the clock

Answer = Callable[[TierManager | BaseException], None]  # a waiting registration's: the manager, or why not


@dataclass(eq=False)
class _Waiting:
    """A registration waiting for its spec's rebuild: its session, the pools it mapped,
    and what answers it (with the manager, or with an exception)."""

    session: Session
    ranks: list[DevicePool]
    answer: Answer


@dataclass(eq=False)
class _Rebuild:
    """A spec's disk tier going back into its new manager's tree, a slice at a time
    (:meth:`TierManager.rebuild_steps`), and the registrations waiting for it."""

    manager: TierManager
    steps: Iterator[int]
    started: float
    waiting: list[_Waiting] = field(default_factory=list)
    evicted: set[bytes] = field(default_factory=set)  # store evictions meanwhile: forgotten at the end


class Specs:
    """Spec fingerprint -> its tier manager, and the rebuilds under way. Owner thread only."""

    def __init__(self, config: DaemonConfig, *, storage, remote=None, completions: Completions, clock: Callable[[], float],
                 metrics, progress: Callable[[int], None], tenant_of: Callable[[bytes], dict] = lambda fp: {}) -> None:
        """``progress`` is called now and then during long work on the owner thread
        (pinning a host pool, rebuilding a disk tier at once) with a count of what is done.
        ``tenant_of(fingerprint)``: the spec's namespaces' tenants, as kept across
        restarts (:mod:`hicache.daemon.tenant_log`), named to each new manager."""
        self.config = config
        self._tenant_of = tenant_of
        self.storage = storage
        self.remote = remote  # the remote tier's store (every spec's manager shares it), or None
        self.completions = completions
        self.clock = clock
        self.metrics = metrics
        self.progress = progress
        self.managers: dict[bytes, TierManager] = {}
        self._registered_at: dict[bytes, float] = {}  # spec fingerprint -> its last registration
        self._rebuilds: dict[bytes, _Rebuild] = {}  # spec fingerprint -> its rebuild in the background
        self.store_walks = StoreWalks(storage, completions, clock)  # purges of specs that no manager serves, and the tenant log's compactions
        self._gc_was_enabled = False  # automatic collection, before background rebuilds paused it
        # The checkpoint event counts of the managers let go: the metric is a counter, so
        # they stay in it (with the counts of those serving) instead of leaving with them.
        self.closed_checkpoint_events: Counter[str] = Counter()
        # Called when a manager starts serving. The server sets it to gc.freeze: what the
        # new manager allocated (tree, indexes, and the modules its first use imported —
        # torch alone brings ~150,000 objects) moves to the permanent generation (O(1)),
        # so that the serving daemon's full collections walk only what came since:
        # stalls of every request of ~0.25-0.3 s became ~0.02 s on a bench_scale-shaped
        # load. (Cyclic garbage alive at that moment is kept: small.)
        self.on_settled: Callable[[], None] = lambda: None

    @property
    def rebuilding(self) -> bool:
        return bool(self._rebuilds)

    def all_managers(self) -> list[TierManager]:
        """Serving or being rebuilt."""
        return [*self.managers.values(), *(rebuild.manager for rebuild in self._rebuilds.values())]

    def manager_for(self, spec: KVSpec, device_pages: int, *, in_background: bool) -> TierManager | None:
        """The spec's manager; a new one at its first registration, whose disk tier is
        rebuilt now unless ``in_background`` (registered engines are waiting to be
        served): then ``None``, and the registration waits (:meth:`wait`)."""
        manager = self.managers.get(spec.fingerprint)
        if manager is not None or spec.fingerprint in self._rebuilds:
            self._registered_at[spec.fingerprint] = self.clock()
            return manager
        self.store_walks.finish(spec.fingerprint)  # (its rebuild must not restore what a purge deletes)
        self._make_room()
        started = self._registered_at[spec.fingerprint] = self.clock()
        host = self.config.host
        if host.bytes:
            host_pages = HostPool.num_pages_for(spec, nbytes=host.bytes)
        else:
            host_pages = HostPool.num_pages_for(spec, ratio=host.ratio, device_pages=device_pages)
        used = sum(m.host_bytes for m in self.all_managers())
        if used + host_pages * spec.host_page_bytes > host.limit_bytes:
            raise ResourceExhausted(
                f"a host pool of {host_pages * spec.host_page_bytes} bytes for this spec would take the host "
                f"tier past [host].max_bytes ({host.limit_bytes} bytes, {used} in use)")
        manager = TierManager(spec, host_pages=host_pages, storage=self.storage, config=self.config.tiers,
                              completions=self.completions, clock=self.clock, metrics=self.metrics,
                              progress=self.progress, remote=self.remote,
                              remote_settings=self.config.remote.settings() if self.remote is not None else None)
        manager.on_store_evicted = self._store_evicted
        for namespace, tenant in self._tenant_of(spec.fingerprint).items():
            manager.assign(namespace, tenant)  # (before its disk tier comes back: its pages count as theirs)
        if self.storage is not None and in_background:
            if not self._rebuilds:
                self._pause_gc()
            self._rebuilds[spec.fingerprint] = _Rebuild(manager, manager.rebuild_steps(_REBUILD_STEP), started)
            return None
        collecting = gc.isenabled()  # see _pause_gc: nothing else to serve, but the same full collections
        gc.disable()
        try:
            restored = manager.rebuild_from_storage(progress=self.progress)
        except BaseException:
            # A store that fails to read refuses the registration: the manager goes, as
            # when a rebuild in slices fails (a pinned host pool would stay registered
            # with CUDA for good, once per retry).
            manager.close()
            raise
        finally:
            if collecting:
                gc.enable()
        self.managers[spec.fingerprint] = manager
        self.on_settled()
        logger.info("spec %s: host pool of %d pages, %d disk pages restored in %.1f s",
                    spec.fingerprint_hex, host_pages, restored, self.clock() - started)
        return manager

    def _make_room(self) -> None:
        """Before a new spec's manager: close the unused managers that cache nothing,
        and at the limit the least recently registered unused one that the store can
        rebuild; refuse the new spec if the limit still holds."""
        for fingerprint, manager in list(self.managers.items()):
            if _unused(manager) and manager.num_nodes == 0:
                self._close(fingerprint, "it cached nothing")
        self._registered_at = {fp: at for fp, at in self._registered_at.items()
                               if fp in self.managers or fp in self._rebuilds}  # (a rebuild that failed)
        limit = self.config.server.max_specs
        if len(self.managers) + len(self._rebuilds) < limit:
            return
        rebuildable = sorted((self._registered_at.get(fp, 0.0), fp) for fp, m in self.managers.items()
                             if _unused(m) and _rebuildable(m))
        if rebuildable:
            self._close(rebuildable[0][1], "all it cached is on disk, rebuilt at its next registration")
            return
        raise ResourceExhausted(f"the daemon keeps tiers for {limit} KV specs at most ([server].max_specs), each "
                                f"in use or caching pages in memory only: a new spec waits for one to be unused")

    def _close(self, fingerprint: bytes, why: str) -> None:
        manager = self.managers.pop(fingerprint)
        self._registered_at.pop(fingerprint, None)
        if manager.checkpoints is not None:
            self.closed_checkpoint_events.update({event: getattr(manager.checkpoints, event)
                                                  for event in CHECKPOINT_EVENTS})
        if not manager.close():
            logger.warning("spec %s: tiers let go unclosed (the store did not commit in time), no engine uses them "
                           "and %s", manager.spec.fingerprint_hex, why)
            return
        logger.info("spec %s: tiers closed, no engine uses them and %s", manager.spec.fingerprint_hex, why)

    def wait(self, spec: KVSpec, session: Session, ranks: list[DevicePool], answer: Answer) -> None:
        """Call ``answer`` with the spec's manager once its rebuild is done (or with the
        exception that ended it)."""
        self._rebuilds[spec.fingerprint].waiting.append(_Waiting(session, ranks, answer))

    def waiting_sessions(self) -> list[Session]:
        return [w.session for rebuild in self._rebuilds.values() for w in rebuild.waiting]

    def refuse_mapped_twice(self, ranks: list[DevicePool]) -> None:
        """A pool's memory may be mapped as one pool only: not as another session's
        (the same segment under another token), nor twice in one TP group."""
        new = [s for s in _segments(ranks[-1]) if s is not None]
        if not new:
            return
        pools = [*ranks[:-1], *(pool for manager in self.all_managers() for pool in manager.device_pools()),
                 *(rank for rebuild in self._rebuilds.values() for w in rebuild.waiting for rank in w.ranks)]
        mapped = {s for pool in pools for s in _segments(pool)}
        if len(set(new)) != len(new) or mapped.intersection(new):
            raise InvalidArgument("this memory is already registered as a pool")

    def _pause_gc(self) -> None:
        """A rebuild allocates an object per record (450,000 for a large store): each of
        the several full collections that triggers walks them all, ~0.2 s during which
        no request is answered. Collection waits until the rebuilds are done (the cyclic
        garbage of a few seconds of serving is small)."""
        self._gc_was_enabled = gc.isenabled()
        gc.disable()

    def _resume_gc(self) -> None:
        if not self._rebuilds and self._gc_was_enabled:
            gc.enable()

    def run_rebuild(self) -> None:
        """One slice of the oldest background rebuild; at its end the manager starts
        serving and the registrations waiting for it are answered."""
        fingerprint, rebuild = next(iter(self._rebuilds.items()))
        deadline = self.clock() + _REBUILD_SLICE_S
        try:
            while True:  # at least one step a slice, however coarse the clock
                next(rebuild.steps)
                if self.clock() >= deadline:
                    return
        except StopIteration as finished:
            restored = finished.value
            error = None
        except Exception as exc:  # a store that fails to read: refuse the registrations, keep serving
            logger.exception("rebuilding the disk tier of spec %s failed", rebuild.manager.spec.fingerprint_hex)
            error = exc
        del self._rebuilds[fingerprint]
        self._resume_gc()
        if error is not None:
            rebuild.manager.close()
            for waiting in rebuild.waiting:
                waiting.answer(error)
            return
        if rebuild.evicted:
            rebuild.manager.forget_disk_keys(rebuild.evicted)
        self.managers[fingerprint] = rebuild.manager
        self.on_settled()
        logger.info("spec %s: %d disk pages restored in %.1f s, between other engines' requests",
                    rebuild.manager.spec.fingerprint_hex, restored, self.clock() - rebuild.started)
        for waiting in rebuild.waiting:
            waiting.answer(rebuild.manager)

    def _store_evicted(self, keys: Sequence[bytes]) -> None:
        """The store (one for every KV spec) evicted records to make room for one
        manager's writes: each manager forgets those of its own tree."""
        for manager in self.managers.values():
            manager.forget_disk_keys(keys)
        # A tree being rebuilt is left alone until its rebuild ends: the rebuild holds
        # nodes it restored, to restore their children under them, and forgetting one
        # now would end it with an error (a key may be restored after this anyway).
        for rebuild in self._rebuilds.values():
            rebuild.evicted.update(keys)

    def stop_rebuilds(self, deadline: float) -> bool:
        """Shutting down: the rebuilds under way end, their registrations refused; their
        managers closed by ``deadline`` (on :attr:`clock`), else left to the process's
        exit (then False)."""
        closed = True
        for rebuild in self._rebuilds.values():
            closed &= rebuild.manager.close(max(0.0, deadline - self.clock()))
            for waiting in rebuild.waiting:
                waiting.answer(Draining("the daemon shut down before the spec's disk tier was rebuilt"))
        self._rebuilds.clear()
        self._resume_gc()
        self.store_walks.stop()
        return closed


def _unused(manager: TierManager) -> bool:
    """No engine's pool in it (a session's pool is retired when it ends, and gone once
    no transfer uses it), and nothing under way."""
    return not list(manager.pools) and manager.idle() and manager.next_timer() is None


def _rebuildable(manager: TierManager) -> bool:
    """Everything it caches is on disk, and a rebuild brings all of it back (O(nodes))."""
    return (manager.disk.enabled and manager.checkpoints is None and manager.windows is None
            and not manager.deferred_backups and manager.durability()["not_on_disk_pages"] == 0)


def _segments(pool) -> list:
    """The segment ids of a pool's memory: one for a rank's pool, one per allocation
    of an engine-owned pool."""
    return list(getattr(pool, "segment_ids", None) or [pool.segment_id])
