"""``register``: an engine's device pool joins its KV spec's tier manager.

The spec, its fingerprint and the page-key self-test are checked, then every rank's
pool is mapped: a CPU pool is a sealed memfd segment its engine offered on the
descriptor socket (:mod:`hicache.fdpass`), named by token, and mapped only if the user
who offered it is the session's (when the transport tells), owns the segment, and the
segment is not already mapped as another pool (same device and inode); a GPU pool's
IPC handle is refused likewise if it is already registered. Everything is checked and
mapped before the session changes: a refused registration leaves it unregistered, as
it was (and free to try again), and drops the descriptors it named (the engine offers
them again with its retry). The first registration of a spec may wait for its disk
tier's rebuild (:mod:`hicache.daemon.specs`): it is answered when that is done.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from hicache import protocol as p
from hicache.daemon.sessions import Session, Sessions
from hicache.daemon.specs import Specs
from hicache.errors import InvalidArgument, SpecMismatch, UnknownSession
from hicache.fdpass import FdExchange
from hicache.keys import key_self_test
from hicache.pages import distinct_page_ids
from hicache.pools import DevicePool, PoolHandle
from hicache.shm import SharedBuffer
from hicache.spec import KVSpec
from hicache.tiers import TierManager
from hicache.tree import PoolId

logger = logging.getLogger(__name__)


class Registrar:
    """Owner thread only."""

    def __init__(self, sessions: Sessions, specs: Specs, fds: Callable[[], FdExchange | None],
                 clock: Callable[[], float]) -> None:
        """``fds()``: the descriptor exchange now (the server sets it after the daemon is made)."""
        self.sessions = sessions
        self.specs = specs
        self._fds = fds
        self.clock = clock
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
        if len(m.pools) != spec.tp_size:
            raise InvalidArgument(f"a TP group of {spec.tp_size} registers {spec.tp_size} pool handles, "
                                  f"got {len(m.pools)}")
        handles = [PoolHandle.from_dict(p.as_dict(handle)) for handle in m.pools]
        ranks: list[DevicePool] = []
        try:
            for handle in handles:
                ranks.append(DevicePool.attach(handle, expected=spec, segment=lambda h: self._segment(session, h)))
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
            return self._attach(session, m.id, spec, ranks, in_use, manager)
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
                out.set_result(self._attach(session, m.id, spec, ranks, in_use, result))
            except BaseException as exc:  # _attach closed the ranks
                out.set_exception(exc)

        self.specs.wait(spec, session, ranks, rebuilt)
        return out

    def _segment(self, session: Session, handle: PoolHandle) -> SharedBuffer:
        """Map the memfd segment offered under ``handle.token``: only if the user who
        offered it is the session's (when the transport says who that is) and owns it."""
        fds = self._fds()
        offer = fds.take(handle.token) if fds is not None else None
        if offer is None:
            raise InvalidArgument("no descriptor was offered under this pool's token (offer it on the "
                                  "descriptor socket first; an offer is used once and expires)")
        uid = session.creds.uid
        if uid is not None and offer.uid != uid:
            os.close(offer.fd)
            raise InvalidArgument(f"the pool's descriptor was offered by uid {offer.uid}, not by the session's user")
        return SharedBuffer.attach(offer.fd, handle.nbytes, uid=offer.uid)

    def _attach(self, session: Session, request_id: int, spec: KVSpec, ranks: list[DevicePool],
                in_use: np.ndarray, manager: TierManager) -> p.RegisterReply:
        """The end of a registration: the session's pool joins its spec's manager."""
        pool_id = PoolId(next(self._pool_ids))
        try:
            counters = manager.register_pool(pool_id, ranks)
        except BaseException:
            for rank in ranks:
                rank.close()
            raise
        if in_use.size:
            manager.reserve(pool_id, in_use)  # checked: cannot fail
        fds = self._fds()
        token = fds.publish(counters.reader_fd(), uid=session.creds.uid) if fds is not None else b""
        self.sessions.attach(session, manager, pool_id)
        logger.info("session #%d registered pool %d: %d pages, spec %s", session.serial, pool_id,
                    ranks[0].num_pages, spec.fingerprint_hex)
        return p.RegisterReply(id=request_id, pool=pool_id,
                               counters=p.from_dict(p.CountersMsg, counters.handle(token).to_dict()),
                               page_size=spec.page_size, num_pages=ranks[0].num_pages)
