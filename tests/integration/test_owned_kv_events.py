"""KV events of engine-owned pools under tensor parallelism: one stream per engine.

A TP engine registers one pool per rank; a router must see one engine, not n. Ranks
but the first register with ``kv_events=False``: their pools publish no stream. A real
daemon process, real sockets; the streams read through the replay socket (every batch
still in a topic's ring, none for a topic no stream has)."""

from __future__ import annotations

import time

import zmq

from daemon_util import DaemonProcess, clean_daemon, events_socket, replayed
from hicache import protocol as p
from kv_event_shapes import BlockStored, decode
from owned_util import OWNED_SPEC, OwnedEngine, as_older_daemon, layer_major, registered_again, tp_rank_spec

PS = OWNED_SPEC.page_size
SEQ = list(range(500, 500 + 3 * PS))
BLOCKS = [1, 2, 3]


def stored_hashes(sock, topic: str) -> set[tuple[str, int]]:
    """(medium, block hash) of every ``BlockStored`` still in ``topic``'s ring."""
    return {(event.medium, h) for payload in replayed(sock, topic) for event in decode(payload).events
            if isinstance(event, BlockStored) for h in event.block_hashes}


def store(engine: OwnedEngine) -> None:
    engine.compute(SEQ, BLOCKS)
    assert engine.client.store(SEQ, BLOCKS).num_cached == 3


def published(sock, topic: str, what: str) -> set[tuple[str, int]]:
    """``topic``'s stored blocks, once there are three (the batch of a store goes out
    at the daemon's next loop turn)."""
    deadline = time.monotonic() + 30
    while len(blocks := stored_hashes(sock, topic)) < 3:
        assert time.monotonic() < deadline, f"{what}: {blocks}"
        time.sleep(0.05)
    return blocks


def test_only_the_first_ranks_pool_publishes_a_stream(tmp_path):
    """Rank 1 stores first, then rank 0: once rank 0's blocks are on its stream, rank 1's
    would be on one too (the batches go out in the order of the loop's turns) — it has
    none. Both ranks' pages are cached alike."""
    with clean_daemon(tmp_path, events={"enabled": True}, disk={"enabled": False}) as daemon:
        ranks = [OwnedEngine(daemon.endpoint, layer_major(8, tp_rank_spec(r, 2)), name=f"r{r}", kv_events=r == 0)
                 for r in range(2)]
        replay, _ = events_socket(zmq.DEALER, f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
        try:
            store(ranks[1])
            store(ranks[0])
            topics = [str(r.client.pool_id) for r in ranks]
            assert len(set(topics)) == 2
            assert {m for m, _ in published(replay, topics[0], "rank 0's stream")} == {"CPU"}
            assert replayed(replay, topics[1]) == []
            for r in ranks:
                assert r.client.match(SEQ).num_host_pages == 3
        finally:
            replay.close(0)
            for r in ranks:
                r.close()


def test_an_older_daemon_is_not_sent_the_field_and_gives_the_pool_a_stream(tmp_path, monkeypatch):
    """A daemon whose hello does not say ``owned_kv_events`` refuses unknown fields: the
    client registers the pool without it (the pool then has a stream of its own there)."""
    sent = as_older_daemon(monkeypatch, "owned_kv_events")
    with clean_daemon(tmp_path, events={"enabled": True}, disk={"enabled": False}) as daemon:
        quiet = OwnedEngine(daemon.endpoint, layer_major(8, tp_rank_spec(1, 2)), name="r1", kv_events=False)
        replay, _ = events_socket(zmq.DEALER, f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
        try:
            (register,) = [m for m in sent if isinstance(m, p.Register)]
            assert register.owned.kv_events is p.UNSET
            store(quiet)
            assert {m for m, _ in published(replay, str(quiet.client.pool_id), "the pool's stream")} == {"CPU"}
        finally:
            replay.close(0)
            quiet.close()


def test_a_quiet_pool_registered_again_after_a_restart_stays_quiet(tmp_path):
    """The handle is what the client registers again: after a daemon restart the rank's
    new pool has no stream either, and the first rank's has one."""
    daemon = DaemonProcess(tmp_path, events={"enabled": True}, disk={"enabled": False}).start()
    ranks = [OwnedEngine(daemon.endpoint, layer_major(8, tp_rank_spec(r, 2)), name=f"r{r}", kv_events=r == 0,
                         reconnect_interval_s=0.1) for r in range(2)]
    replay = None
    try:
        assert daemon.stop() == 0
        daemon.start()
        registered_again(ranks)
        replay, _ = events_socket(zmq.DEALER, f"ipc://{tmp_path / 'hicache-events-replay.sock'}")
        store(ranks[1])
        store(ranks[0])
        assert {m for m, _ in published(replay, str(ranks[0].client.pool_id), "rank 0's stream")} == {"CPU"}
        assert replayed(replay, str(ranks[1].client.pool_id)) == []
    finally:
        if replay is not None:
            replay.close(0)
        for r in ranks:
            r.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0
