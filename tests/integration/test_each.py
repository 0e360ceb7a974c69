"""One call on several sessions (``match_each``, ``load_into_each``): an engine under
tensor parallelism has one engine-owned pool per rank and its scheduler a session on
each. Every request is sent before any answer is read; a session that cannot take part
(degraded, or a call that is no one request) is called after the others, and one
session's error is its own result. Real daemon, real sockets."""

from __future__ import annotations

import numpy as np
import pytest

from daemon_util import DaemonProcess, clean_daemon
from hicache.client import CacheClient, LoadedInto, NodeHandle, RemoteError, load_into_each, match_each
from hicache.errors import ErrorCode, InvalidArgument, LockUnderflow
from owned_util import OWNED_SPEC, OwnedEngine, content, layer_major, registered_again, tp_rank_spec

PS = OWNED_SPEC.page_size
NUM_BLOCKS = 24
RANKS = 3
SEQ = list(range(300, 300 + 4 * PS + 3))
STORED = [1, 2, 3, 4]


def sections(tmp_path):
    return dict(host={"bytes": 64 * OWNED_SPEC.host_page_bytes}, disk={"enabled": False})


@pytest.fixture
def daemon(tmp_path):
    with clean_daemon(tmp_path, **sections(tmp_path)) as proc:
        yield proc


def rank_bytes(rank: int, page: int, layer: int) -> np.ndarray:
    """What rank ``rank`` computes for ``page`` of ``layer`` of SEQ: each rank its own."""
    return content(SEQ, page, layer) ^ np.uint8(rank + 1)


class Ranks:
    """``RANKS`` workers, each with a pool of its own holding its bytes of SEQ's four
    pages, and a scheduler session attached to each."""

    def __init__(self, endpoint: str, **scheduler_args) -> None:
        self.workers: list[OwnedEngine] = []
        self.schedulers: list[CacheClient] = []
        try:
            for rank in range(RANKS):
                worker = OwnedEngine(endpoint, layer_major(NUM_BLOCKS, tp_rank_spec(rank, RANKS)),
                                     name=f"rank{rank}", timeout_s=2.0, reconnect_interval_s=0.1)
                self.workers.append(worker)
                for page, block in enumerate(STORED):
                    for layer in range(OWNED_SPEC.num_layers):
                        worker.block(layer, block)[:] = rank_bytes(rank, page, layer)
                assert worker.client.store(SEQ, STORED).num_cached == 4
                scheduler = CacheClient(endpoint, **scheduler_args)
                self.schedulers.append(scheduler)
                scheduler.attach(f"rank{rank}")
        except BaseException:
            self.close()
            raise

    def landed(self, results, blocks, pages: int, ranks=range(RANKS)) -> None:
        """Rank ``ranks[i]``'s load ``results[i]`` brought that rank's own bytes of the
        first ``pages`` pages into ``blocks``."""
        for rank, done in zip(ranks, results, strict=True):
            worker = self.workers[rank]
            assert isinstance(done, LoadedInto) and done.num_loaded_pages == pages, (rank, done)
            for layer in range(OWNED_SPEC.num_layers):
                worker.client.wait_layer(done.wait, layer, timeout_s=30)
            for page, block in enumerate(blocks[:pages]):
                for layer in range(OWNED_SPEC.num_layers):
                    assert np.array_equal(worker.block(layer, block), rank_bytes(rank, page, layer)), (rank, page)

    def close(self) -> None:
        for client in self.schedulers:
            client.close()
        for worker in self.workers:
            worker.close()


class Order:
    """The order of every send and every answer read, per client."""

    def __init__(self, monkeypatch, clients) -> None:
        self.events: list[tuple[str, int]] = []
        index = {id(c): i for i, c in enumerate(clients)}
        send, receive = CacheClient._send_locked, CacheClient._receive_locked

        def sent(client, message):
            out = send(client, message)
            self.events.append(("send", index.get(id(client), -1)))
            return out

        def received(client, request_id, deadline):
            out = receive(client, request_id, deadline)
            self.events.append(("answer", index.get(id(client), -1)))
            return out

        monkeypatch.setattr(CacheClient, "_send_locked", sent)
        monkeypatch.setattr(CacheClient, "_receive_locked", received)


def test_every_rank_is_asked_before_any_answer_is_read_and_each_loads_its_own(daemon, monkeypatch):
    ranks = Ranks(daemon.endpoint)
    try:
        order = Order(monkeypatch, ranks.schedulers)
        matches = match_each(ranks.schedulers, SEQ[: 4 * PS])
        assert [(m.num_device_pages, m.num_host_pages) for m in matches] == [(0, 4)] * RANKS
        everyone = list(range(RANKS))
        assert order.events == [("send", r) for r in everyone] + [("answer", r) for r in everyone]

        order.events.clear()
        blocks = [9, 14, 5, 20]
        for worker in ranks.workers:
            worker.wipe(blocks)
        results = load_into_each(ranks.schedulers, [m.handle for m in matches], blocks, locked=False)
        assert order.events == [("send", r) for r in everyone] + [("answer", r) for r in everyone]
        ranks.landed(results, blocks, 4)
        # Nothing is left held: each session's next call goes through as usual.
        for scheduler in ranks.schedulers:
            assert scheduler.match(SEQ[: 4 * PS]).num_host_pages == 4
        check = CacheClient(daemon.endpoint, heartbeat=False)
        try:
            check.check()
        finally:
            check.close()
    finally:
        ranks.close()


def test_one_sessions_error_is_its_own_result_and_the_others_loads_go_ahead(daemon):
    """Rank 1 names a node its session does not know (answered ``UNKNOWN_NODE``), then
    a handle it holds no lock on (refused before anything is sent): the other ranks'
    loads land all the same, and every session keeps serving."""
    ranks = Ranks(daemon.endpoint)
    try:
        matches = match_each(ranks.schedulers, SEQ[: 4 * PS])
        handles = [m.handle for m in matches]
        blocks = [9, 14, 5]
        handles[1] = NodeHandle(handles[1].node + 10_000, handles[1].epoch)
        results = load_into_each(ranks.schedulers, handles, blocks, locked=False)
        assert isinstance(results[1], RemoteError) and results[1].code == ErrorCode.UNKNOWN_NODE
        ranks.landed([results[0], results[2]], blocks, 3, ranks=(0, 2))

        handles = [m.handle for m in matches]
        results = load_into_each(ranks.schedulers, handles, blocks, locked=True)  # none of them locked
        assert all(isinstance(r, LockUnderflow) for r in results), results
        for scheduler in ranks.schedulers:
            assert scheduler.match(SEQ[: 4 * PS]).num_host_pages == 4
    finally:
        ranks.close()


def test_a_session_whose_daemon_is_gone_misses_and_the_next_call_skips_it_at_once(daemon, tmp_path, monkeypatch):
    """A third session talks to a daemon that was killed: its match waits out its
    timeout (the others' answers are in meanwhile) and misses; from then on it is
    degraded, sent nothing, and misses at once while the others hit."""
    ranks = Ranks(daemon.endpoint)
    (tmp_path / "gone").mkdir()
    gone = DaemonProcess(tmp_path / "gone", **sections(tmp_path)).start()
    lost = OwnedEngine(gone.endpoint, layer_major(NUM_BLOCKS, tp_rank_spec(0, RANKS)), name="lost")
    away = CacheClient(gone.endpoint, timeout_s=0.5, reconnect_interval_s=60)
    try:
        away.attach("lost")
        gone.kill()
        clients = [ranks.schedulers[0], away, ranks.schedulers[1]]
        order = Order(monkeypatch, clients)
        matches = match_each(clients, SEQ[: 4 * PS])
        assert [m.num_host_pages for m in matches] == [4, 0, 4] and matches[1].handle is None
        assert away.degraded and not ranks.schedulers[0].degraded
        assert order.events == [("send", 0), ("send", 1), ("send", 2), ("answer", 0), ("answer", 2)]

        order.events.clear()
        matches = match_each(clients, SEQ[: 4 * PS])
        assert [m.num_host_pages for m in matches] == [4, 0, 4]
        assert order.events == [("send", 0), ("send", 2), ("answer", 0), ("answer", 2)]
        blocks = [6, 7]
        results = load_into_each(clients, [m.handle for m in matches], blocks, locked=False)
        assert results[1] == LoadedInto(0, ())
        ranks.landed([results[0], results[2]], blocks, 2, ranks=(0, 1))
    finally:
        away.close()
        lost.close()
        ranks.close()


def test_after_a_daemon_restart_each_session_attaches_again_and_its_call_is_answered(tmp_path):
    """Sessions without heartbeats learn of the restart from their calls' answers
    (``UNKNOWN_SESSION``): each attaches again and makes its call once more. The
    handles from before the restart are orphans: their loads load nothing."""
    daemon = DaemonProcess(tmp_path, **sections(tmp_path)).start()
    ranks = Ranks(daemon.endpoint, heartbeat=False, timeout_s=2.0)
    try:
        before = match_each(ranks.schedulers, SEQ[: 4 * PS])
        assert daemon.stop() == 0
        daemon.start()
        registered_again(ranks.workers)
        for worker in ranks.workers:
            assert worker.client.store(SEQ, STORED).num_cached == 4  # (the host tier went with the daemon)
        epochs = [s.epoch for s in ranks.schedulers]
        matches = match_each(ranks.schedulers, SEQ[: 4 * PS])
        assert [m.num_host_pages for m in matches] == [4] * RANKS
        assert [s.epoch for s in ranks.schedulers] == [e + 1 for e in epochs]
        stale = load_into_each(ranks.schedulers, [m.handle for m in before], [5], locked=False)
        assert stale == [LoadedInto(0, ())] * RANKS
        blocks = [10, 11, 12, 13]
        ranks.landed(load_into_each(ranks.schedulers, [m.handle for m in matches], blocks, locked=False), blocks, 4)
    finally:
        ranks.close()
        if daemon.proc is not None:
            assert daemon.stop() == 0


def test_a_session_twice_and_a_daemon_that_loads_only_locked_paths_are_called_after_the_others(daemon, monkeypatch):
    """A session named twice makes its second call after its first is answered (its
    socket is one); a load_into from a daemon that needs the path locked first is three
    round trips, made after the one-request calls are answered."""
    ranks = Ranks(daemon.endpoint)
    try:
        s0, s1, s2 = ranks.schedulers
        matches = match_each([s0, s1, s0, s2], SEQ[: 4 * PS])
        assert [m.num_host_pages for m in matches] == [4] * 4 and matches[0].handle == matches[2].handle
        s2._load_unlocked = False  # (what an older daemon's hello says)
        order = Order(monkeypatch, ranks.schedulers)
        blocks = [15, 16, 17, 18]
        results = load_into_each([s0, s1, s2], [matches[0].handle, matches[1].handle, matches[3].handle],
                                 blocks, locked=False)
        assert order.events[:4] == [("send", 0), ("send", 1), ("answer", 0), ("answer", 1)]
        assert order.events[4:] == [("send", 2), ("answer", 2)] * 3  # lock, load_into, unlock
        ranks.landed(results, blocks, 4)
        assert not s2._locked
    finally:
        ranks.close()


def test_a_request_over_the_daemons_size_limit_is_refused_for_its_session_alone(daemon):
    ranks = Ranks(daemon.endpoint)
    try:
        s0, s1, s2 = ranks.schedulers
        matches = [s.match(SEQ[: 4 * PS]) for s in ranks.schedulers]
        limit, s1.max_message_bytes = s1.max_message_bytes, 32  # (as if the daemon took no more)
        blocks = [19, 20, 21, 22]
        results = load_into_each(ranks.schedulers, [m.handle for m in matches], blocks, locked=False)
        assert isinstance(results[1], InvalidArgument)
        ranks.landed([results[0], results[2]], blocks, 4, ranks=(0, 2))
        with pytest.raises(InvalidArgument):
            match_each(ranks.schedulers, SEQ[: 4 * PS])
        s1.max_message_bytes = limit
        assert s1.match(SEQ[: 4 * PS]).num_host_pages == 4 and not s1.degraded
    finally:
        ranks.close()
