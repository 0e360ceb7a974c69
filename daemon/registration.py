"""``register``: an engine's device pool joins its KV spec's tier manager.

The spec, its fingerprint and the page-key self-test are checked, then every rank's
pool is mapped: a CPU pool is a sealed memfd segment its engine offered on the
descriptor socket (:mod:`hicache.fdpass`), named by token, and mapped only if the user
who offered it is the session's (when the transport tells), owns the segment, and the
segment is not already mapped as another pool (same device and inode); a GPU pool's
IPC handle is refused likewise if it is already registered, and opened only once every
field of it is checked (:mod:`hicache.cuda_ipc`): its reference-counter file must be
the session's user's, so a session whose user the transport does not tell (on
``tcp://``) cannot register one. Everything is checked and
mapped before the session changes: a refused registration leaves it unregistered, as
it was (and free to try again), and drops the descriptors it named (the engine offers
them again with its retry). The first registration of a spec may wait for its disk
tier's rebuild (:mod:`hicache.daemon.specs`): it is answered when that is done.

An *engine-owned* pool (:mod:`hicache.foreign`: the engine's own blocks, in its own
layout, e.g. vLLM's) registers the same way, with one shared buffer per backing
allocation instead of one pool per TP rank, and optionally a name: ``attach`` lets
another session of the same user (the engine's scheduler, in another process) join that
pool, to match, lock and load into it. Attached sessions end with the pool's own. A
name is its identity's (and, where the transport tells, its Unix user's): another
identity may use the same name for a pool of its own, and ``attach`` answers a name
another identity registered as it answers a name nobody did.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from hicache import protocol as p
from hicache.daemon.sessions import Session, Sessions
from hicache.daemon.specs import Specs
from hicache.errors import InvalidArgument, PermissionDenied, ResourceExhausted, SpecMismatch, UnknownSession
from hicache.fdpass import FdExchange
from hicache.foreign import ForeignLayout, ForeignPool, OwnedPoolHandle, SharedMemory
from hicache.keys import key_self_test
from hicache.pages import distinct_page_ids
from hicache.pools import DevicePool, PoolHandle
from hicache.shm import SharedBuffer, prefault
from hicache.spec import KVSpec
from hicache.tiers import TierManager
from hicache.tree import PoolId

logger = logging.getLogger(__name__)


class Registrar:
    """Owner thread only."""

    def __init__(self, sessions: Sessions, specs: Specs, fds: Callable[[], FdExchange | None],
                 clock: Callable[[], float], *, max_pool_pages: int) -> None:
        """``fds()``: the descriptor exchange now (the server sets it after the daemon is
        made). ``max_pool_pages``: ``[server].max_pool_pages`` (see :meth:`_bookkeeping`)."""
        self.sessions = sessions
        self.specs = specs
        self._fds = fds
        self.clock = clock
        self._max_pool_pages = max_pool_pages
        self._pool_ids = itertools.count(1)

    def drop_offers(self, tokens: list[bytes]) -> None:
        """Close the descriptors offered under ``tokens`` (a refused registration's)."""
        fds = self._fds()
        if fds is None:
            return
        for token in tokens:
            offer = fds.take(token)
            if offer is not None:
                os.close(offer.fd)

    def register(self, session: Session, m: p.Register) -> p.RegisterReply | Future:
        if session.manager is not None or session.registering:
            raise InvalidArgument("this session has registered its pool already")
        spec = KVSpec.from_dict(p.as_dict(m.spec))
        if spec.fingerprint != m.fingerprint:
            raise SpecMismatch("the spec's fingerprint differs between client and daemon (versions differ?)")
        if m.key_check != key_self_test(spec.fingerprint, spec.page_size):
            raise SpecMismatch("page keys differ between client and daemon: they could never share a page")
        owned = None
        if m.owned is not p.UNSET:
            if m.pools or m.in_use:
                raise InvalidArgument("an engine-owned pool registers its buffers alone (no pools, no in_use)")
            owned = self._owned_handle(session, spec, m.owned)
        elif len(m.pools) != spec.tp_size:
            raise InvalidArgument(f"a TP group of {spec.tp_size} registers {spec.tp_size} pool handles, "
                                  f"got {len(m.pools)}")
        handles = [PoolHandle.from_dict(p.as_dict(handle)) for handle in m.pools]
        for handle in handles:
            self._bookkeeping(handle)
        ranks: list[DevicePool] = []
        try:
            if owned is not None:
                ranks.append(self._map_owned(session, owned))
                self.specs.refuse_mapped_twice(ranks)
            for handle in handles:
                ranks.append(DevicePool.attach(handle, expected=spec, segment=lambda h: self._segment(session, h),
                                               cuda=lambda h: self._cuda(session, h.cuda_ipc, h.nbytes)))
                self.specs.refuse_mapped_twice(ranks)
            in_use = distinct_page_ids(m.in_use, ranks[0].num_pages)  # pages a re-registering engine uses
            started = self.clock()
            manager = self.specs.manager_for(spec, ranks[0].num_pages, in_background=self.sessions.any_registered())
            # Pinning the host pool (and a rebuild done at once) stalls the loop: nobody's
            # heartbeat was answered meanwhile, so the silence was ours, not theirs.
            self.sessions.extend_leases(self.clock() - started)
        except BaseException:
            for rank in ranks:
                rank.close()
            raise
        if manager is not None:
            return self._attach(session, m.id, spec, ranks, in_use, manager, owned)
        # The spec's disk tier is being rebuilt between other engines' requests: answer
        # when it is back.
        session.registering = True
        out: Future = Future()

        def rebuilt(result: TierManager | BaseException) -> None:
            session.registering = False
            if isinstance(result, TierManager) and self.sessions.get(session.session_id) is not session:
                result = UnknownSession(f"session #{session.serial} ended while its spec was rebuilt")
            if not isinstance(result, TierManager):
                for rank in ranks:
                    rank.close()
                out.set_exception(result)
                return
            try:
                out.set_result(self._attach(session, m.id, spec, ranks, in_use, result, owned))
            except BaseException as exc:  # _attach closed the ranks
                out.set_exception(exc)

        self.specs.wait(spec, session, ranks, rebuilt)
        return out

    def _bookkeeping(self, handle: PoolHandle) -> None:
        """Refuse, before anything is mapped, a pool of hicache's layout of more pages
        (and checkpoint slots lent) than ``[server].max_pool_pages``: its allocator keeps
        ~6 bytes for each, and the count is the engine's word — a sparse memfd of the
        size it implies costs the engine nothing. (An engine-owned pool keeps nothing
        per block: its engine allocates them.)"""
        layout = handle.layout
        num_pages, lent = layout.get("num_pages"), layout.get("checkpoint_slots", 0)
        if type(num_pages) is int and type(lent) is int and num_pages + lent > self._max_pool_pages:
            raise InvalidArgument(f"a pool of {num_pages} pages and {lent} checkpoint slots: the daemon keeps "
                                  f"bookkeeping for at most {self._max_pool_pages} ([server].max_pool_pages)")

    def _owned_handle(self, session: Session, spec: KVSpec, m: p.OwnedPoolMsg) -> OwnedPoolHandle:
        data = p.as_dict(m.layout)
        data["spec"] = spec.to_dict()
        layout = ForeignLayout.from_dict(data)
        buffers = tuple(SharedMemory(b.kind, b.nbytes, b.token or b"", p.as_dict(b.cuda_ipc) if b.cuda_ipc else None)
                        for b in m.buffers)
        handle = OwnedPoolHandle(layout, buffers, m.name or "", kv_events=m.kv_events is not False,
                                 counts_tokens=m.counts_tokens is not False)
        if handle.name and self.owned_pool(session, handle.name) is not None:
            raise InvalidArgument(f"a pool named {handle.name!r} is registered already")
        return handle

    def owned_pool(self, session: Session, name: str) -> tuple[TierManager, PoolId] | None:
        """The serving engine-owned pool registered under ``name`` by the session's
        identity and user."""
        scoped = _scoped(session, name)
        for manager in self.specs.all_managers():
            pool_id = manager.owned_pool(scoped)
            if pool_id is not None:
                return manager, pool_id
        return None

    def _map_owned(self, session: Session, handle: OwnedPoolHandle) -> ForeignPool:
        owners, tensors = [], []
        try:
            for buffer in handle.buffers:
                if buffer.kind == "memfd":
                    owner = self._segment(session, buffer)
                    owners.append(owner)
                    tensors.append(owner.tensor)
                else:
                    from hicache.cuda_ipc import segment_id

                    tensors.append(self._cuda(session, buffer.cuda_ipc, buffer.nbytes))
                    owners.append(_CudaOwner(segment_id(buffer.cuda_ipc)))
            return ForeignPool(handle.layout, tensors, owners)
        except BaseException:
            tensors.clear()
            for owner in owners:
                owner.close()
            raise

    def attach(self, session: Session, m: p.Attach) -> p.RegisterReply:
        """``attach``: see the module docstring."""
        if session.manager is not None or session.registering:
            raise InvalidArgument("this session has registered its pool already")
        # One answer whether nobody registered the name or another identity (or user)
        # did: an attach tells nothing of the others' pools.
        unknown = InvalidArgument(f"no engine-owned pool is registered under the name {m.name!r} by this user")
        found = self.owned_pool(session, m.name)
        if found is None:
            raise unknown
        manager, pool_id = found
        owner = self.sessions.owner_of(manager, pool_id)
        if owner is None or (session.creds.uid is not None and owner.creds.uid != session.creds.uid) or (
                _identity_name(owner) != _identity_name(session)):
            raise unknown
        counters = manager.pools.get(pool_id).counters
        token = self._publish(session, counters)
        self.sessions.attach(session, manager, pool_id, owner=owner)
        logger.info("session #%d attached to pool %d of session #%d", session.serial, pool_id, owner.serial)
        return p.RegisterReply(id=m.id, pool=pool_id,
                               counters=p.from_dict(p.CountersMsg, counters.handle(token).to_dict()),
                               page_size=manager.spec.page_size, num_pages=manager.num_pages(pool_id))

    def _segment(self, session: Session, handle: PoolHandle | SharedMemory) -> SharedBuffer:
        """Map the memfd segment offered under ``handle.token``: only if the user who
        offered it is the session's (when the transport says who that is) and owns it.
        The pages it holds already are mapped in on a thread (:func:`hicache.shm.prefault`):
        the first copies into the engine's blocks take no page faults."""
        fds = self._fds()
        offer = fds.take(handle.token) if fds is not None else None
        if offer is None:
            raise InvalidArgument("no descriptor was offered under this pool's token (offer it on the "
                                  "descriptor socket first; an offer is used once and expires)")
        uid = session.creds.uid
        if uid is not None and offer.uid != uid:
            os.close(offer.fd)
            raise InvalidArgument(f"the pool's descriptor was offered by uid {offer.uid}, not by the session's user")
        buffer = SharedBuffer.attach(offer.fd, handle.nbytes, uid=offer.uid)
        prefault(buffer)
        return buffer

    def _cuda(self, session: Session, description: dict | None, nbytes: int) -> torch.Tensor:
        """Open a CUDA IPC description (:func:`hicache.cuda_ipc.open_tensor`, which
        checks every field first): only for a session whose Unix user the transport
        tells, since its reference-counter file must be that user's."""
        from hicache.cuda_ipc import open_tensor

        if session.creds.uid is None:
            raise PermissionDenied("a CUDA IPC pool registers over ipc://, where the daemon knows the engine's user")
        return open_tensor(description, nbytes, uid=session.creds.uid)

    def _attach(self, session: Session, request_id: int, spec: KVSpec, ranks: list[DevicePool],
                in_use: np.ndarray, manager: TierManager, owned: OwnedPoolHandle | None = None) -> p.RegisterReply:
        """The end of a registration: the session's pool joins its spec's manager.
        ``owned``: an engine-owned pool's handle (``None`` for a pool of hicache's own)."""
        pool_id = PoolId(next(self._pool_ids))
        try:
            if owned is not None:
                name = owned.name
                if name and self.owned_pool(session, name) is not None:  # (registered while this one waited)
                    raise InvalidArgument(f"a pool named {name!r} is registered already")
                counters = _out_of_fds(manager.register_owned_pool, pool_id, ranks[0], _scoped(session, name),
                                       kv_events=owned.kv_events, counts_tokens=owned.counts_tokens)
            else:
                counters = _out_of_fds(manager.register_pool, pool_id, ranks)
        except BaseException:
            for rank in ranks:
                rank.close()
            raise
        try:
            if in_use.size:
                manager.reserve(pool_id, in_use)  # checked: cannot fail
            token = self._publish(session, counters)
        except BaseException:
            # Refused after the pool joined the manager (out of descriptors): it leaves
            # again — unmapped, its counter ring closed — and the session stays unregistered.
            manager.retire_pool(pool_id)
            raise
        self.sessions.attach(session, manager, pool_id)
        logger.info("session #%d registered pool %d: %d pages, spec %s", session.serial, pool_id,
                    ranks[0].num_pages, spec.fingerprint_hex)
        return p.RegisterReply(id=request_id, pool=pool_id,
                               counters=p.from_dict(p.CountersMsg, counters.handle(token).to_dict()),
                               page_size=spec.page_size, num_pages=ranks[0].num_pages)


    def _publish(self, session: Session, counters) -> bytes:
        """A read-only descriptor of the pool's counter ring, published for the
        session's engine to fetch once; withdrawn when the session ends, if it never
        was (:meth:`session_ended`)."""
        fds = self._fds()
        if fds is None:
            return b""
        token = fds.publish(_out_of_fds(counters.reader_fd), uid=session.creds.uid)
        session.published.append(token)
        return token

    def session_ended(self, session: Session) -> None:
        """Withdraw what was published for the session and never fetched."""
        fds = self._fds()
        if fds is not None:
            for token in session.published:
                fds.withdraw(token)
        session.published.clear()


def _out_of_fds(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with the daemon out of descriptors answered as such
    (``RESOURCE_EXHAUSTED``), not as a bug."""
    try:
        return fn(*args, **kwargs)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise ResourceExhausted(f"the daemon is out of file descriptors ({exc.strerror})") from None


class _CudaOwner:
    """What keeps a CUDA IPC allocation of an engine-owned pool known (its segment id);
    the mapping itself lives as long as its tensor."""

    def __init__(self, segment_id) -> None:
        self.segment_id = segment_id

    def close(self) -> None:
        pass


def _identity_name(session: Session) -> str | None:
    identity = session.creds.identity
    return None if identity is None else identity.name


def _scoped(session: Session, name: str) -> str:
    """An engine-owned pool's name as the tier managers know it: within the session's
    identity and (on ipc://) Unix user, so that nobody can take or probe another's
    (identity names have no ``/``; ``""`` names no pool)."""
    if not name:
        return ""
    uid = session.creds.uid
    return f"{_identity_name(session) or ''}/{'' if uid is None else uid}/{name}"
