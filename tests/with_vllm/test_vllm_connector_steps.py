"""The vLLM connector driven step by step (``connector_harness``: both roles in this
process, fake vLLM scheduler objects, a real daemon over real sockets) — what needs no
engine: stores and loads across requests, failed loads, namespaces, the spec's model
identity, a daemon that is down, slow or stopped, and shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from connector_harness import (  # noqa: E402
    BS,
    LAYER_NAMES,
    Engine,
    blocks,
    cached_output,
    empty_output,
    first_request_stores,
    kv_cache_config,
    kv_caches,
    new_req_output,
    request,
    vllm_config,
    wait_until,
)
from daemon_util import DaemonProcess  # noqa: E402
from hicache.client import CacheClient  # noqa: E402
from hicache.errors import ErrorCode, Unavailable  # noqa: E402
from hicache.integrations.vllm import Hit, HicacheConnector, KVConnectorRole, model_identity  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

HERE = Path(__file__).resolve().parent
STALE = 3.0  # what a block holds from the request that used it before
PAGE_BYTES = 2 * 2 * 16 * 2 * 32 * 2  # one page of every layer of the harness's spec


@pytest.fixture
def small_daemon(tmp_path):
    """Host room for 6 pages, no disk: a page that is evicted is gone."""
    d = DaemonProcess(tmp_path, host={"bytes": 6 * PAGE_BYTES}, disk={"enabled": False}).start()
    yield d
    if d.proc is not None:
        d.stop()


def second_request_matches(e, p):
    """Request r2 of the same prompt ``p`` is new to the scheduler, which finds its
    whole pages but the last token's in hicache; returns r2 and the tokens matched."""
    r2 = request("r2", p)
    e.scheduler.on_new_request(r2)
    ext, _ = e.scheduler.get_num_new_matched_tokens(r2, 0)
    assert ext == 4 * BS
    return r2, ext


def hit_evicted_before_its_alloc(e, p, r2_blocks=(11, 12, 13, 14, 15)):
    """Request r2 of ``p`` (its first four pages stored by r1) matches in hicache, then
    another prompt fills the host tier before vLLM allocates r2's blocks (stale values)
    and the scheduler starts their load, which falls short. Returns r2, its blocks and
    the tokens matched."""
    r2, ext = second_request_matches(e, p)
    q = list(range(5000, 5000 + 6 * BS + 1))
    e.prefill(request("q", q), [20, 21, 22, 23, 24, 25, 26], 5.0)
    e.finish(request("q", q), [20, 21, 22, 23, 24, 25, 26])
    r2_blocks = list(r2_blocks)
    e.fill(r2_blocks, STALE)
    e.scheduler.update_state_after_alloc(r2, blocks(r2_blocks), ext)
    return r2, r2_blocks, ext


def hit_evicted_before_its_load(e, p):
    """``hit_evicted_before_its_alloc``, then r2's step: it reports the four blocks
    the load was to fill (vLLM recomputes them next step). Returns r2 and its blocks."""
    r2, r2_blocks, ext = hit_evicted_before_its_alloc(e, p)
    # vLLM: num_computed_tokens = local + external; the rest of the prompt scheduled.
    errors = e.step(new_req_output("r2", r2_blocks, ext, len(p) - ext), forward=lambda: e.fill(r2_blocks[4:], STALE))
    assert set(r2_blocks[:4]) <= errors
    return r2, r2_blocks


def later_request_loads_no_stale_kv(e, p, r4_blocks=(16, 17, 18, 19, 27)):
    """Request r4 of ``p`` into blocks of its own: what hicache loads into them holds
    nothing of a stale block's (``STALE``), nor of what was computed on top of one.
    Returns the tokens loaded and their blocks' values."""
    r4_blocks = list(r4_blocks)
    e.fill(r4_blocks, 0.0)
    ext, _ = e.prefill(request("r4", p), r4_blocks, 1.0)
    loaded = e.values(r4_blocks[: ext // BS])
    assert STALE not in set().union(*loaded), f"hicache cached stale KV: r4 loaded {loaded}"
    return ext, loaded


def test_a_prompt_one_request_stored_is_loaded_into_the_next_ones_blocks(daemon):
    e = Engine(daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        ext, errors = e.prefill(request("r2", p), [6, 7, 8, 9, 10], 9.0)
        assert ext == 4 * BS and not errors
        assert e.values([6, 7, 8, 9]) == [{7.0}] * 4
        assert e.values([10]) == [{9.0}]
    finally:
        e.close()



def test_vllm_counts_a_hits_tokens_by_the_tier_that_held_them(tmp_path):
    """vLLM splits a connector's hit by ``get_external_cache_hit_sources`` (its
    ``vllm:prompt_tokens_cached_by_source``): the pages hicache loads from host count as
    host, from disk as disk, past vLLM's own device hit. Before, every hit counted as
    host — a cache served from disk after a restart looked like one served from memory."""
    host, disk = CacheHitSource.HOST, CacheHitSource.DISK
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}).start()
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        e = Engine(d.endpoint)
        try:
            first_request_stores(e, p)
            for req_id, local_hit, blocks_ in (("r2", 0, [6, 7, 8, 9, 10]), ("r3", BS, [1, 11, 12, 13, 14])):
                r = request(req_id, p)
                ext, errors = e.prefill(r, blocks_, 9.0, local_hit=local_hit)
                assert not errors and ext == 4 * BS - local_hit
                assert e.scheduler.get_external_cache_hit_sources(r, ext) == {host: ext}
                e.finish(r, blocks_)
            admin = CacheClient(d.endpoint, heartbeat=False)
            assert admin.flush()["not_on_disk_pages"] == 0
            admin.close()
        finally:
            e.close()
        d.stop()
        d.start()  # (the host tier is gone; the disk tier is not)
        e = Engine(d.endpoint, "e2")
        try:
            q = p[: 2 * BS + 1]  # the first two pages: from disk, and on host from now on
            r = request("q", q)
            ext, errors = e.prefill(r, [1, 2, 3], 9.0)
            assert not errors and e.scheduler.get_external_cache_hit_sources(r, ext) == {disk: 2 * BS}
            assert e.values([1, 2]) == [{7.0}] * 2
            e.finish(r, [1, 2, 3])
            r = request("r4", p)
            ext, errors = e.prefill(r, [4, 5, 6, 7, 8], 9.0)
            assert not errors and ext == 4 * BS
            assert e.scheduler.get_external_cache_hit_sources(r, ext) == {host: 2 * BS, disk: 2 * BS}
            assert e.values([4, 5, 6, 7]) == [{7.0}] * 4
            e.finish(r, [4, 5, 6, 7, 8])
            assert not e.scheduler._sources  # (nothing kept of a finished request)
        finally:
            e.close()
    finally:
        if d.proc is not None:
            d.stop()


def test_a_hits_pages_by_tier_are_host_then_disk_then_remote_from_vllms_first_block_on():
    """The path a match found is its host pages, its disk-only pages, then the pages
    just brought from the remote tier (a remote store: vLLM's ``external_unspecified``);
    what vLLM asks about starts past its own device hit and ends with the load."""
    hit = Hit([object()], 7, (2, 3, 2))
    host, disk, remote = CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
    assert hit.sources(0, 7) == {host: 2, disk: 3, remote: 2}
    assert hit.sources(1, 3) == {host: 1, disk: 2}
    assert hit.sources(2, 3) == {disk: 3}
    assert hit.sources(4, 3) == {disk: 1, remote: 2}
    assert Hit([object()], 3, (3, 0, 0)).sources(1, 2) == {host: 2}


def test_after_vllm_resets_its_caches_it_loads_nothing_stored_before(daemon):
    """vLLM empties its caches after a weight update (``reset_prefix_cache`` with
    ``reset_connector=True``, which ``pause_generation(clear_cache=True)`` makes) and
    counts on the connector to: what hicache holds was computed with the old weights.
    From then on the engine misses it (before, ``reset_cache`` was vLLM's default — "not
    implemented", taken for done — and the engine loaded the old KV), stores the prompt
    afresh and hits that; a request half through its prefill at the reset stores nothing
    more; an engine that was not reset still hits the old pages, and only those."""
    a = Engine(daemon.endpoint, "e1")
    b = Engine(daemon.endpoint, "e2")
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(a, p)  # 7.0: the old weights' KV
        q = list(range(3000, 3000 + 4 * BS + 1))
        rq = request("q", q)
        a.scheduler.on_new_request(rq)
        assert a.scheduler.get_num_new_matched_tokens(rq, 0) == (0, False)
        a.scheduler.update_state_after_alloc(rq, blocks([20, 21, 22, 23, 24]), 0)
        a.step(new_req_output("q", [20, 21, 22, 23, 24], 0, 2 * BS), forward=lambda: a.fill([20, 21], 7.0))
        assert a.scheduler.reset_cache() is True
        assert a.worker.reset_cache() is None  # (vLLM asks the scheduler's only)
        a.step(cached_output("q", 2 * BS, len(q) - 2 * BS), forward=lambda: a.fill([22, 23, 24], 8.0))
        a.finish(rq, [20, 21, 22, 23, 24])

        ext, errors = a.prefill(request("r2", p), [6, 7, 8, 9, 10], 8.0)
        assert ext == 0 and not errors, "the old weights' KV was loaded after the reset"
        a.finish(request("r2", p), [6, 7, 8, 9, 10])
        ext, _ = a.prefill(request("r3", p), [11, 12, 13, 14, 15], 0.0)
        assert ext == 4 * BS and a.values([11, 12, 13, 14]) == [{8.0}] * 4
        ext, _ = a.prefill(request("q2", q), [25, 26, 27, 28, 29], 9.0)
        assert ext == 0  # (q's first chunk is of before the reset; its second was not stored)

        ext, _ = b.prefill(request("r4", p), [1, 2, 3, 4, 5], 0.0)
        assert ext == 4 * BS and b.values([1, 2, 3, 4]) == [{7.0}] * 4
        ext, _ = b.prefill(request("q3", q), [6, 7, 8, 9, 10], 0.0)
        assert ext == 2 * BS and b.values([6, 7]) == [{7.0}] * 2
    finally:
        b.close()
        a.close()



def test_a_producer_only_stores_and_a_consumer_only_loads(daemon):
    """vLLM's ``kv_role`` in a disaggregated deployment: the prefill instance
    (``kv_producer``) stores what it computes and never loads — not even what hicache
    holds — and the decode instance (``kv_consumer``) loads and never stores."""
    producer = Engine(daemon.endpoint, "prefill", kv_role="kv_producer")
    consumer = Engine(daemon.endpoint, "decode", kv_role="kv_consumer")
    both = Engine(daemon.endpoint, "both")
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(producer, p)  # (stores: value 7.0)
        ext, _ = producer.prefill(request("again", p), [6, 7, 8, 9, 10], 8.0)
        assert ext == 0  # (hicache holds it: a producer computes all the same)
        ext, _ = consumer.prefill(request("r2", p), [1, 2, 3, 4, 5], 0.0)
        assert ext == 4 * BS and consumer.values([1, 2, 3, 4]) == [{7.0}] * 4
        q = list(range(900, 900 + 3 * BS + 1))
        ext, _ = consumer.prefill(request("q", q), [11, 12, 13, 14], 5.0)
        assert ext == 0
        consumer.finish(request("q", q), [11, 12, 13, 14])
        ext, _ = both.prefill(request("q2", q), [1, 2, 3, 4], 0.0)
        assert ext == 0, "a consumer stored what it computed"
    finally:
        both.close()
        consumer.close()
        producer.close()

def test_two_engines_configured_with_the_same_pool_name_each_load_into_their_own_blocks(daemon):
    """Two engines of one user started from one configuration (the same
    ``hicache.pool_name``): each registers a pool of its own (the name qualified by its
    engine id) and its scheduler's loads go to its own blocks. Before, the second
    worker's registration was refused (the name in use) and its scheduler attached to
    the first engine's pool: its loads wrote the first engine's blocks, under a running
    request."""
    a = Engine(daemon.endpoint, "e1", **{"hicache.pool_name": "shared"})
    b = Engine(daemon.endpoint, "e2", **{"hicache.pool_name": "shared"})
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(a, p)
        a.fill([6, 7, 8, 9, 10], 4.0)  # a request of A's own in those blocks
        ext, errors = b.prefill(request("r2", p), [6, 7, 8, 9, 10], 9.0)
        assert a.values([6, 7, 8, 9, 10]) == [{4.0}] * 5, "B's load wrote A's blocks"
        assert ext == 4 * BS and not errors
        assert b.values([6, 7, 8, 9]) == [{7.0}] * 4
        assert a.worker._client is not None and b.worker._client is not None, "a worker was refused its pool"
    finally:
        b.close()
        a.close()


def test_pages_loaded_from_hicache_are_not_stored_again(daemon):
    """A hit's pages are hicache's already: the step that loads them sends no store (a
    round trip that would copy nothing); a longer prompt stores its own new pages."""
    e = Engine(daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        stores = []
        client = e.worker._client
        store = client.store
        client.store = lambda tokens, pages, *rest, **kw: (stores.append(len(pages)), store(tokens, pages, *rest, **kw))[1]
        ext, errors = e.prefill(request("r2", p), [6, 7, 8, 9, 10], 9.0)
        assert ext == 4 * BS and not errors
        assert stores == []  # all 4 whole pages came from hicache
        e.finish(request("r2", p), [6, 7, 8, 9, 10])

        longer = p[: 4 * BS] + list(range(7000, 7000 + 2 * BS + 1))
        ext, errors = e.prefill(request("r3", longer), [11, 12, 13, 14, 15, 16, 17], 4.0)
        assert ext == 4 * BS and not errors
        assert stores == [6]  # its two new pages (the daemon copies only what it lacks)
        e.finish(request("r3", longer), [11, 12, 13, 14, 15, 16, 17])
        ext, _ = e.prefill(request("r4", longer), [18, 19, 20, 21, 22, 23, 24], 0.0)
        assert ext == 6 * BS and e.values([22, 23]) == [{4.0}] * 2
    finally:
        e.close()


def test_a_request_preempted_mid_prefill_stores_the_rest_from_its_new_blocks(daemon):
    """vLLM preempts a request between two chunks of its prefill and frees its blocks
    (another request writes into them); resumed, it has other blocks (all of them in
    ``new_block_ids``, its id in ``resumed_req_ids``), hicache loads the pages it
    stored into the first, and the rest of the prompt is stored from the new ones."""
    e = Engine(daemon.endpoint)
    try:
        p = list(range(100, 100 + 5 * BS + 3))
        r1 = request("r1", p)
        s = e.scheduler
        s.on_new_request(r1)
        assert s.get_num_new_matched_tokens(r1, 0) == (0, False)
        s.update_state_after_alloc(r1, blocks([1, 2, 3, 4, 5, 6]), 0)
        e.step(new_req_output("r1", [1, 2, 3, 4, 5, 6], 0, 2 * BS), forward=lambda: e.fill([1, 2], 7.0))
        e.fill([1, 2, 3, 4, 5, 6], STALE)  # preempted: its blocks went to another request

        ext, _ = s.get_num_new_matched_tokens(r1, 0)
        assert ext == 2 * BS
        new_blocks = [10, 11, 12, 13, 14, 15]
        s.update_state_after_alloc(r1, blocks(new_blocks), ext)
        cached = SimpleNamespace(req_ids=["r1"], resumed_req_ids={"r1"}, new_block_ids=[(list(new_blocks),)],
                                 num_computed_tokens=[ext])
        resumed = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                                  num_scheduled_tokens={"r1": len(p) - ext})
        assert not e.step(resumed, forward=lambda: e.fill(new_blocks[2:], 7.0))
        assert e.values(new_blocks[:2]) == [{7.0}] * 2  # loaded
        e.finish(r1, new_blocks)

        ext, errors = e.prefill(request("r2", p), [20, 21, 22, 23, 24, 25], 9.0)
        assert ext == 5 * BS and not errors
        assert e.values([20, 21, 22, 23, 24]) == [{7.0}] * 5
    finally:
        e.close()


def test_a_failed_load_is_not_stored_as_the_prompts_kv(small_daemon):
    """A hit that cannot be loaded (here its pages are evicted between the match and
    the alloc; likewise a short load, a failed disk read, a timed-out wait) leaves the
    target blocks with what they held before, and the rest of the prompt is computed on
    top of them. The worker reports them, vLLM recomputes the request — and none of
    those blocks may be stored under the prompt's tokens meanwhile; the recomputed ones
    are."""
    e = Engine(small_daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)

        r2, r2_blocks = hit_evicted_before_its_load(e, p)
        # vLLM's recompute step (num_computed_tokens truncated to the first failed block)
        e.step(cached_output("r2", 0, len(p)), forward=lambda: e.fill(r2_blocks, 7.0))
        e.finish(r2, r2_blocks)

        r3 = request("r3", p)
        r3_blocks = [16, 17, 18, 19, 27]
        e.fill(r3_blocks, 0.0)
        ext, errors = e.prefill(r3, r3_blocks, 7.0)
        assert ext == 4 * BS and not errors  # the recompute was stored
        assert e.values(r3_blocks[:4]) == [{7.0}] * 4
    finally:
        e.close()


def test_with_a_draft_model_a_failed_load_is_not_stored_as_the_prompts_kv(small_daemon):
    """An engine with speculative decoding collects a step's connector output (the
    failed loads) before its stores run (vLLM finalizes the connector after the draft
    model). The store of r2's pages must still stop before the blocks whose load
    failed, which hold what they held before: none of it is cached under the prompt's
    tokens for a later hit to load."""
    e = Engine(small_daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        r2, r2_blocks, ext = hit_evicted_before_its_alloc(e, p)
        meta = e.scheduler.build_connector_meta(new_req_output("r2", r2_blocks, ext, len(p) - ext))
        out = e.execute(meta, forward=lambda: e.fill(r2_blocks[4:], STALE), speculative=True)
        e.deliver(out)
        assert set(r2_blocks[:4]) <= out.invalid_block_ids
        e.finish(r2, r2_blocks)  # aborted before its recompute step

        later_request_loads_no_stale_kv(e, p)
    finally:
        e.close()


def three_loads_in_one_step(e, admin):
    """Three requests stored (blocks 1-2, 3-4, 5-6: values 7, 8, 9); three more of the
    same prompts hit them, and the scheduler starts their loads into blocks 10-11,
    12-13, 14-15, each landed before the next starts (on a pool of two counter slots
    the third takes the first's). Returns the loads and their target blocks."""
    s = e.scheduler
    prompts = [list(range(1000 * i, 1000 * i + 2 * BS + 1)) for i in (1, 2, 3)]
    for i, p in enumerate(prompts):
        r = request(f"a{i}", p)
        e.prefill(r, [1 + 2 * i, 2 + 2 * i, 20], 7.0 + i)
        e.finish(r, [1 + 2 * i, 2 + 2 * i, 20])
    targets = [[10, 11], [12, 13], [14, 15]]
    for i, p in enumerate(prompts):
        r = request(f"b{i}", p)
        s.on_new_request(r)
        ext, _ = s.get_num_new_matched_tokens(r, 0)
        assert ext == 2 * BS
        s.update_state_after_alloc(r, blocks(targets[i] + [21]), ext)
        admin.flush()  # (its copies are over: its slot is free again)
    loads = list(s._loads)
    assert all(load.of_rank(0)[1] is not None for load in loads)
    return loads, targets


def fake_layer_waits(w, tickets_of, answer):
    """The worker's waits on the tickets of ``tickets_of`` loads go to ``answer(load
    index, layer, timeout_s)``, the others to the real counters; a wait that times out
    lets the whole time it was given pass on the worker's clock. Returns the clock (ns)
    and the calls made."""
    from hicache.errors import WaitTimeout

    now = [w._clock()]
    w._clock = lambda: now[0]
    which = {tuple(t): i for i, load in enumerate(tickets_of) for t in load.of_rank(0)[0]}
    calls: list[tuple[int, int, float]] = []
    waiter = w._client.waiter
    real_wait = waiter.wait_layer

    def wait_layer(ticket, layer, *, timeout_s=None, stream=None):
        i = which.get(tuple(ticket))
        if i is None:
            return real_wait(ticket, layer, timeout_s=timeout_s, stream=stream)
        calls.append((i, layer, timeout_s))
        try:
            answer(i, layer, timeout_s)
        except WaitTimeout:
            now[0] += int(timeout_s * 1e9)
            raise

    waiter.wait_layer = wait_layer
    return now, calls


def test_a_step_waits_once_for_each_layer_of_its_loads(daemon):
    """The attention of each layer waits for that layer of the step's loads; the end of
    the step (``wait_for_save``) waits only for layers no attention call waited for —
    none here. (Before, it waited for every layer of every load again: on a GPU a
    stream wait per ticket and layer for copies long landed, and a ticket whose slot
    went to a later load meanwhile read as stale — a landed load reported failed.)"""
    from collections import Counter

    e = Engine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        loads, targets = three_loads_in_one_step(e, admin)
        now, calls = fake_layer_waits(e.worker, loads, lambda i, layer, timeout_s: None)
        errors = e.step(empty_output())
        assert not errors
        waits = Counter((i, layer) for i, layer, _ in calls)
        assert waits == {(i, layer): len(load.of_rank(0)[0]) for i, load in enumerate(loads)
                         for layer in range(len(LAYER_NAMES))}
        assert [e.values(t) for t in targets] == [[{7.0}] * 2, [{8.0}] * 2, [{9.0}] * 2]
    finally:
        admin.close()
        e.close()


def test_a_load_whose_counter_slot_went_to_a_later_load_of_the_step_is_not_reported(tmp_path):
    """A step answers more loads than the pool has counter slots (two here): by the time
    the worker waits, the first load's slot holds the third's. The first landed, and is
    not reported (before, its ticket read as stale: vLLM recomputed its blocks, and the
    loads counted as failures)."""
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False},
                      tiers={"counter_slots": 2}).start()
    e = Engine(d.endpoint)
    admin = CacheClient(d.endpoint, heartbeat=False)
    try:
        loads, targets = three_loads_in_one_step(e, admin)
        assert [load.num_loaded for load in loads] == [2, 2, 2]
        assert loads[0].of_rank(0)[0][0][0] == loads[2].of_rank(0)[0][0][0]  # (the same slot)
        assert not e.step(empty_output())
        assert [e.values(t) for t in targets] == [[{7.0}] * 2, [{8.0}] * 2, [{9.0}] * 2]
    finally:
        admin.close()
        e.close()
        d.stop()


def test_a_step_whose_attention_skipped_a_layer_waits_for_it_at_its_end(daemon):
    """A layer no attention call waited for (a forward that skips the hook) is waited
    for by ``wait_for_save``, once, before the step's stores and its output."""
    from collections import Counter

    e = Engine(daemon.endpoint)
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        loads, _ = three_loads_in_one_step(e, admin)
        now, calls = fake_layer_waits(e.worker, loads, lambda i, layer, timeout_s: None)
        w = e.worker
        w.bind_connector_metadata(e.scheduler.build_connector_meta(empty_output()))
        w.start_load_kv(None)
        w.wait_for_layer_load(LAYER_NAMES[0])
        assert {layer for _, layer, _ in calls} == {0}
        w.wait_for_save()
        waits = Counter((i, layer) for i, layer, _ in calls)
        assert waits == {(i, layer): len(load.of_rank(0)[0]) for i, load in enumerate(loads)
                         for layer in range(len(LAYER_NAMES))}
        assert not w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
    finally:
        admin.close()
        e.close()


def test_loads_stalled_together_cost_the_step_one_load_timeout(daemon):
    """A daemon that stops with several loads in flight: their layer counters never
    move. The step's waits end at the loads' own deadline, which they share (before,
    each had its own ``hicache.load_timeout_s`` after another: 60 stalled loads outlast
    vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` of 300 s, and vLLM kills the engine),
    then one ``hicache.timeout_s`` between them for the loads to be over. Each load is
    still judged on its own: one whose layers landed loads, after the deadline too. The
    stall is simulated on the worker's clock: each wait on a stalled load lets the time
    it was given pass."""
    from hicache.errors import WaitTimeout

    e = Engine(daemon.endpoint, **{"hicache.load_timeout_s": 2.0})
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        loads, targets = three_loads_in_one_step(e, admin)

        def stalled(i, layer, timeout_s):
            raise WaitTimeout(f"layer {layer} not complete after {timeout_s} s")

        now, calls = fake_layer_waits(e.worker, loads[:2], stalled)
        errors = e.step(empty_output())
        deadline = max(load.of_rank(0)[1] for load in loads[:2])
        assert now[0] <= deadline + 1.0 * 1e9, f"the step waited past the loads' deadline (calls {calls})"
        assert errors == {10, 11, 12, 13}  # the stalled loads' blocks: vLLM recomputes them
        assert e.values(targets[2]) == [{9.0}] * 2  # the landed load is kept
    finally:
        admin.close()
        e.close()


def test_a_load_not_landed_by_its_deadline_is_reported_once_it_is_over(daemon, caplog):
    """A load whose layer has not landed when the daemon stops starting its copies
    (``copies_end_ns``) may still have a copy running: vLLM may give the blocks to
    another request as soon as they are reported, so the worker first waits — one
    ``hicache.timeout_s`` for all such loads — for each to be over. One that lands
    meanwhile is kept; one whose rest failed is reported; one still copying after that
    (a daemon stalled mid-copy) is reported all the same — the step cannot wait for
    good — and said in an error. Simulated on the worker's clock and counters."""
    from hicache.errors import LoadFailed, WaitTimeout

    e = Engine(daemon.endpoint, **{"hicache.load_timeout_s": 2.0})
    admin = CacheClient(daemon.endpoint, heartbeat=False)
    try:
        loads, targets = three_loads_in_one_step(e, admin)
        last = e.worker._num_layers - 1
        overs: list[int] = []
        state = ["late"] * 3

        def late(i, layer, timeout_s):
            if state[i] == "late":  # its layer 0, until its deadline
                state[i] = "given up"
                raise WaitTimeout(f"layer {layer} not complete after {timeout_s} s")
            if state[i] == "given up":  # waited for to be over
                assert layer == last
                overs.append(i)
                state[i] = ("landed", "failed", "stalled")[i]
            if state[i] == "failed":
                raise LoadFailed(f"layer {layer} failed")
            if state[i] == "stalled":
                raise WaitTimeout(f"layer {layer} not complete after {timeout_s} s")

        now, calls = fake_layer_waits(e.worker, loads, late)
        with caplog.at_level("ERROR", logger="hicache.integrations.vllm"):
            errors = e.step(empty_output())
        assert overs == [0, 1, 2]  # each waited for once its deadline passed
        assert errors == set(targets[1]) | set(targets[2])
        assert e.values(targets[0]) == [{7.0}] * 2  # landed during the wait: kept
        logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(logged) == 1 and "b2" in logged[0] and "written late" in logged[0]
        assert now[0] <= max(load.of_rank(0)[1] for load in loads) + 1.0 * 1e9
    finally:
        admin.close()
        e.close()


def test_blocks_whose_load_failed_are_not_taken_from_vllms_prefix_cache_as_computed(small_daemon):
    """With ``kv_load_failure_policy = "recompute"`` vLLM keeps the blocks of a failed
    load in its prefix cache (``Scheduler._handle_invalid_blocks`` evicts them only
    under "fail"): the request that owns them would recompute them, but it is aborted
    first. The next prompt with those tokens hits them in vLLM's prefix cache, stale
    KV counted as computed; the connector reports them as failed loads, so that vLLM
    recomputes them, and never stores them in hicache under the prompt's tokens (the
    hicache copy was evicted: a store would cache the stale KV for every engine)."""
    e = Engine(small_daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        r2, r2_blocks = hit_evicted_before_its_load(e, p)
        e.finish(r2, r2_blocks)  # aborted before its recompute step

        # vLLM's prefix cache: r3's first four blocks are r2's (cached by their hashes).
        r3 = request("r3", p)
        r3_blocks = r2_blocks[:4] + [28]
        ext, errors = e.prefill(r3, r3_blocks, 9.0, local_hit=4 * BS)
        assert ext == 0
        assert errors == set(r2_blocks[:4]), "stale blocks from vLLM's prefix cache were taken as computed"
        e.step(cached_output("r3", 0, len(p)), forward=lambda: e.fill(r3_blocks, 9.0))  # vLLM's recompute
        e.finish(r3, r3_blocks)

        ext, loaded = later_request_loads_no_stale_kv(e, p)
        assert ext == 4 * BS and loaded == [{9.0}] * 4  # the recomputed blocks were stored
    finally:
        e.close()


def test_under_async_scheduling_blocks_whose_load_fails_are_not_taken_as_computed_the_next_step(small_daemon):
    """vLLM's asynchronous scheduling (``async_scheduling``, its default on GPUs) builds
    step N+1 before step N's output reaches the scheduler. vLLM put r2's blocks in its
    prefix cache when it allocated them (``allocate_slots`` caches a sync load's blocks
    at once), so r3 of the same prompt, scheduled in step N+1, counts them as
    computed while their load is failing in step N. Step N+1 must report them (vLLM
    recomputes r3 rather than read stale KV) and store none of them in hicache under
    the prompt's tokens, for every later hit to load."""
    e = Engine(small_daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        r2, r2_blocks, ext = hit_evicted_before_its_alloc(e, p)
        s = e.scheduler
        step_n = s.build_connector_meta(new_req_output("r2", r2_blocks, ext, len(p) - ext))

        r3 = request("r3", p)
        s.on_new_request(r3)
        assert s.get_num_new_matched_tokens(r3, 4 * BS) == (0, False)  # vLLM's own hit: r2's four blocks
        r3_blocks = r2_blocks[:4] + [28]
        s.update_state_after_alloc(r3, blocks(r3_blocks), 0)
        step_n1 = s.build_connector_meta(new_req_output("r3", r3_blocks, 4 * BS, len(p) - 4 * BS))

        out_n = e.execute(step_n, forward=lambda: e.fill(r2_blocks[4:], STALE))
        assert set(r2_blocks[:4]) <= out_n.invalid_block_ids
        out_n1 = e.execute(step_n1, forward=lambda: e.fill(r3_blocks[4:], 9.0))
        e.deliver(out_n)
        e.deliver(out_n1)
        assert set(r2_blocks[:4]) <= out_n1.invalid_block_ids, \
            "step N+1 took blocks whose load failed in step N as r3's KV"
        e.finish(r2, r2_blocks)
        e.step(cached_output("r3", 0, len(p)), forward=lambda: e.fill(r3_blocks, 9.0))  # vLLM's recompute
        e.finish(r3, r3_blocks)

        ext, loaded = later_request_loads_no_stale_kv(e, p)
        assert ext == 4 * BS and loaded == [{9.0}] * 4  # the recomputed blocks were stored
    finally:
        e.close()


def test_under_async_scheduling_a_chunked_prefill_stores_no_block_whose_load_failed_the_step_before(small_daemon):
    """r2's prompt goes beyond its hicache hit; vLLM schedules it in two chunks, and
    under asynchronous scheduling builds the second one's step before the first one's
    output (with the failed load) reaches the scheduler. The second step's store of
    r2's whole pages must stop before the blocks whose load failed, and report them:
    nothing r2 computed on top of their stale KV is cached."""
    e = Engine(small_daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        p2 = p[: 4 * BS] + list(range(8000, 8000 + 3 * BS + 1))
        r2, r2_blocks, ext = hit_evicted_before_its_alloc(e, p2, [11, 12, 13, 14, 15, 16, 17, 18])
        s = e.scheduler
        step_n = s.build_connector_meta(new_req_output("r2", r2_blocks, ext, BS))  # page 4
        step_n1 = s.build_connector_meta(cached_output("r2", ext + BS, 2 * BS + 1))  # pages 5-6 and the last token

        out_n = e.execute(step_n, forward=lambda: e.fill(r2_blocks[4:5], STALE))
        out_n1 = e.execute(step_n1, forward=lambda: e.fill(r2_blocks[5:], STALE))
        e.deliver(out_n)
        e.deliver(out_n1)
        e.finish(r2, r2_blocks)

        later_request_loads_no_stale_kv(e, p2, [1, 2, 3, 4, 5, 6, 7, 8])
        assert set(r2_blocks[:4]) <= out_n1.invalid_block_ids
    finally:
        e.close()


def test_under_async_scheduling_blocks_whose_load_lands_are_computed_for_the_next_step(daemon):
    """The same order with a load that lands: r3 of step N+1 counts r2's blocks as
    computed, the worker (which ran step N first) reports none of them, so vLLM
    recomputes nothing. Once step N's output is in, a request that takes them from
    vLLM's prefix cache has nothing to check: a step built after its previous step's
    output (synchronous scheduling) asks the worker about no block."""
    e = Engine(daemon.endpoint)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        r2, ext = second_request_matches(e, p)
        r2_blocks = [11, 12, 13, 14, 15]
        s = e.scheduler
        s.update_state_after_alloc(r2, blocks(r2_blocks), ext)
        step_n = s.build_connector_meta(new_req_output("r2", r2_blocks, ext, len(p) - ext))
        r3 = request("r3", p)
        s.on_new_request(r3)
        r3_blocks = r2_blocks[:4] + [28]
        s.update_state_after_alloc(r3, blocks(r3_blocks), 0)
        step_n1 = s.build_connector_meta(new_req_output("r3", r3_blocks, 4 * BS, len(p) - 4 * BS))
        assert step_n1.check == set(r2_blocks[:4])  # (step N's output is not back)

        out_n = e.execute(step_n, forward=lambda: e.fill(r2_blocks[4:], 9.0))
        out_n1 = e.execute(step_n1, forward=lambda: e.fill(r3_blocks[4:], 9.0))
        assert not out_n.invalid_block_ids and not out_n1.invalid_block_ids
        assert e.values(r2_blocks[:4]) == [{7.0}] * 4
        e.deliver(out_n)
        e.deliver(out_n1)

        r5 = request("r5", p)
        s.on_new_request(r5)
        r5_blocks = r2_blocks[:4] + [29]
        s.update_state_after_alloc(r5, blocks(r5_blocks), 0)
        meta = s.build_connector_meta(new_req_output("r5", r5_blocks, 4 * BS, len(p) - 4 * BS))
        assert meta.check == set()
        assert not e.execute(meta, forward=lambda: e.fill(r5_blocks[4:], 9.0)).invalid_block_ids
    finally:
        e.close()


def mm_feature(identifier: str, offset: int, length: int) -> SimpleNamespace:
    """vLLM 0.32's MultiModalFeatureSpec: the fields its prefix cache hashes."""
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def test_two_images_behind_the_same_placeholder_tokens_do_not_share_kv(daemon):
    """An image's positions hold the same placeholder ids for every image; vLLM's own
    prefix cache keys those blocks by the image's hash (``mm_features[i].identifier``).
    The same image at the same place is a hit; another image, or the same one
    elsewhere, is not."""
    e = Engine(daemon.endpoint)
    try:
        p = [1, 2, 3, 4] + [9999] * (3 * BS) + list(range(10, 10 + BS))  # image placeholders at 4..52
        a = request("a", p, mm_features=[mm_feature("sha-of-image-A", 4, 3 * BS)])
        e.prefill(a, [1, 2, 3, 4, 5], 7.0)
        e.finish(a, [1, 2, 3, 4, 5])
        s = e.scheduler
        same = request("a2", p, mm_features=[mm_feature("sha-of-image-A", 4, 3 * BS)])
        assert s.get_num_new_matched_tokens(same, 0)[0] == 4 * BS
        other = request("b", p, mm_features=[mm_feature("sha-of-image-B", 4, 3 * BS)])
        assert s.get_num_new_matched_tokens(other, 0)[0] == 0
        moved = request("c", p, mm_features=[mm_feature("sha-of-image-A", 5, 3 * BS - 1)])
        assert s.get_num_new_matched_tokens(moved, 0)[0] == 0
    finally:
        e.close()


def test_prompt_embeds_behind_placeholder_tokens_do_not_share_kv(daemon):
    """Mixed prompts (token ids and prompt embeds, ``prompt_is_token_ids``): the
    positions an embedding fills hold a sentinel id; vLLM's prefix cache adds a hash of
    the embeds. Other embeds behind the same ids are a miss; the same ones a hit."""
    import torch

    e = Engine(daemon.endpoint)
    try:
        n = 3 * BS + 1
        sentinel = 128001
        p = list(range(10, 14)) + [sentinel] * (2 * BS) + list(range(20, 20 + n - 4 - 2 * BS))
        mask = [t != sentinel for t in p]
        a = request("a", p, prompt_embeds=torch.ones(n, 8), prompt_is_token_ids=mask)
        e.prefill(a, [1, 2, 3, 4], 7.0)
        e.finish(a, [1, 2, 3, 4])
        s = e.scheduler
        same = request("a2", p, prompt_embeds=torch.ones(n, 8), prompt_is_token_ids=mask)
        assert s.get_num_new_matched_tokens(same, 0)[0] == 3 * BS
        other = request("b", p, prompt_embeds=torch.full((n, 8), 2.0), prompt_is_token_ids=mask)
        assert s.get_num_new_matched_tokens(other, 0)[0] == 0
    finally:
        e.close()


def test_a_lora_name_pointed_at_another_adapter_does_not_reuse_the_old_adapters_kv(daemon):
    """vLLM keys LoRA blocks by name and path, so that a name pointed at another
    adapter does not reuse KV computed with the previous one; hicache's cache outlives
    the engine, so an engine restarted with ``sql`` -> v2 must not hit what v1 computed."""
    e = Engine(daemon.endpoint)
    try:
        p = list(range(100, 100 + 3 * BS + 1))

        def lora(path):
            return SimpleNamespace(lora_name="sql", lora_path=path, lora_int_id=1)

        v1 = request("a", p, lora_request=lora("/adapters/sql-v1"))
        e.prefill(v1, [1, 2, 3, 4], 7.0)
        e.finish(v1, [1, 2, 3, 4])
        s = e.scheduler
        assert s.get_num_new_matched_tokens(request("a2", p, lora_request=lora("/adapters/sql-v1")), 0)[0] == 3 * BS
        assert s.get_num_new_matched_tokens(request("b", p, lora_request=lora("/adapters/sql-v2")), 0)[0] == 0
        assert s.get_num_new_matched_tokens(request("c", p), 0)[0] == 0  # nor the base model
    finally:
        e.close()


def test_what_changes_the_models_kv_is_in_the_spec_model_identity():
    """One checkpoint served quantized (fp8) or with other rope settings computes other
    K/V for the same tokens in the same cache geometry: another spec fingerprint. The
    same configuration gives the same identity (engines of it share the cache)."""

    def identity(quantization=None, rope_theta=10000.0, hf_overrides=None):
        config = vllm_config("ipc:///nowhere")
        config.model_config.quantization = quantization
        config.model_config.hf_overrides = hf_overrides
        hf = {"model_type": "llama", "rope_theta": rope_theta, "transformers_version": "4.99",
              "_name_or_path": "/models/tiny"}
        config.model_config.hf_config = SimpleNamespace(to_dict=lambda: dict(hf))
        return model_identity(config)

    base = identity()
    assert base == identity() and base.startswith("test/tiny@")
    assert len({base, identity(quantization="fp8"), identity(rope_theta=500000.0),
                identity(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})}) == 4

    specs = []
    for quantization in (None, "fp8"):  # through the worker's spec
        config = vllm_config("ipc:///nowhere")
        config.model_config.quantization = quantization
        worker = HicacheConnector(config, KVConnectorRole.WORKER, kv_cache_config())
        spec, _ = worker._describe(kv_caches())
        specs.append(spec.fingerprint_hex)
    assert specs[0] != specs[1], "an fp8-quantized and an unquantized engine share one namespace"


class Sessions:
    """Every session a ``CacheClient`` opens (hello + register / attach), with the
    thread it ran on, and every call to the daemon made on the test's thread."""

    def __init__(self, monkeypatch) -> None:
        self.opened: list[str] = []
        self.calls_here: list[str] = []
        open_session, send = CacheClient._open_session, CacheClient._send_locked

        def recorded_open(client, *args, **kwargs):
            self.opened.append(threading.current_thread().name)
            return open_session(client, *args, **kwargs)

        def recorded_send(client, message):
            if threading.current_thread() is threading.main_thread():
                self.calls_here.append(type(message).__name__)
            return send(client, message)

        monkeypatch.setattr(CacheClient, "_open_session", recorded_open)
        monkeypatch.setattr(CacheClient, "_send_locked", recorded_send)

    def reset(self) -> None:
        self.opened.clear()
        self.calls_here.clear()


def test_the_scheduler_never_waits_for_a_daemon_that_is_down_and_attaches_once_it_is_up(tmp_path, monkeypatch):
    """While the daemon is away, every match is a miss at once: the attempts to attach
    (a hello that waits ``hicache.timeout_s`` for a daemon that is not there) run on
    the connector's own thread, never on vLLM's scheduler loop. Once the daemon is
    there, the pool registered, the scheduler attaches and hits."""
    sessions = Sessions(monkeypatch)
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False})
    e = Engine(d.endpoint)  # (one attempt each at the engine's start: the daemon is usually there)
    try:
        sessions.reset()
        p = list(range(100, 100 + 3 * BS + 1))
        for i in range(5):
            assert e.scheduler.get_num_new_matched_tokens(request(f"r{i}", p), 0) == (0, False)
        assert sessions.calls_here == [], "the scheduler's matches waited for the daemon"

        d.start()
        wait_until(lambda: e.worker._client is not None and e.scheduler._client is not None,
                   "the worker registered and the scheduler attached")
        assert "MainThread" not in sessions.opened
        ext, errors = e.prefill(request("a", p), [1, 2, 3, 4], 7.0)
        assert ext == 0 and not errors
        assert e.scheduler.get_num_new_matched_tokens(request("b", p), 0)[0] == 3 * BS
    finally:
        e.close()
        if d.proc is not None:
            d.stop()


def run_worker_step(e: Engine, i: int) -> None:
    """One request through the scheduler's bookkeeping, then the worker's step (with
    a store of its two whole pages)."""
    p = list(range(1000 * i, 1000 * i + 2 * BS + 1))
    r = request(f"r{i}", p)
    e.scheduler.on_new_request(r)
    meta = e.scheduler.build_connector_meta(new_req_output(r.request_id, [1, 2, 3], 0, len(p)))
    e.scheduler.request_finished(r, [1, 2, 3])
    w = e.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()


def test_worker_steps_never_wait_for_a_daemon_that_is_down(tmp_path, monkeypatch):
    """The registration failed at the engine's start (no daemon): the steps' stores are
    skipped while the connector's thread retries (before, each store reconnected with
    a hello that waited ``hicache.timeout_s``, and the reviver held the step's lock
    through its own). Once the daemon is there, the pool is registered and stored to."""
    sessions = Sessions(monkeypatch)
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False})
    e = Engine(d.endpoint)
    try:
        sessions.reset()
        for i in range(5):
            run_worker_step(e, i + 1)
        assert sessions.calls_here == [], "the worker's steps waited for the daemon"
        assert "MainThread" not in sessions.opened

        d.start()
        wait_until(lambda: e.worker._client is not None and e.scheduler._client is not None,
                   "the worker registered and the scheduler attached")
        run_worker_step(e, 9)
        assert sessions.calls_here == ["Store"]
        p = list(range(9000, 9000 + 2 * BS + 1))
        assert e.scheduler.get_num_new_matched_tokens(request("again", p), 0)[0] == 2 * BS
    finally:
        e.close()
        if d.proc is not None:
            d.stop()


def test_a_store_that_timed_out_does_not_copy_blocks_vllm_has_reused(tmp_path):
    """The worker's store waits ``hicache.timeout_s`` and gives up; the step ends and
    vLLM may reuse the blocks. A daemon that was only slow (stopped here) executes the
    store later, when the blocks hold another request's KV: it must cache none of it
    (the store carries its deadline)."""
    d = DaemonProcess(tmp_path, server={"lease_s": 30.0}, host={"bytes": 64 << 20},
                      disk={"enabled": False}).start()
    e = Engine(d.endpoint)
    admin = CacheClient(d.endpoint, heartbeat=False)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        r1 = request("r1", p)
        e.scheduler.on_new_request(r1)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            e.step(new_req_output("r1", [1, 2, 3, 4, 5], 0, len(p)),
                   forward=lambda: e.fill([1, 2, 3, 4, 5], 7.0))  # the store times out
            e.scheduler.request_finished(r1, [1, 2, 3, 4, 5])
            e.fill([1, 2, 3, 4, 5], STALE)  # the blocks' next owner writes its own KV
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)

        def stores_answered() -> int:
            return sum(n for key, n in admin.stats()["requests"].items() if key.startswith("store/"))

        wait_until(lambda: stores_answered() >= 1, "the daemon answered the store")
        r3 = request("r3", p)
        r3_blocks = [16, 17, 18, 19, 27]
        e.fill(r3_blocks, 0.0)
        ext, _ = e.prefill(r3, r3_blocks, 7.0)
        loaded = e.values(r3_blocks[: ext // BS])
        assert STALE not in set().union(*loaded), f"a timed-out store copied reused blocks: r3 loaded {loaded}"
        assert ext == 0
    finally:
        admin.close()
        e.close()
        if d.proc is not None:
            d.stop()


def test_a_load_the_scheduler_gave_up_on_does_not_write_blocks_vllm_has_reused(tmp_path):
    """The scheduler's ``load_into`` waits ``hicache.load_timeout_s`` and gives up: the
    worker reports the blocks, vLLM recomputes them or the request ends, and the blocks
    go to another request. A daemon that was only slow (stopped here) executes the
    load later: it must not write into blocks that hold another request's KV by then
    (the load carries its deadline)."""
    d = DaemonProcess(tmp_path, server={"lease_s": 30.0}, host={"bytes": 64 << 20},
                      disk={"enabled": False}).start()
    e = Engine(d.endpoint, **{"hicache.load_timeout_s": 0.5})
    admin = CacheClient(d.endpoint, heartbeat=False)
    try:
        p = list(range(100, 100 + 4 * BS + 3))
        first_request_stores(e, p)
        r2, ext = second_request_matches(e, p)
        r2_blocks = [11, 12, 13, 14, 15]
        s = e.scheduler
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            s.update_state_after_alloc(r2, blocks(r2_blocks), ext)  # the load times out
            errors = e.step(new_req_output("r2", r2_blocks, ext, len(p) - ext),
                            forward=lambda: e.fill(r2_blocks[4:], 9.0))
            assert set(r2_blocks[:4]) <= errors  # vLLM recomputes them...
            e.finish(r2, r2_blocks)  # ... or the request is aborted meanwhile
            e.fill(r2_blocks, STALE)  # the blocks' next owner writes its own KV
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)

        def loads_answered() -> int:
            return sum(n for key, n in admin.stats()["requests"].items() if key.startswith("load_into/"))

        wait_until(lambda: loads_answered() >= 1, "the daemon answered the load")
        admin.flush()  # (nothing in flight any more: a copy it started has landed)
        assert e.values(r2_blocks) == [{STALE}] * 5, "a load the scheduler gave up on wrote reused blocks"
    finally:
        admin.close()
        e.close()
        if d.proc is not None:
            d.stop()


def test_shutdown_never_closes_a_client_a_connecting_thread_is_using(tmp_path, monkeypatch):
    """``shutdown()`` while the daemon is down: the connector's thread is inside an
    attempt (a hello waiting for the daemon). Closing that client under it aborted the
    process in ZeroMQ (``signaler.cpp``) or hung in ``context.term()``; shutdown stops
    the thread and the client is closed only once no attempt uses it."""
    inside = threading.Event()
    release = threading.Event()
    attempts: list[str] = []
    closed_during_attempt: list[bool] = []
    close = CacheClient.close

    def open_session(client, in_use):
        if threading.current_thread() is threading.main_thread():
            raise Unavailable("no daemon")  # the attempts at the engine's start
        attempts.append(client.name)
        inside.set()
        release.wait(30)
        attempts.remove(client.name)
        raise Unavailable("no daemon")

    def recorded_close(client):
        closed_during_attempt.append(client.name in attempts)
        release.set()  # (a close under the attempt: let it end)
        close(client)

    monkeypatch.setattr(CacheClient, "_open_session", open_session)
    monkeypatch.setattr(CacheClient, "close", recorded_close)
    e = Engine(f"ipc://{tmp_path / 'nobody.sock'}", **{"hicache.timeout_s": 0.2, "hicache.load_timeout_s": 0.2})
    assert inside.wait(30)
    e.worker.shutdown()  # (its thread stays inside the attempt)
    release.set()
    e.scheduler.shutdown()
    for thread in threading.enumerate():
        if thread.name == "hicache-connect":
            thread.join(30)
            assert not thread.is_alive()
    assert closed_during_attempt and not any(closed_during_attempt), closed_during_attempt


def test_shutdown_while_the_daemon_is_down_neither_aborts_nor_hangs(tmp_path):
    """The same in a process of its own, shut down at several points of the
    connecting threads' attempts: a clean exit every time."""
    script = HERE / "connector_shutdown_run.py"
    outcomes = []
    for delay in (0.0, 0.5, 1.0, 1.7):
        try:
            proc = subprocess.run([sys.executable, str(script), str(delay), str(tmp_path / "nobody.sock")],
                                  capture_output=True, text=True, timeout=60)
            outcomes.append((delay, proc.returncode, "Assertion failed" in proc.stderr))
        except subprocess.TimeoutExpired:
            outcomes.append((delay, "hung", False))
    bad = [o for o in outcomes if o[1] != 0]
    assert not bad, f"shutdowns that aborted or hung (delay, exit, zmq assertion): {bad}"


def test_a_hybrid_model_runs_without_hicache_rather_than_share_a_wrong_layout(daemon):
    """Several KV cache groups (sliding-window or recurrent layers beside full attention)
    are not one foreign layout: the worker warns and runs without hicache — its cache
    stays where vLLM put it, and nothing registers."""
    config = kv_cache_config()
    config.kv_cache_groups = [object(), object()]
    caches = kv_caches()
    storage = caches[LAYER_NAMES[0]].untyped_storage().data_ptr()
    worker = HicacheConnector(vllm_config(daemon.endpoint), KVConnectorRole.WORKER, config)
    try:
        worker.register_kv_caches(caches)
        assert not worker._enabled and worker._client is None
        assert all(v.untyped_storage().data_ptr() == storage for v in caches.values())
        admin = CacheClient(daemon.endpoint, heartbeat=False)
        try:
            assert admin.stats()["sessions"] == 0  # no pool was registered
        finally:
            admin.close()
    finally:
        worker.shutdown()


def test_the_scheduler_of_a_hybrid_model_never_tries_to_attach(tmp_path):
    """The worker of a hybrid model runs without hicache and registers no pool; its
    scheduler, which has the same KV cache config, knows so at once: it makes no
    attempt to attach and starts no thread to retry (before, it asked a hello and an
    attach — refused, no such pool — at the engine's start and then every second for
    the engine's whole life). Its matches miss, at once."""
    from fake_daemon import FakeDaemon

    fake = FakeDaemon(tmp_path)
    config = kv_cache_config()
    config.kv_cache_groups = [object(), object()]
    scheduler = None
    try:
        fake.script("attach", ErrorCode.INVALID_ARGUMENT)  # (what a daemon says: no such pool)
        scheduler = HicacheConnector(vllm_config(fake.endpoint), KVConnectorRole.SCHEDULER, config)
        assert fake.ops() == []
        assert scheduler._connecting is None and scheduler._client is None
        p = list(range(100, 100 + 3 * BS + 1))
        scheduler.on_new_request(request("r", p))
        assert scheduler.get_num_new_matched_tokens(request("r", p), 0) == (0, False)
        assert fake.ops() == []
    finally:
        if scheduler is not None:
            scheduler.shutdown()
        fake.close()
    assert fake.errors == []


def test_a_scheduler_whose_worker_runs_without_hicache_stops_trying_to_attach(tmp_path, monkeypatch):
    """The worker cannot share its KV cache (here share_kv_caches refuses it; a layout
    hicache cannot describe does the same) and runs without hicache: no pool is ever
    registered. Its first step's output tells the scheduler, which stops its thread
    trying to attach every second for the engine's whole life, and misses at once."""
    from fake_daemon import FakeDaemon

    import hicache.integrations.vllm as connector

    def refuse(*args, **kwargs):
        raise connector.InvalidArgument("a layout this test cannot share")

    monkeypatch.setattr(connector, "share_kv_caches", refuse)
    fake = FakeDaemon(tmp_path)
    engine = None
    try:
        fake.script("attach", ErrorCode.INVALID_ARGUMENT)  # (what a daemon says: no such pool)
        engine = Engine(fake.endpoint)
        assert not engine.worker._enabled and engine.worker._client is None
        thread = engine.scheduler._connecting
        assert thread is not None and thread.is_alive()  # (refused at the start: trying again)
        out = engine.execute(engine.scheduler.build_connector_meta(empty_output()))
        assert isinstance(out.kv_connector_worker_meta, connector.HicacheWorkerMetadata)
        assert out.kv_connector_worker_meta.off
        engine.deliver(out)
        thread.join(30)
        assert not thread.is_alive() and engine.scheduler._client is None
        attempts = fake.ops().count("attach")
        # Said once: the next steps' outputs are empty again.
        assert engine.execute(engine.scheduler.build_connector_meta(empty_output())).is_empty()
        p = list(range(100, 100 + 3 * BS + 1))
        engine.scheduler.on_new_request(request("r", p))
        assert engine.scheduler.get_num_new_matched_tokens(request("r", p), 0) == (0, False)
        assert fake.ops().count("attach") == attempts
    finally:
        if engine is not None:
            engine.close()
        fake.close()
    assert fake.errors == []
