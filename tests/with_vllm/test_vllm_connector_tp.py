"""The vLLM connector under tensor parallelism, driven step by step
(``connector_harness``: a scheduler and one worker per TP rank in this process, a real
daemon over real sockets). Each rank's worker registers a pool of its own (its shard of
the heads is in the spec); the scheduler matches and loads on every rank, and a prefix
is hicache's only as far as every rank holds it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from connector_harness import (  # noqa: E402
    BS,
    Engine,
    first_request_stores,
    kv_cache_config,
    kv_caches,
    request,
    vllm_config,
    wait_until,
)
from hicache.client import CacheClient  # noqa: E402
from hicache.errors import Unavailable  # noqa: E402
from hicache.integrations.vllm import HicacheConnector, KVConnectorRole  # noqa: E402


def prompt(start: int = 100, pages: int = 4) -> list[int]:
    return list(range(start, start + pages * BS + 3))


def hits_each_ranks_own(e: Engine, req_id: str, p: list[int], block_ids: list[int], stored: float) -> None:
    """Request ``req_id`` of ``p`` hits its four whole pages, loaded into the first four of
    ``block_ids`` (the forward writes 9.0 + rank into the rest): rank r's hold
    ``stored + r``, what that rank computed and stored."""
    ext, errors = e.prefill(request(req_id, p), block_ids, 9.0)
    assert ext == 4 * BS and not errors
    for rank in (0, 1):
        assert e.values(block_ids[:4], rank=rank) == [{stored + rank}] * 4


def host_pages_by_spec(endpoint: str) -> dict[str, int]:
    client = CacheClient(endpoint, heartbeat=False)
    try:
        return {fp: spec["host"]["cached_evictable"] + spec["host"]["cached_protected"]
                for fp, spec in client.stats()["specs"].items()}
    finally:
        client.close()


def test_each_rank_stores_and_loads_its_own_shard(daemon):
    """Two ranks compute different bytes for the same tokens (7.0 on rank 0, 8.0 on rank
    1): each stores its own into a pool of its own, and a later request's blocks get
    each rank's own shard back — never the other rank's."""
    e = Engine(daemon.endpoint, tp=2)
    try:
        assert [w._client is not None for w in e.workers] == [True, True]
        p = prompt()
        first_request_stores(e, p)
        assert sorted(host_pages_by_spec(daemon.endpoint).values()) == [4, 4]  # two specs, 4 pages each
        hits_each_ranks_own(e, "r2", p, [6, 7, 8, 9, 10], 7.0)
        assert e.values([10], rank=0) == [{9.0}] and e.values([10], rank=1) == [{10.0}]
    finally:
        e.close()


def test_an_engine_of_another_tp_size_shares_nothing(daemon):
    """A rank's shard is in its spec: one TP=1 engine's pages (all the heads in a block)
    are no hit for a TP=2 engine (half of them), nor the other way round."""
    one = Engine(daemon.endpoint, "e1")
    two = Engine(daemon.endpoint, "e2", tp=2)
    try:
        first_request_stores(one, prompt(100))
        first_request_stores(two, prompt(3000))
        ext, _ = two.prefill(request("r2", prompt(100)), [6, 7, 8, 9, 10], 9.0)
        assert ext == 0
        ext, _ = one.prefill(request("r3", prompt(3000)), [11, 12, 13, 14, 15], 9.0)
        assert ext == 0
    finally:
        two.close()
        one.close()


def test_a_prefix_is_hit_only_as_far_as_every_rank_holds_it(daemon):
    """Rank 0 holds six pages of a prompt, rank 1 four: the scheduler reports four,
    and both ranks load those four."""
    e = Engine(daemon.endpoint, tp=2)
    try:
        p = prompt(pages=6)
        first_request_stores(e, p[: 4 * BS + 1])
        e.fill([11, 12, 13, 14, 15, 16], 5.0)  # rank 0 alone has the whole prompt
        e.workers[0]._client.store(p[: 6 * BS], [11, 12, 13, 14, 15, 16])
        assert sorted(host_pages_by_spec(daemon.endpoint).values()) == [4, 6]
        hits_each_ranks_own(e, "r2", p, [20, 21, 22, 23, 24, 25, 26], 7.0)
        assert e.values([24, 25, 26], rank=1) == [{10.0}] * 3  # computed, not loaded
    finally:
        e.close()


def load_on_rank_1(e: Engine, change):
    """Rank 1's loads made by ``change(real, handle, pages, first, locked)``, ``real`` the
    client's own making of a ``load_into`` request; returns what undoes it."""
    client = e.scheduler._client.clients[1]
    real = client._load_into_call
    client._load_into_call = lambda handle, pages, first, locked: change(real, handle, pages, first, locked)
    return lambda: setattr(client, "_load_into_call", real)


def test_a_load_that_falls_short_on_one_rank_is_recomputed_on_every_rank(daemon):
    """Rank 1's load brings two of the four pages matched (what was evicted since the
    match loads short), rank 0's all four: the last two blocks are reported — every
    rank recomputes them, since a block is one token range on all ranks — and rank 0's
    copies into them are over by then."""
    e = Engine(daemon.endpoint, tp=2)
    try:
        p = prompt()
        first_request_stores(e, p)
        undo = load_on_rank_1(e, lambda real, handle, pages, first, locked: real(handle, pages[:2], first, locked))
        e.fill([6, 7, 8, 9, 10], 0.0)
        ext, errors = e.prefill(request("r2", p), [6, 7, 8, 9, 10], 9.0)
        assert ext == 4 * BS
        assert errors == {8, 9}
        assert e.values([6, 7], rank=1) == [{8.0}] * 2
        assert e.values([6, 7, 8, 9], rank=0) == [{7.0}] * 4  # (landed before they were reported)
        # Nothing of the blocks reported was stored: the next request loads each rank's own.
        undo()
        hits_each_ranks_own(e, "r3", p, [11, 12, 13, 14, 15], 7.0)
    finally:
        e.close()


def test_a_load_that_fails_on_one_rank_leaves_the_others_waited_for_and_all_recomputed(daemon):
    """Rank 1's load fails outright: every block is reported, and rank 0, whose load
    was under way, waited for its copies first (vLLM would hand the blocks to their
    recompute, or to another request)."""
    e = Engine(daemon.endpoint, tp=2)
    try:
        p = prompt()
        first_request_stores(e, p)

        def refuse(real, handle, pages, first, locked):
            raise Unavailable("refused for the test")

        load_on_rank_1(e, refuse)
        waits = []
        w0 = e.workers[0]._client
        real_wait = w0.wait_layer
        w0.wait_layer = lambda tickets, layer, **kw: (waits.append(layer), real_wait(tickets, layer, **kw))[1]
        e.fill([6, 7, 8, 9, 10], 0.0)
        ext, errors = e.prefill(request("r2", p), [6, 7, 8, 9, 10], 9.0)
        assert ext == 4 * BS
        assert errors == {6, 7, 8, 9}
        assert sorted(set(waits)) == [0, 1]  # rank 0 waited for each layer of its load
        assert e.values([6, 7, 8, 9], rank=0) == [{7.0}] * 4
        assert e.values([6, 7, 8, 9], rank=1) == [{1.0}] * 4  # (as filled: nothing copied for rank 1)
    finally:
        e.close()


def test_the_scheduler_attaches_to_a_rank_whose_worker_registers_late(daemon, monkeypatch):
    """Rank 0's pool is there when the scheduler starts, rank 1's not yet: the
    scheduler misses until both are (a match on rank 0 alone would load half the
    heads), then attaches to rank 1's without attaching to rank 0's again."""
    attaches = []
    real_attach = CacheClient.attach

    def attach(client, name):
        attaches.append(name)
        return real_attach(client, name)

    monkeypatch.setattr(CacheClient, "attach", attach)
    workers = [HicacheConnector(vllm_config(daemon.endpoint, tp=2, rank=rank), KVConnectorRole.WORKER,
                                kv_cache_config()) for rank in range(2)]
    caches = [kv_caches(), kv_caches()]
    workers[0].register_kv_caches(caches[0])
    scheduler = HicacheConnector(vllm_config(daemon.endpoint, tp=2), KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        assert scheduler._client is None
        r = request("r1", prompt())
        scheduler.on_new_request(r)
        assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        workers[1].register_kv_caches(caches[1])
        wait_until(lambda: scheduler._client is not None, "the scheduler attached to both ranks' pools")
        assert attaches.count("vllm-e1-tp0") == 1 and attaches[-1] == "vllm-e1-tp1"
        assert scheduler._client.names == ["vllm-e1-tp0", "vllm-e1-tp1"]
    finally:
        scheduler.shutdown()
        for w in workers:
            w.shutdown()


def test_after_a_daemon_restart_every_rank_is_back_and_hits_again(tmp_path):
    """The daemon restarts (its host tier gone): matches miss meanwhile; then each
    rank's worker registers its pool again and the scheduler's client of each rank
    attaches again, on their own; a prompt stored after that is hit on both ranks, each
    with its own shard."""
    from daemon_util import DaemonProcess

    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False}).start()
    e = Engine(d.endpoint, tp=2)
    try:
        first_request_stores(e, prompt())
        d.stop()
        assert e.scheduler.get_num_new_matched_tokens(request("r2", prompt()), 0) == (0, False)
        d.start()
        q, ids = prompt(3000), iter(range(1000))

        def stored_then_hit() -> bool:  # (the first attempt after both are back stores, the next hits)
            ext, errors = e.prefill(request(f"q{next(ids)}", q), [11, 12, 13, 14, 15], 5.0)
            return ext == 4 * BS and not errors

        wait_until(stored_then_hit, "both ranks registered again, the scheduler attached to both, a hit")
        e.fill([16, 17, 18, 19, 20], 0.0)
        hits_each_ranks_own(e, "last", q, [16, 17, 18, 19, 20], 5.0)
    finally:
        e.close()
        if d.proc is not None:
            d.stop()


def test_a_router_sees_one_stream_per_engine_rank_0s(tmp_path):
    """Each rank's pool caches that rank's shard, but one engine is one stream for a
    router: rank 0's pool publishes the KV events (its blocks, as every rank stores
    them), rank 1's pool none."""
    import zmq

    from daemon_util import DaemonProcess, events_socket, replayed
    from kv_event_shapes import BlockStored, decode

    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False}, events={"enabled": True}).start()
    e = Engine(d.endpoint, tp=2)
    replay, _ = events_socket(zmq.DEALER, f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
    try:
        first_request_stores(e, prompt())
        topics = [str(w._client.pool_id) for w in e.workers]

        def stored(topic: str) -> int:
            return sum(len(event.block_hashes) for payload in replayed(replay, topic)
                       for event in decode(payload).events if isinstance(event, BlockStored))

        wait_until(lambda: stored(topics[0]) == 4, "rank 0's four pages on its stream")
        assert replayed(replay, topics[1]) == []
    finally:
        replay.close(0)
        e.close()
        if d.proc is not None:
            d.stop()


def test_the_daemon_counts_a_tp_engine_s_tokens_once(tmp_path):
    """Both ranks match, load and miss the same tokens (each its own shard); the
    daemon's token figures are the engine's: the first request's four whole pages are
    missed once, the next one's 4-page hit is 4 pages of host hits — as a TP=1 engine's
    would be."""
    from daemon_util import DaemonProcess, scraped
    from hicache.storage.mooncake_local import free_port

    port = free_port()
    d = DaemonProcess(tmp_path, host={"bytes": 64 << 20}, disk={"enabled": False},
                      metrics={"enabled": True, "address": "127.0.0.1", "port": port}).start()
    e = Engine(d.endpoint, tp=2)

    def figures() -> tuple[float, float]:
        client = CacheClient(d.endpoint, heartbeat=False)
        try:
            client.flush()  # (every load's completion has run: its hits are counted)
        finally:
            client.close()
        return scraped(port, "hicache_matched_tokens_total", tier="host"), scraped(
            port, "hicache_missed_tokens_total")

    try:
        first_request_stores(e, prompt())
        assert figures() == (0, 4 * BS)  # (the scheduler matches whole pages only)
        hits_each_ranks_own(e, "r2", prompt(), [6, 7, 8, 9, 10], 7.0)
        assert figures() == (4 * BS, 4 * BS)
    finally:
        e.close()
        if d.proc is not None:
            d.stop()
