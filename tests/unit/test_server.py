"""The server loop in a thread over a real ipc:// socket: what it survives."""

import gc
import threading
import time

import pytest
import zmq

from hicache.config import DaemonConfig
from hicache import protocol as p
from hicache.daemon.collector import Collector
from hicache.daemon.server import Server
from hicache.daemon.statelock import AlreadyRunning


@pytest.fixture
def served(tmp_path):
    config = DaemonConfig.load(overrides={"server.socket": str(tmp_path / "hicache.sock"), "disk.enabled": False,
                                          "metrics.enabled": False})
    server = Server(config)
    server.bind()
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{tmp_path / 'hicache.sock'}")
    yield server, sock
    sock.close()
    context.term()
    server.stop()
    thread.join(30)
    gc.unfreeze()  # (the served daemon froze this process's objects: give them back to the collector)
    assert not thread.is_alive()


def ask(sock, message, timeout_ms=10_000):
    sock.send(p.encode(message))
    assert sock.poll(timeout_ms), "no answer"
    return p.decode_reply(sock.recv())


def test_the_loop_survives_a_failure_outside_the_daemons_fence(served, monkeypatch):
    server, sock = served
    assert isinstance(ask(sock, p.Health(id=1)), p.HealthReply)
    failures = {"answer": 1, "poll": 1}
    daemon = server.daemon
    real_answer, real_poll = daemon.answer, daemon.poll

    def answer(request, peer=b""):
        if failures["answer"]:
            failures["answer"] -= 1
            raise RuntimeError("a bug in the handling")
        return real_answer(request, peer)

    def poll(timeout_s=0.0):
        if failures["poll"]:
            failures["poll"] -= 1
            raise RuntimeError("a bug in the catch-up")
        return real_poll(timeout_s)

    monkeypatch.setattr(daemon, "answer", answer)
    monkeypatch.setattr(daemon, "poll", poll)
    sock.send(p.encode(p.Health(id=2)))  # dropped: its handling raised
    reply = ask(sock, p.Health(id=3))
    assert isinstance(reply, p.HealthReply) and reply.id == 3
    stats = ask(sock, p.Stats(id=4)).stats
    assert stats.requests["loop/DROPPED"] == 2 and failures == {"answer": 0, "poll": 0}


@pytest.mark.parametrize("ask_for", ["stop", "reload"])
def test_a_stop_or_a_reload_wakes_a_loop_that_waits_for_no_deadline(tmp_path, monkeypatch, ask_for):
    """``stop`` and ``request_reload`` (what SIGTERM and SIGHUP call, on the loop's own
    thread) make the loop's blocking receive return: here it has no deadline to wake
    for (before, it noticed them at its next receive timeout only — here, never)."""
    config = DaemonConfig.load(overrides={"server.socket": str(tmp_path / "hicache.sock"), "disk.enabled": False,
                                          "metrics.enabled": False})
    server = Server(config)
    server.bind()
    monkeypatch.setattr(server, "_timeout_ms", lambda: -1)
    reloads = []
    server.daemon.reload_source = lambda: reloads.append(1) or server.config.auth
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        if ask_for == "reload":
            server.request_reload()
            ask_for_stop_at = time.monotonic() + 30
            while not reloads:  # (served by the loop: nothing else asks it to reload)
                assert time.monotonic() < ask_for_stop_at, "the loop never reloaded"
                time.sleep(0.01)
    finally:
        server.stop()
        thread.join(30)
        gc.unfreeze()
    assert not thread.is_alive(), "the loop never saw the stop"


def test_a_second_server_on_the_same_socket_is_refused(served, tmp_path):
    server, sock = served
    with pytest.raises(AlreadyRunning):
        Server(server.config)
    assert isinstance(ask(sock, p.Health(id=1)), p.HealthReply)


def test_the_served_daemon_keeps_settled_objects_out_of_full_collections(served):
    """Start-up's objects, and what each tier manager leaves when it starts serving, are
    frozen out of the cyclic collector's full collections (which otherwise walk every
    object torch and the indexes brought: a stall of every request)."""
    server, sock = served
    assert isinstance(ask(sock, p.Health(id=1)), p.HealthReply)  # the loop runs
    assert server.daemon.specs.on_settled is gc.freeze
    assert gc.get_freeze_count() > 0
    assert server.collector._on_gc in gc.callbacks  # (the survivors of older collections too)


def test_the_collector_freezes_what_survives_an_older_collection_and_unfreezes_once_an_hour():
    now = [0.0]
    collector = Collector(clock=lambda: now[0], unfreeze_every_s=3600.0)
    gc.unfreeze()
    collector.install()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        survivors = [[i] for i in range(1000)]  # tracked containers that outlive a collection
        gc.collect()
        assert gc.get_freeze_count() >= frozen + len(survivors)
        now[0] = 3599.0
        collector.tick()
        assert gc.get_freeze_count() > 0 and collector.unfrozen == 0
        now[0] = 3600.0
        collector.tick()
        assert gc.get_freeze_count() == 0 and collector.unfrozen == 1
        gc.collect(0)  # the youngest generation's collections freeze nothing
        assert gc.get_freeze_count() == 0
        gc.collect(1)  # the middle one's do: a full collection would find nothing young
        assert gc.get_freeze_count() > 0
    finally:
        collector.uninstall()
        gc.unfreeze()
    assert collector._on_gc not in gc.callbacks
