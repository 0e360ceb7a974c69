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
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest

from hicache.storage.lmdb_backend import LmdbBackend
from lmdb_crash_child import (
    FINGERPRINT,
    READY,
    RECORDS_PER_BATCH,
    record_content,
    record_key,
    record_size,
    write_until_killed,
)

NUM_KILLS = 12
BATCH_IDS_PER_RUN = 1_000_000


def _run_and_kill(ctx, path: str, run: int, rng: random.Random, writemap: bool) -> list[int]:
    """Start a writer, let it run for a random while, SIGKILL it; the batch ids it
    reported committed. Most kills come after the store is open; some may land while
    it opens (and runs its start-up maintenance transaction)."""
    receiver, sender = ctx.Pipe(duplex=False)
    # A small map makes the writer grow it now and then, so kills land around remaps too.
    process = ctx.Process(
        target=write_until_killed, args=(path, run * BATCH_IDS_PER_RUN, sender, 1 << 20, writemap), daemon=True
    )
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


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="needs forkserver")
@pytest.mark.parametrize("writemap", [False, True], ids=["malloc-pages", "writemap"])
def test_sigkill_never_loses_a_committed_batch_nor_shows_a_torn_record(tmp_path, writemap):
    ctx = multiprocessing.get_context("forkserver")
    # Preload the heavy imports once. Python 3.11's forkserver ignores sys.path while
    # preloading, so the child module itself is imported by each child (cheap).
    ctx.set_forkserver_preload(["hicache.storage.lmdb_backend"])
    rng = random.Random(20240611)
    path = str(tmp_path / "store")
    committed: list[int] = []
    num_records = 0
    for run in range(NUM_KILLS):
        reported = _run_and_kill(ctx, path, run, rng, writemap)
        assert reported == sorted(reported)
        committed += reported
        num_records = _check_store(path, committed, writemap)
        assert num_records >= len(committed) * RECORDS_PER_BATCH
    assert committed, "no batch committed before any kill: the test did not test anything"
