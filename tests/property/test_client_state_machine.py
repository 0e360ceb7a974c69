"""CacheClient through daemon restarts, outages and orphan handles, against the fake
daemon of tests/fake_daemon.py.

Random sequences of prefill (alloc + insert), match, lock, load, unlock, alloc / release
of private pages, an insert that extends a loaded path, device eviction, daemon restart,
and the daemon going down and coming back run against one client. A model keeps what
the engine holds, as the engine sees it from the client's answers: its private pages,
its locks, and the pages it was told to use for each handle. Checked at every step:

* each re-registration declares in use exactly the private pages plus the pages of
  every path the engine still holds a lock on (each as of the moment of the reconnect);
* the last unlock of an orphan handle gives back exactly its pages that are still
  private and that no other held handle needs (a ``release``, or dropped when
  degraded), and the next registration no longer declares them;
* a call in degraded mode sends nothing, or one reconnect attempt when one is due —
  no call waits on a daemon that is gone;
* unlock and load of a handle the engine holds no lock on raise ``UNKNOWN_NODE`` /
  ``LOCK_UNDERFLOW`` in every mode;
* the fake's pages stay free / private / cached, never two at once.

The model follows the client's answers rather than predicting them, so a reply that
misses its (short) timeout on a busy machine changes the path an example takes, never
its verdict.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fake_daemon import FakeClock, FakeDaemon
from hicache.client import CacheClient, NodeHandle
from hicache.errors import ErrorCode, HicacheError, Unavailable
from tiers_util import SPEC, Engine

PS = SPEC.page_size
NUM_PAGES = 10
TIMEOUT_S = 2.0  # while the daemon answers: far beyond any hiccup of a busy machine
OUTAGE_TIMEOUT_S = 0.05  # while it does not: short, so that outages cost little
RETRY_S = 10.0
MAX_OUTAGES = 2
BLOCKS = [[1000 * b + i for i in range(PS)] for b in range(4)]

sequences = st.lists(st.integers(0, 3), min_size=1, max_size=4).map(lambda bs: [t for b in bs for t in BLOCKS[b]])


class ClientMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-client-"))
        self.fake = FakeDaemon(self.dir)
        self.engine = Engine(NUM_PAGES)
        self.clock = FakeClock()
        self.client = CacheClient(self.fake.endpoint, timeout_s=TIMEOUT_S, load_timeout_s=TIMEOUT_S,
                                  heartbeat=False, reconnect_interval_s=RETRY_S, clock=self.clock)
        self.client.register(SPEC, [self.engine.exported.handle])
        self.own: set[int] = set()  # pages the engine allocated and still holds
        self.private: set[int] = set()  # own + pages declared for orphans at a reconnect
        self.held: Counter[NodeHandle] = Counter()
        self.pages: dict[NodeHandle, list[int]] = {}  # what the engine was told to use, per handle
        self.tokens_of: dict[NodeHandle, list[int]] = {}
        self.loaded: set[NodeHandle] = set()  # held since a load the daemon answered
        self.stale: set[NodeHandle] = set()  # pages came with tickets, or an insert took some
        self.cut: set[NodeHandle] = set()  # orphans whose pages an insert took some of
        self.handles: list[NodeHandle] = []
        self.seen: list[list[int]] = []
        self.outages = 0
        self.may_attempt = False  # a reconnect attempt is due while degraded
        # A request in flight from the start: a restart then makes an orphan with pages.
        first = BLOCKS[0] + BLOCKS[1]
        self.prefill(first)
        m = self.client.match(first)
        self._learn(m.handle, m.device_pages, first, m.landing)
        self._lock(m.handle)
        self._load(m.handle)

    def teardown(self):
        if getattr(self, "client", None) is not None:
            self.client.close()
        if getattr(self, "fake", None) is not None:
            self.fake.close()
            assert self.fake.errors == []
            self.engine.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the model

    def _expected_in_use(self, private: set[int], held: Counter, pages: dict) -> set[int]:
        out = set(private)
        for handle, count in held.items():
            if count > 0:
                out.update(pages.get(handle, ()))
        return out

    def _snapshot(self):
        return set(self.private), Counter(self.held), dict(self.pages)

    def _run(self, call, snapshot=None):
        """Make one client call; check what it sent, and any re-registration against the
        model as of ``snapshot`` (the moment the client reconnects: before the call's
        own effect, unless the call said otherwise)."""
        snapshot = snapshot or self._snapshot()
        was_degraded, epoch = self.client.degraded, self.client.epoch
        mark = self.fake.count()
        try:
            result = call()
        except Unavailable as exc:
            result = exc
        with self.fake.lock:
            records = self.fake.received[mark:]
        sent = [r.op for r in records]
        if self.client.epoch != epoch:
            assert self.client.epoch == epoch + 1
            assert self.may_attempt or not was_degraded, "a reconnect that was not due"
            assert sent.count("register") == 1
            private, held, pages = snapshot
            declared = set(np.frombuffer(self.fake.last("register").message.in_use, "<i4").tolist())
            assert declared == self._expected_in_use(private, held, pages), (declared, snapshot)
            event(f"reconnect declaring {'orphan paths' if any(held.values()) else 'private pages only'}")
            self.private = declared
            self.pages = {h: pg for h, pg in self.pages.items() if held.get(h, 0) > 0}
            self.loaded &= {h for h, n in held.items() if n > 0}
            self.stale &= set(self.pages)
            self.may_attempt = False
        elif was_degraded:
            event("call in degraded mode")
            # Degraded: answered here, or after one reconnect attempt when one was due.
            assert sent in ([], ["hello"]), sent
            if sent:
                assert self.may_attempt, "a reconnect attempt that was not due"
                self.may_attempt = False
        if not was_degraded and self.client.degraded:
            self.may_attempt = True  # right after going down, the next call tries once
        return result, records

    def _learn(self, handle: NodeHandle | None, pages, tokens: list[int], wait=()) -> None:
        if handle is None:
            return
        if handle not in self.handles:
            self.handles.append(handle)
        if self.held[handle] <= 0:
            self.pages[handle] = np.asarray(pages).tolist()
            self.tokens_of[handle] = tokens
            if wait:
                self.stale.add(handle)
            else:
                self.stale.discard(handle)

    def _protected(self) -> set[int]:
        """Pages the daemon must not hand out: the engine's private pages and the paths it
        holds locks on in this session, as a load gave them (an orphan's pages an insert adopted are the new
        tree's, unprotected: see the module docstring of hicache.client)."""
        current = Counter({h: n for h, n in self.held.items() if h.epoch == self.client.epoch and h in self.loaded})
        return self._expected_in_use(self.private, current, self.pages)

    def _not_held_code(self, handle: NodeHandle) -> ErrorCode:
        if handle.epoch == self.client.epoch and handle in self.pages:
            return ErrorCode.LOCK_UNDERFLOW
        return ErrorCode.UNKNOWN_NODE

    # ------------------------------------------------------------------ rules

    @rule(tokens=sequences)
    def prefill(self, tokens):
        num = len(tokens) // PS
        pages, _ = self._run(lambda: self.client.alloc(num))
        if pages is None or isinstance(pages, Unavailable):
            assert pages is None or self.client.degraded
            return
        assert not set(pages.tolist()) & self._protected()
        self.own |= set(pages.tolist())
        self.private |= set(pages.tolist())
        self._insert(tokens, pages.tolist())

    def _insert(self, tokens, pages):
        r, _ = self._run(lambda: self.client.insert(tokens, pages))
        if r.handle is None:  # degraded: nothing taken
            assert r.device_pages.tolist() == pages
            return
        self.own -= set(pages)
        self.private -= set(pages)
        for handle in self._held():  # locked orphans lose the pages the new daemon took
            if handle.epoch != self.client.epoch and handle in self.pages:
                kept = [page for page in self.pages[handle] if page not in pages]
                if kept != self.pages[handle]:
                    self.pages[handle] = kept
                    self.stale.add(handle)
                    self.cut.add(handle)
        self._learn(r.handle, r.device_pages, tokens)
        self.seen.append(tokens)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def match(self, data):
        tokens = data.draw(st.sampled_from(self.seen))
        m, _ = self._run(lambda: self.client.match(tokens))
        self._learn(m.handle, m.device_pages, tokens, m.landing)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def match_lock_load(self, data):
        """A request's start: match, lock, load; the lock is kept (an unlock rule ends it)."""
        tokens = data.draw(st.sampled_from(self.seen))
        m, _ = self._run(lambda: self.client.match(tokens))
        self._learn(m.handle, m.device_pages, tokens, m.landing)
        if m.handle is not None:
            self._lock(m.handle)
            self._load(m.handle)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def lock(self, data):
        """Any handle handed out, of this session or an earlier one."""
        self._lock(data.draw(st.sampled_from(self.handles)))

    def _lock(self, handle: NodeHandle) -> None:
        self._run(lambda: self.client.lock(handle))
        self.held[handle] += 1

    def _held(self):
        return sorted(h for h, n in self.held.items() if n > 0)

    @precondition(lambda self: any(n > 0 for n in self.held.values()))
    @rule(data=st.data())
    def unlock(self, data):
        handle = data.draw(st.sampled_from(self._held()))
        orphan = handle.epoch != self.client.epoch
        self.held[handle] -= 1
        last = self.held[handle] == 0
        give: set[int] = set()
        if orphan and last:
            others = set()
            for h in self._held():
                others.update(self.pages.get(h, ()))
            give = (set(self.pages.get(handle, ())) & self.private) - others
            self.pages.pop(handle, None)
            self.stale.discard(handle)
        if last:
            self.loaded.discard(handle)
        _, records = self._run(lambda: self.client.unlock(handle), self._snapshot())
        ops = [r.op for r in records]
        if "register" in ops:  # a release the old session refused (UNKNOWN_SESSION) was sent again
            records = records[len(ops) - ops[::-1].index("register"):]
        released = [sorted(np.frombuffer(r.message.pages, "<i4").tolist()) for r in records if r.op == "release"]
        if give:
            event("orphan unlock gives pages back" + ("" if released else " (degraded: dropped here)"))
            assert released in ([sorted(give)], []), (released, give)
            assert released or self.client.degraded
        else:
            assert released == []
        self.private -= give

    @precondition(lambda self: any(n > 0 for n in self.held.values()))
    @rule(data=st.data())
    def load(self, data):
        self._load(data.draw(st.sampled_from(self._held())))

    def _load(self, handle: NodeHandle) -> None:
        ld, records = self._run(lambda: self.client.load(handle))
        answered = any(r.op == "load" for r in records) and not self.client.degraded \
            and handle.epoch == self.client.epoch
        if answered:
            self.pages[handle] = ld.device_pages.tolist()
            self.loaded.add(handle)
            if ld.wait:
                self.stale.add(handle)
            else:
                self.stale.discard(handle)
            tokens = self.tokens_of[handle][: len(ld.device_pages) * PS]
            self._learn(ld.handle, ld.device_pages, tokens, ld.wait)
            for layer in range(SPEC.num_layers):
                self.client.wait_layer(ld.wait, layer, timeout_s=10)
        else:  # nothing loaded: the pages the engine was last given, nothing to wait on
            event("load answered without the daemon")
            assert ld.num_loaded_pages == 0 and ld.wait == ()
            # (none if they came with tickets: nothing could be waited on now)
            expected = [] if handle in self.stale else self.pages.get(handle, [])
            assert ld.device_pages.tolist() == expected

    def _extendable(self) -> list[NodeHandle]:
        """Held handles whose pages came from a load: the daemon's locked pages (this
        epoch), or an orphan's pages the engine still has declared as its own."""
        return sorted(h for h in self.loaded if self.held[h] > 0 and self.pages.get(h) and h not in self.cut and (
            h.epoch == self.client.epoch or set(self.pages[h]) <= self.private))

    @precondition(lambda self: self._extendable())
    @rule(data=st.data(), block=st.integers(0, 3))
    def extend_loaded_path(self, data, block):
        """A conversation goes on: insert the loaded prefix's pages plus a new page
        (an orphan's pages are adopted by the new daemon's tree)."""
        handle = data.draw(st.sampled_from(self._extendable()))
        prefix = self.pages[handle]
        new, _ = self._run(lambda: self.client.alloc(1))
        if new is None or isinstance(new, Unavailable):
            return
        self.own |= set(new.tolist())
        self.private |= set(new.tolist())
        tokens = self.tokens_of[handle][: len(prefix) * PS] + BLOCKS[block]
        self._insert(tokens, prefix + new.tolist())

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), op=st.sampled_from(["unlock", "load"]))
    def not_held_is_an_error(self, data, op):
        candidates = [h for h in self.handles if self.held[h] <= 0] + [NodeHandle(7, self.client.epoch)]
        handle = data.draw(st.sampled_from(candidates))
        mark = self.fake.count()
        try:
            getattr(self.client, op)(handle)
        except HicacheError as exc:
            assert exc.code == self._not_held_code(handle), (exc, handle)
        else:
            raise AssertionError(f"{op} of a handle not held returned")
        assert self.fake.count() == mark  # checked here, without a round trip

    @rule(num=st.integers(1, 3))
    def hold_private(self, num):
        pages, _ = self._run(lambda: self.client.alloc(num))
        if pages is None or isinstance(pages, Unavailable):
            return
        assert not set(pages.tolist()) & self._protected()
        self.own |= set(pages.tolist())
        self.private |= set(pages.tolist())

    @precondition(lambda self: self.own)
    @rule(data=st.data())
    def release(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.own)), min_size=1, unique=True))
        self._run(lambda: self.client.release(pages))
        self.own -= set(pages)
        self.private -= set(pages)

    @rule()
    def evict(self):
        self.fake.evict()

    @rule()
    def restart(self):
        self.fake.restart()

    @precondition(lambda self: not self.fake.is_down and self.outages < MAX_OUTAGES)
    @rule()
    def down(self):
        self.outages += 1
        self.fake.down()
        self.client.timeout_s = self.client.load_timeout_s = OUTAGE_TIMEOUT_S

    @precondition(lambda self: self.fake.is_down)
    @rule()
    def up(self):
        self.fake.up()
        self.client.timeout_s = self.client.load_timeout_s = TIMEOUT_S
        self.clock.advance(RETRY_S)
        if self.client.degraded:
            self.may_attempt = True

    @invariant()
    def consistent(self):
        if getattr(self, "fake", None) is None:
            return
        self.fake.check()
        assert (self.client.session_id is None) == self.client.degraded


ClientMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_client_state_machine = ClientMachine.TestCase
