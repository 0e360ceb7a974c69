"""Kill -9 safety: a writer process is SIGKILLed at random moments, again and again, on
one store; after each kill every record the store lists reads back intact, every batch
the store holds is complete (a put is all or nothing), and every batch the writer saw
committed is there.

The writer runs in a forkserver child (``lmdb_crash_child.write_until_killed``) that
opens the store itself, after the fork. The random delay only picks the moment of the
kill; no assertion depends on timing.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest

from hicache.storage.lmdb_backend import LmdbBackend, slot_bytes_for
from lmdb_crash_child import (
    CHURN_LAG,
    CHURN_PHASE,
    FINGERPRINT,
    READY,
    RECORDS_PER_BATCH,
    churn_size,
    churn_until_killed,
    record_content,
    record_key,
    record_size,
    write_until_killed,
)
from tiers_crash_child import NS, open_tiers, prompt, serve_until_killed

NUM_KILLS = 12
BATCH_IDS_PER_RUN = 1_000_000


def _run_and_kill(ctx, rng: random.Random, target, args: tuple) -> list[int]:
    """Start a writer, ``target(*args[:2], sender, *args[2:])``, let it run for a random
    while, SIGKILL it; the batch ids it reported committed. Most kills come after the
    store is open; some may land while it opens (and runs its start-up maintenance
    transaction)."""
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=target, args=(*args[:2], sender, *args[2:]), daemon=True)
    process.start()
    sender.close()
    if rng.random() < 0.8:
        assert receiver.poll(60), "the writer did not start"
        assert receiver.recv() == READY
        kill_after_s = rng.uniform(0.0, 0.25)
    else:
        kill_after_s = rng.uniform(0.0, 0.05)
    messages: list[int] = []
    kill_at = time.monotonic() + kill_after_s
    while (remaining_s := kill_at - time.monotonic()) > 0 and receiver.poll(remaining_s):
        messages.append(receiver.recv())
    process.kill()
    process.join()
    assert process.exitcode == -signal.SIGKILL
    try:  # what is still in the pipe was sent before the kill
        while receiver.poll():
            messages.append(receiver.recv())
    except EOFError:
        pass
    receiver.close()
    return [m for m in messages if m != READY]


def _check_store(path: str, committed: list[int], writemap: bool) -> int:
    with LmdbBackend(path, capacity_bytes=1 << 40, writemap=writemap) as store:
        listed = dict(store.iter_metadata())
        keys = list(listed)
        buffers = [np.empty(listed[k].payload_size, dtype=np.uint8) for k in keys]
        assert store.get(keys, buffers, fingerprint=FINGERPRINT) == [True] * len(keys)
        assert store.stats().corrupt_records == 0
        for key, buffer in zip(keys, buffers, strict=True):
            assert np.array_equal(buffer, record_content(key, record_size(key)))
        batch_sizes = Counter()
        for key, meta in listed.items():
            batch_id, index = np.frombuffer(meta.tokens, dtype="<i4").tolist()
            assert key == record_key(batch_id, index)
            batch_sizes[batch_id] += 1
        assert set(batch_sizes.values()) <= {RECORDS_PER_BATCH}, "a put was partly committed"
        for batch_id in committed:
            for index in range(RECORDS_PER_BATCH):
                key = record_key(batch_id, index)
                assert key in listed, f"batch {batch_id} was reported committed but record {index} is missing"
        store.check_invariants()
        return len(keys)


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    # Preload the heavy imports once. Python 3.11's forkserver ignores sys.path while
    # preloading, so the child module itself is imported by each child (cheap).
    ctx.set_forkserver_preload(["hicache.storage.lmdb_backend"])
    return ctx


needs_forkserver = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                                      reason="needs forkserver")


@needs_forkserver
@pytest.mark.parametrize("writemap", [False, True], ids=["malloc-pages", "writemap"])
def test_sigkill_never_loses_a_committed_batch_nor_shows_a_torn_record(tmp_path, writemap):
    ctx = _forkserver()
    rng = random.Random(20240611)
    path = str(tmp_path / "store")
    committed: list[int] = []
    num_records = 0
    for run in range(NUM_KILLS):
        # A small map makes the writer grow it now and then, so kills land around remaps too.
        reported = _run_and_kill(ctx, rng, write_until_killed, (path, run * BATCH_IDS_PER_RUN, 1 << 20, writemap))
        assert reported == sorted(reported)
        committed += reported
        num_records = _check_store(path, committed, writemap)
        assert num_records >= len(committed) * RECORDS_PER_BATCH
    assert committed, "no batch committed before any kill: the test did not test anything"


CHURN_KILLS = 10
CHURN_CAPACITY_BYTES = 4 << 20  # the churn's records take at most ~0.8 MiB: it never evicts
CHURN_IN_FLIGHT = 4  # churn_until_killed's default


def _check_churned_store(path: str, last: int) -> int:
    """Reopen the store after a kill (steps up to ``last`` reported committed) and check
    it; the slab files' disk bytes."""
    # Steps after ``last`` may have committed too, each in part (its put, not its delete).
    unsure = range(last + 1, last + CHURN_IN_FLIGHT + 2)
    with LmdbBackend(path, capacity_bytes=CHURN_CAPACITY_BYTES) as store:
        store.check_invariants()  # every slot used once, free or waiting; counts equal the store's
        listed = dict(store.iter_metadata())
        keys = list(listed)
        buffers = [np.empty(listed[k].payload_size, dtype=np.uint8) for k in keys]
        assert store.get(keys, buffers, fingerprint=FINGERPRINT) == [True] * len(keys)
        assert store.stats().corrupt_records == 0
        batches = Counter()
        for key, buffer in zip(keys, buffers, strict=True):
            batch_id, index = np.frombuffer(listed[key].tokens, dtype="<i4").tolist()
            assert key == record_key(batch_id, index)
            assert np.array_equal(buffer, record_content(key, churn_size(batch_id, index)))
            batches[batch_id] += 1
        assert set(batches.values()) <= {RECORDS_PER_BATCH}, "a put or a delete was partly committed"
        for batch_id in range(last + CHURN_IN_FLIGHT + 2):
            if batch_id <= last and batch_id + CHURN_LAG not in unsure and batch_id + CHURN_LAG > last:
                assert batch_id in batches, f"batch {batch_id}: its put committed, its delete did not start"
            if batch_id + CHURN_LAG <= last or batch_id > unsure[-1]:
                assert batch_id not in batches, f"batch {batch_id}: deleted, or never put"
        return sum(os.stat(os.path.join(path, name)).st_blocks * 512
                   for name in os.listdir(path) if name.startswith("slab-"))


@needs_forkserver
def test_sigkill_while_puts_and_deletes_turn_the_space_over_loses_nothing_committed(tmp_path):
    """Puts and deletes, the payload size shifting now and then (slots freed, files cut
    and punched): after each kill every record reads back as put, every committed step
    shows (a put present until its delete, a delete's batch gone), no slot is named
    twice nor lost, and the slab files hold no more than the live steps' records."""
    ctx = _forkserver()
    rng = random.Random(20250307)
    path = str(tmp_path / "store")
    last = -1
    # The most the live records' slots can take: the lag's batches and those in flight,
    # of the larger size (the open gives back the rest).
    bound = (CHURN_LAG + CHURN_IN_FLIGHT + 2) * max(
        sum(slot_bytes_for(churn_size(batch_id, i)) for i in range(RECORDS_PER_BATCH)) for batch_id in (0, CHURN_PHASE))
    for _ in range(CHURN_KILLS):
        reported = _run_and_kill(ctx, rng, churn_until_killed, (path, last + 1, CHURN_CAPACITY_BYTES))
        assert reported == list(range(last + 1, last + 1 + len(reported)))
        last += len(reported)
        assert _check_churned_store(path, last) <= bound
    assert last > 2 * CHURN_PHASE, "too few steps committed to shift the payload size: nothing tested"


TIERS_KILLS = 5


@needs_forkserver
def test_sigkill_of_a_tier_manager_serving_prompts_leaves_a_store_the_restart_serves_right(tmp_path):
    """A tier manager whose disk tier writes, evicts and deletes records is killed at
    random moments; after each kill a restarted one rebuilds from the store: every
    record the store holds reads back with its page's bytes, every page the rebuilt
    tree has on disk loads with them, and store and tree hold their invariants."""
    from tiers_util import SPEC, Engine, expected_page

    ctx = _forkserver()
    rng = random.Random(20250308)
    path = str(tmp_path / "store")
    served = 0
    restored = 0
    for _ in range(TIERS_KILLS):
        served += len(_run_and_kill(ctx, rng, serve_until_killed, (path, served)))
        engine = Engine(num_pages=64)
        store, tm = open_tiers(path, engine)
        try:
            tm.flush()
            tm.check_invariants()
            store.check_invariants()
            listed = dict(store.iter_metadata())
            keys = list(listed)
            buffers = [np.empty(SPEC.host_page_bytes, dtype=np.uint8) for _ in keys]
            assert store.get(keys, buffers, fingerprint=SPEC.fingerprint) == [True] * len(keys)
            assert all(buffer.tobytes() == expected_page(key) for key, buffer in zip(keys, buffers, strict=True))
            assert set(keys) == {k for n in tm.tree.nodes() if n.on_disk for k in n.page_key_list()}  # (no orphan)
            restored += len(keys)
            # The disk holds the most recent prompts' pages (and the one being served
            # when the kill came).
            for number in range(max(0, served - 64), served + 1):
                toks = prompt(number)
                hit = tm.match(NS, toks, 0).match
                if hit.node.parent is None:
                    continue
                tm.lock(hit.node, 0)
                loaded = tm.wait(tm.load(hit.node, 0))
                engine.wait(tm.pools.get(0).counters, loaded.wait)
                engine.check(NS, toks, loaded.device_pages)
                tm.unlock(hit.node, 0)
                tm.poll()
            tm.flush()
            tm.check_invariants()
        finally:
            tm.close()
            store.close()
            engine.close()
    assert restored, "no record survived any kill: the test did not test anything"
