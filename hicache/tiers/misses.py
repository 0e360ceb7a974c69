"""Why a page is not cached: the tier it was last evicted from, else ``never_stored``.

Evictions are remembered in a fixed-size, set-associative table (:class:`EvictionLog`):
``slots`` entries of 4 bytes in sets of :data:`WAYS`; a page key (a uniform hash) picks
its set with its first 8 bytes and is stored as a tag of 29 bits from the other 8 (and a
set bit, so that no entry is 0), with the tier in the low 2 bits. A set forgets its
oldest entry when a new key arrives in a full set (FIFO per set). Memory is ``4 * slots`` bytes whatever the traffic (default 2^22
slots: 16 MiB), from the first eviction on: a tier manager that never evicts (a KV spec
registered and left, one of many models on a node) costs nothing for it.

Stated error, for eviction counts measured in pages:

* a page evicted within the last ``slots / 4`` evictions is remembered unless its set
  received 16 newer ones — a Poisson tail: less than 1e-5 of them are forgotten; within
  the last ``slots / 2``, less than 1 %; older evictions fade out (reported
  ``never_stored``);
* a page never evicted is reported ``evicted_*`` only if its tag collides in its set:
  about ``16 * 2^-29`` (3e-8) per lookup. (8-byte entries with 61-bit tags made
  that 7e-18 at twice the memory: 64 bytes a cached page in ``bench_scale``.)

(The previous log remembered the last 2^18 keys exactly in an ordered dict at ~120 bytes
each; a trace with more evictions than that booked the older ones as ``never_stored``.)
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hicache.keys import PAGE_KEY_BYTES, TOKEN_BYTES, NamespaceId, PageKey, chain_page_keys
from hicache.metrics import NullMetrics
from hicache.tree import MatchResult, Node, Tier

WAYS = 16
PENDING_KEYS = 4096  # evicted page keys that wait at most before they are recorded
EVICTION_SLOTS = 1 << 22
_SMALL = 8  # batches up to this many keys take the plain-int path
_TAG_SHIFT = 35  # a tag: the top 29 bits of the key's last 8 bytes ...
_TAG_TOP = 1 << 29  # ... and this bit set, so that no entry is 0 (an empty slot)
_TIERS = tuple(Tier)


class EvictionLog:
    """The tier each recently evicted page key left last (see the module docstring)."""

    def __init__(self, slots: int = EVICTION_SLOTS) -> None:
        self._sets = max(1, slots // WAYS)
        self._table: np.ndarray | None = None  # made at the first eviction (see _allocate)
        self._cursor = np.zeros(0, dtype=np.uint8)  # the next way to overwrite, per set

    def _allocate(self) -> None:
        """The table, at the first record. Written through now, not as evictions reach
        its sets: its memory is resident from then on (a fixed cost, not growth with
        the cache). The cursor first: a reader (:meth:`tier`, on another thread) looks
        at the table only."""
        self._cursor = np.zeros(self._sets, dtype=np.uint8)
        table = np.empty((self._sets, WAYS), dtype=np.uint32)
        table.fill(0)
        self._table = table

    @property
    def slots(self) -> int:
        return self._sets * WAYS

    @property
    def nbytes(self) -> int:
        """Memory held: none until the first eviction."""
        return 0 if self._table is None else self._table.nbytes + self._cursor.nbytes

    def _split(self, packed_keys: bytes) -> tuple[np.ndarray, np.ndarray]:
        words = np.frombuffer(packed_keys, dtype="<u8").reshape(-1, PAGE_KEY_BYTES // 8)
        sets = (words[:, 0] % np.uint64(self._sets)).astype(np.int64)
        tags = (words[:, 1] >> np.uint64(_TAG_SHIFT)) | np.uint64(_TAG_TOP)  # never 0: 0 is an empty slot
        return sets, tags.astype(np.uint32)

    def _locate(self, page_key: bytes) -> tuple[int, int]:
        """(set, tag) of one key, in plain ints (the same as :meth:`_split`)."""
        return (int.from_bytes(page_key[:8], "little") % self._sets,
                (int.from_bytes(page_key[8:16], "little") >> _TAG_SHIFT) | _TAG_TOP)

    def record(self, packed_keys: bytes, tier: Tier) -> None:
        """These page keys (16 bytes each, concatenated) left ``tier``."""
        if not packed_keys:
            return
        if self._table is None:
            self._allocate()
        if len(packed_keys) <= _SMALL * PAGE_KEY_BYTES:  # a few keys: plain ints beat numpy's set-up
            code = _TIERS.index(tier)
            table, cursor = self._table, self._cursor
            for j in range(0, len(packed_keys), PAGE_KEY_BYTES):
                s, t = self._locate(packed_keys[j : j + PAGE_KEY_BYTES])
                entry = t << 2 | code
                for way, value in enumerate(table[s].tolist()):
                    if value >> 2 == t:
                        break
                else:
                    way = int(cursor[s])
                    cursor[s] = (way + 1) % WAYS
                table[s, way] = entry
            return
        sets, tags = self._split(packed_keys)
        code = np.uint32(_TIERS.index(tier))
        table, cursor = self._table, self._cursor
        while len(sets):
            # One key per set in each round (keys of one batch rarely share a set).
            _, first = np.unique(sets, return_index=True)
            s, t = sets[first], tags[first]
            rows = table[s]
            same = (rows >> np.uint32(2)) == t[:, None]
            known = same.any(axis=1)
            entry = (t << np.uint32(2)) | code
            table[s[known], same[known].argmax(axis=1)] = entry[known]
            fresh = ~known
            s_new = s[fresh]
            ways = cursor[s_new]
            table[s_new, ways] = entry[fresh]
            cursor[s_new] = (ways + 1) % WAYS
            if len(first) == len(sets):
                break
            rest = np.ones(len(sets), dtype=bool)
            rest[first] = False
            sets, tags = sets[rest], tags[rest]

    def tier(self, page_key: PageKey) -> Tier | None:
        """The tier this page was last evicted from, if it is remembered."""
        table = self._table
        if table is None:
            return None
        s, t = self._locate(bytes(page_key))
        for value in table[s].tolist():
            if value >> 2 == t:
                return _TIERS[value & 3]
        return None


class MissReasons:
    """The eviction log behind the miss reasons. Evictions are recorded in batches, off
    the owner thread: a node's keys wait in a list until :data:`PENDING_KEYS` keys wait
    (an eviction step drops many small nodes, and one vectorized record of all their
    keys costs about what one node's did), then the batch goes to a thread of its own
    that records it. A reason looks at the keys still waiting or being recorded first,
    newest first, then at the log — so it is the same as if every eviction had been
    recorded at once, in the order the pages left their tiers.

    (Recorded on the owner thread, before each reason it was asked for, a batch took
    5 ms of a ``match``'s bookkeeping on average and up to 30: its dozen numpy steps each
    let the disk writer's threads take the interpreter — the slowest ``lock`` calls of
    ``bench_scale`` waited behind it.)"""

    def __init__(self, metrics=None, slots: int = EVICTION_SLOTS) -> None:
        self.metrics = metrics if metrics is not None else NullMetrics()
        self._log = EvictionLog(slots)
        self._pending: list[tuple[Tier, bytes]] = []
        self._num_pending = 0
        self._recording: deque[list[tuple[Tier, bytes]]] = deque()  # handed to the recorder, oldest first
        self._recorder: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self._log.nbytes

    def evicted(self, node: Node, tier: Tier, *, moving_on: bool = False) -> None:
        """``node``'s pages are leaving ``tier`` (and the cache, if it is their last).
        ``moving_on``: to a tier the tree does not record (the remote tier's write-back),
        so not dropped yet — the write-back counts those it does not put."""
        self._pending.append((tier, node.page_keys))
        self._num_pending += node.num_pages
        if self._num_pending >= PENDING_KEYS:
            self._hand_off()
        self.metrics.evicted(tier, node.num_pages)
        if len(node.residency) == 1 and not moving_on:
            self.metrics.dropped(tier, node.num_pages)

    def _hand_off(self) -> None:
        pending, self._pending, self._num_pending = self._pending, [], 0
        self._recording.append(pending)
        if self._closed:  # (evictions after close: recorded here)
            self._record(pending)
            return
        if self._recorder is None:
            self._recorder = ThreadPoolExecutor(1, thread_name_prefix="hicache-eviction-log")
        self._last = self._recorder.submit(self._record, pending)

    def _record(self, pending: list[tuple[Tier, bytes]]) -> None:
        """One batch into the log, a record per run of one tier, in order (recorder)."""
        try:
            for tier, run in itertools.groupby(pending, key=lambda item: item[0]):
                self._log.record(b"".join(keys for _, keys in run), tier)
        finally:
            self._recording.popleft()  # (FIFO: it is the oldest)

    def flush(self) -> None:
        """Record every eviction that waits, and return once they are in the log."""
        if self._pending:
            self._hand_off()
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        self._closed = True
        if self._recorder is not None:
            self._recorder.shutdown(wait=True)

    def reason(self, page_key: PageKey) -> str:
        """``evicted_<tier>`` if this page's eviction is remembered, else ``never_stored``."""
        key = bytes(page_key)
        tier = _newest(self._pending, key)
        if tier is None:
            for batch in reversed(list(self._recording)):  # (a copy: the recorder pops from it)
                tier = _newest(batch, key)
                if tier is not None:
                    break
            else:
                tier = self._log.tier(key)
        return f"evicted_{tier.label}" if tier is not None else "never_stored"

    def after(self, namespace: NamespaceId, tokens: bytes, match: MatchResult) -> str:
        """The reason for the first page after ``match`` (a match of the packed
        ``tokens``); ``never_stored`` for a partial page."""
        ps = match.page_size
        start = match.num_tokens * TOKEN_BYTES
        page = tokens[start : start + ps * TOKEN_BYTES]
        if len(page) < ps * TOKEN_BYTES or match.node is None:
            return "never_stored"
        return self.reason(chain_page_keys(namespace, match.node.last_page_key, page, ps))


def _newest(batch: list[tuple[Tier, bytes]], key: bytes) -> Tier | None:
    """The tier ``key`` left last within ``batch`` (runs of packed keys, oldest first)."""
    for tier, keys in reversed(batch):
        at = keys.find(key)
        while at >= 0:
            if at % PAGE_KEY_BYTES == 0:
                return tier
            at = keys.find(key, at + 1)
    return None
