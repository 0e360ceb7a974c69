"""The daemon side of ``test_crash.py``'s warm-restart test: a tier manager over an
LmdbBackend that serves prompts until it is killed, its disk tier writing, evicting and
deleting records all the while.

A prompt is a pure function of its number (:func:`prompt`) and every page's bytes of
its page key (``tiers_util.expected_page``), so the parent can check whatever the store
holds without having seen it written.
"""

from __future__ import annotations

import numpy as np

from hicache.keys import namespace_id
from hicache.storage.lmdb_backend import LmdbBackend
from hicache.tiers import TierManager
from lmdb_crash_child import READY
from tiers_util import SPEC, Engine

NS = namespace_id(SPEC.fingerprint, "crash")
DISK_PAGES = 48  # the disk tier's capacity: prompts keep evicting and deleting records
HOST_PAGES = 16


def prompt(number: int) -> list[int]:
    """One of four two-page system prompts, then one to three pages of its own."""
    rng = np.random.default_rng(number)
    system = [1000 + number % 4] * (2 * SPEC.page_size)
    own = rng.integers(0, 50_000, int(rng.integers(1, 4)) * SPEC.page_size).tolist()
    return system + own


def open_tiers(path: str, engine: Engine) -> tuple[LmdbBackend, TierManager]:
    """The store and a tier manager over it, rebuilt from what the store holds."""
    store = LmdbBackend(path, capacity_bytes=DISK_PAGES * SPEC.host_page_bytes, max_batch_records=8)
    tm = TierManager(SPEC, host_pages=HOST_PAGES, storage=store)
    tm.add_namespace(NS)
    tm.register_pool(0, [engine.pool])
    tm.rebuild_from_storage()
    return store, tm


def serve_until_killed(path: str, first: int, conn) -> None:
    """Open the tiers (in this process), then prefill prompts from ``first`` on
    forever, sending each number once inserted; device pressure sends pages to host,
    host pressure to disk, and the disk tier evicts its LRU."""
    engine = Engine(num_pages=24)
    _, tm = open_tiers(path, engine)
    conn.send(READY)
    number = first
    while True:
        toks = prompt(number)
        hit = tm.match(NS, toks, 0).match
        tm.lock(hit.node, 0)
        new = tm.alloc(0, len(toks) // SPEC.page_size - hit.num_device_pages)
        if new is not None:
            pages = np.concatenate((hit.device_pages, new))
            engine.compute(NS, toks, pages)
            tm.insert(NS, toks, 0, pages)
        tm.unlock(hit.node, 0)
        tm.poll()
        conn.send(number)
        number += 1
