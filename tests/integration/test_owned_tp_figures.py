"""The token figures of a TP engine's engine-owned pools: each token once.

A TP engine registers one pool per rank, each in a spec of its own (its shard of the
heads), and its scheduler matches, and loads, on every rank: the same tokens go through
n tier managers. Ranks but the first register with ``counts_tokens=False``: the tokens
their pools serve or miss are the first rank's, already counted. Their transfers' bytes
and their pages (real bytes, real pages of a shard) still count. A real daemon process,
real sockets, the figures read from its ``/metrics`` over HTTP."""

from __future__ import annotations

import pytest

from daemon_util import DaemonProcess, scraped
from hicache import protocol as p
from hicache.client import CacheClient, load_into_each, match_each
from hicache.errors import InvalidArgument
from hicache.foreign import OwnedPoolHandle
from hicache.storage.mooncake_local import free_port
from owned_util import OWNED_SPEC, OwnedEngine, as_older_daemon, layer_major, tp_rank_spec

PS = OWNED_SPEC.page_size
SEQ = list(range(500, 500 + 3 * PS + 2))  # three whole pages and two tokens
OTHER = list(range(9000, 9000 + 2 * PS))  # never stored
TIERS = ("device", "host", "disk")


class Daemon:
    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.proc = DaemonProcess(tmp_path, disk={"enabled": False},
                                  metrics={"enabled": True, "address": "127.0.0.1", "port": self.port}).start()
        self.endpoint = self.proc.endpoint

    def metric(self, name: str, **labels) -> float:
        return scraped(self.port, name, **labels)

    def figures(self) -> dict[str, float]:
        settled = CacheClient(self.endpoint, heartbeat=False)
        try:
            settled.flush()  # (every load's completion has run: its hits are counted)
        finally:
            settled.close()
        out = {t: self.metric("hicache_matched_tokens_total", tier=t) for t in TIERS}
        out["missed"] = self.metric("hicache_missed_tokens_total")
        out["short"] = self.metric("hicache_load_short_tokens_total")
        out["h2d_bytes"] = self.metric("hicache_transfer_bytes_total", direction="h2d")
        return out

    def stop(self) -> None:
        if self.proc.proc is not None:
            assert self.proc.stop() == 0, self.proc.log.read_text()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def tp_engine(endpoint: str, tp: int, name: str = "e", *, counts: bool = True) -> list[OwnedEngine]:
    """One pool per rank; ranks but the first count no tokens (unless ``counts`` is off:
    an engine that says nothing, every rank counting, as before)."""
    ranks = []
    for r in range(tp):
        engine = OwnedEngine(endpoint, layer_major(8, tp_rank_spec(r, tp)), name=f"{name}-tp{r}",
                             kv_events=r == 0, counts_tokens=r == 0 or not counts)
        ranks.append(engine)
    return ranks


def schedulers(endpoint: str, ranks: list[OwnedEngine]) -> list[CacheClient]:
    out = []
    for r in ranks:
        client = CacheClient(endpoint, heartbeat=False)
        client.attach(r.name)
        out.append(client)
    return out


def serve(ranks: list[OwnedEngine], scheds: list[CacheClient], tokens, blocks) -> int:
    """What a TP engine's scheduler does for a request: match on every rank, load what
    every rank holds into each rank's blocks, wait; returns the pages loaded."""
    hits = match_each(scheds, tokens)
    pages = min(h.num_host_pages + h.num_disk_pages for h in hits)
    for s, h in zip(scheds, hits):
        s.lock(h.handle)
    try:
        if not pages:
            return 0
        done = load_into_each(scheds, [h.handle for h in hits], blocks[:pages])
        for r, d in zip(ranks, done):
            assert not isinstance(d, Exception), d
            for layer in range(OWNED_SPEC.num_layers):
                r.client.wait_layer(d.wait, layer, timeout_s=30)
        return min(d.num_loaded_pages for d in done)
    finally:
        for s, h in zip(scheds, hits):
            s.unlock(h.handle)


def store_on_every_rank(ranks: list[OwnedEngine], tokens, blocks) -> None:
    whole = len(tokens) // PS
    for r in ranks:
        r.compute(tokens, blocks[:whole])
        assert r.client.store(tokens, blocks[:whole]).num_cached == whole


def close(*groups) -> None:
    for group in groups:
        for item in group:
            item.close()


def test_a_tp_engine_s_hits_and_misses_count_once(daemon):
    """A TP=2 engine stores a prompt on both ranks, then hits it (host) and misses
    another: the figures are one engine's — 3 pages matched on host, the miss once —
    while the loads' bytes are both ranks' (each copied its shard)."""
    ranks = tp_engine(daemon.endpoint, 2)
    scheds = schedulers(daemon.endpoint, ranks)
    try:
        store_on_every_rank(ranks, SEQ, [1, 2, 3])
        before = daemon.figures()
        assert serve(ranks, scheds, SEQ, [4, 5, 6]) == 3
        for r in ranks:
            r.check(SEQ, [4, 5, 6])
        assert serve(ranks, scheds, OTHER, [7]) == 0
        after = daemon.figures()
        assert after["host"] - before["host"] == 3 * PS
        assert after["device"] == before["device"] and after["disk"] == before["disk"]
        assert after["missed"] - before["missed"] == 2 + 2 * PS  # (SEQ's tail and all of OTHER)
        assert after["h2d_bytes"] - before["h2d_bytes"] == 2 * 3 * OWNED_SPEC.host_page_bytes
    finally:
        close(scheds, ranks)


def test_ranks_that_say_nothing_count_every_rank_as_before(daemon):
    """Without the flag every rank's pool counts (what an engine that does not know it
    gets): the same requests count twice — what the flag is there to avoid."""
    ranks = tp_engine(daemon.endpoint, 2, counts=False)
    scheds = schedulers(daemon.endpoint, ranks)
    try:
        store_on_every_rank(ranks, SEQ, [1, 2, 3])
        before = daemon.figures()
        assert serve(ranks, scheds, SEQ, [4, 5, 6]) == 3
        after = daemon.figures()
        assert after["host"] - before["host"] == 2 * 3 * PS
    finally:
        close(scheds, ranks)


def test_a_spec_counts_while_any_of_its_pools_does(daemon):
    """Two TP=2 engines of one model: rank 1's spec is shared by both engines' rank 1
    pools, neither of which counts. A single rank-1-shaped engine that does count (a
    client of its own making) makes the spec count while it is registered, and the
    spec stops again once it has gone."""
    first = tp_engine(daemon.endpoint, 2, "a")
    second = tp_engine(daemon.endpoint, 2, "b")
    scheds = schedulers(daemon.endpoint, second)
    try:
        store_on_every_rank(first, SEQ, [1, 2, 3])
        before = daemon.figures()
        assert serve(second, scheds, SEQ, [4, 5, 6]) == 3
        assert daemon.figures()["host"] - before["host"] == 3 * PS
        loud = OwnedEngine(daemon.endpoint, layer_major(8, tp_rank_spec(1, 2)), name="loud", counts_tokens=True)
        try:
            before = daemon.figures()
            assert serve(second, scheds, SEQ, [4, 5, 6]) == 3
            assert daemon.figures()["host"] - before["host"] == 2 * 3 * PS
        finally:
            loud.close()
        client = CacheClient(daemon.endpoint, heartbeat=False)
        try:  # (the bye of loud's session has been handled once a later request is answered)
            client.flush()
        finally:
            client.close()
        before = daemon.figures()
        assert serve(second, scheds, SEQ, [4, 5, 6]) == 3
        assert daemon.figures()["host"] - before["host"] == 3 * PS
    finally:
        close(scheds, first, second)


def test_a_rank_left_alone_still_counts_nothing(daemon):
    """The first rank's engine goes (a crash, a bye): its other rank's pool keeps
    serving, and its tokens still are not counted — they were never that pool's to
    count."""
    ranks = tp_engine(daemon.endpoint, 2)
    rest = None
    try:
        store_on_every_rank(ranks, SEQ, [1, 2, 3])
        ranks[0].close()
        rest = schedulers(daemon.endpoint, ranks[1:])
        before = daemon.figures()
        assert serve(ranks[1:], rest, SEQ, [4, 5, 6]) == 3
        assert serve(ranks[1:], rest, OTHER, [7]) == 0
        after = daemon.figures()
        assert after == {**before, "h2d_bytes": after["h2d_bytes"]}
        assert after["h2d_bytes"] > before["h2d_bytes"]
    finally:
        close(rest or [], ranks[1:])


def test_an_older_daemon_is_not_sent_the_field(tmp_path, monkeypatch):
    """A daemon whose hello does not say ``owned_counts_tokens`` refuses unknown fields:
    the client registers the pool without it (its tokens then count there)."""
    sent = as_older_daemon(monkeypatch, "owned_counts_tokens")
    d = Daemon(tmp_path)
    try:
        quiet = OwnedEngine(d.endpoint, layer_major(8, tp_rank_spec(1, 2)), name="r1", counts_tokens=False)
        try:
            (register,) = [m for m in sent if isinstance(m, p.Register)]
            assert register.owned.counts_tokens is p.UNSET
            assert quiet.client.match(OTHER).num_tokens == 0
            assert d.figures()["missed"] == len(OTHER)
        finally:
            quiet.close()
    finally:
        d.stop()


def test_the_flag_must_be_a_bool(daemon):
    ranks = tp_engine(daemon.endpoint, 1)
    try:
        with pytest.raises(InvalidArgument, match="counts_tokens"):
            OwnedPoolHandle(ranks[0].layout, ranks[0].exported.handle.buffers, "x", counts_tokens="no")
    finally:
        close(ranks)
