"""RPC benchmark: hicache ``match`` round trips against a raw pyzmq echo.

In one run, over ``ipc://`` on this machine:

* the floor — a pyzmq REQ/REP echo server in its own process, echoing a payload the
  size of a 2,000-token match request; and next to it a DEALER/ROUTER echo in Python
  (read and written frame by frame, as hicache's server does), the least a server that
  answers many clients on one socket does; and the REQ/REP echo again with both ends on
  hicache's transport settings (``transport.new_context``: ZeroMQ's I/O threads
  ``SCHED_BATCH``), which speed up any round trip on this VM — the like-for-like floor;
* hicache — ``hicache serve`` in its own process (default configuration, metrics on, on
  a free port; disk off); an engine registers a shared-memory
  pool, inserts a 2,000-token sequence, then times ``match`` round trips of it (a
  full device hit) through :class:`hicache.client.CacheClient`, alternating with echo
  round trips from the same process so that both see the same machine (this VM's
  round-trip times drift by 2x within minutes): p50 / p99 latency; then throughput from
  one client and from four client processes at once (each its own engine and pool),
  plus a batched ``match_many`` of 16 lookups per message;
* the same match over CURVE: the daemon also listens on ``tcp://127.0.0.1`` with CURVE
  (keys from ``hicache keygen``'s writer, the client's listed in ``[[auth.identities]]``);
  after the figures above (which it leaves as they were), a second engine in the
  latency process, with its own pool and sequence, takes turns with the first for as
  long again, each match right after a round of the echoes — ``curve_p50_ratio`` is its
  p50 over the plain ``ipc://`` match's of that phase (``plain_beside_curve_p50_us``).

    python benchmarks/bench_rpc.py [--seconds 3] [--json]

With ``--json`` the last line is one JSON object with ``echo_p50_us``,
``router_echo_p50_us``, ``tuned_echo_p50_us``, ``match_p50_us``, ``match_p99_us``,
``p50_ratio`` (against the REQ/REP echo on pyzmq's defaults, the issue's floor),
``p50_ratio_vs_tuned_echo``, ``single_client_ops``, ``four_client_ops``, ``scaling``,
the batched figures, ``curve_match_p50_us``, ``curve_match_p99_us``,
``plain_beside_curve_p50_us`` and ``curve_p50_ratio``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

TOKENS = 2000
PAGE_SIZE = 16


def spec():
    from hicache.spec import KVSpec

    return KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE, model="bench-rpc")


def echo_server(endpoint: str, router: bool = False, tuned: bool = False) -> None:
    """Echo every message: a REP socket (the floor), or with ``router`` a ROUTER socket
    read and written frame by frame the way hicache's server does (two receives, one
    ``RCVMORE`` check, one send per frame) — the least any Python server that answers
    many clients on one socket does. (With ``recv_multipart`` / ``send_multipart`` it
    took ~17 us longer a round trip on the 2-core VM of the README.) With ``tuned`` the
    REP echo runs on hicache's transport settings (``transport.new_context``: batch I/O
    threads), the like-for-like floor for what hicache's sockets do."""
    if tuned:
        from hicache.transport import new_context

        ctx = new_context()
    else:
        ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if router else zmq.REP)
    sock.bind(endpoint)
    while True:
        if router:
            frames = [sock.recv(), sock.recv()]
            while sock.getsockopt(zmq.RCVMORE):
                frames.append(sock.recv())
            for frame in frames[:-1]:
                sock.send(frame, zmq.SNDMORE)
            sock.send(frames[-1])
            message = frames[-1]
        else:
            message = sock.recv()
            sock.send(message)
        if message == b"stop":
            break
    sock.close(linger=0)
    ctx.term()


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q) * 1e6)


def _engine_client(endpoint: str, offset: int, **client_args):
    """A client with a registered pool holding one 2,000-token sequence on device."""
    from hicache.client import CacheClient
    from hicache.engine.kv_pool import export_kv_pool

    kv = spec()
    exported = export_kv_pool(kv, 256)
    client = CacheClient(endpoint, heartbeat=True, **client_args)
    client.register(kv, [exported.handle])
    tokens = np.arange(TOKENS, dtype=np.int32) + offset
    pages = client.alloc(TOKENS // PAGE_SIZE)
    client.insert(tokens, pages)
    packed = tokens.tobytes()
    assert client.match(packed).num_device_pages == TOKENS // PAGE_SIZE
    for _ in range(200):
        client.match(packed)
    return client, exported, packed


def engine(endpoint: str, seconds: float, batch: int, start, results,
           echo_endpoints: tuple[str, str, str] | None = None, payload_size: int = 0,
           curve: dict | None = None) -> None:
    """An engine process: register, insert the sequence, then match as fast as it can
    (or, with ``echo_endpoints``, take turns: a match, a REQ/REP echo, a DEALER/ROUTER
    echo and a REQ/REP echo on hicache's transport settings, and with ``curve`` a match
    of a second engine over CURVE ``tcp://``, each timed)."""
    from hicache.transport import new_context

    client, exported, packed = _engine_client(endpoint, os.getpid() % 1000 * 10_000)
    if echo_endpoints is not None:
        ctx = zmq.Context()
        echo = ctx.socket(zmq.REQ)
        echo.connect(echo_endpoints[0])
        router_echo = ctx.socket(zmq.DEALER)
        router_echo.connect(echo_endpoints[1])
        tuned_ctx = new_context()
        tuned_echo = tuned_ctx.socket(zmq.REQ)
        tuned_echo.connect(echo_endpoints[2])
        socks = (echo, router_echo, tuned_echo)
        payload = os.urandom(payload_size)
        for _ in range(200):
            for sock in socks:
                sock.send(payload)
                sock.recv()
        clock = time.perf_counter

        def rounds(matchers, echoes) -> list[list[float]]:
            """For ``seconds``: each matcher's match, then one round trip of each echo."""
            samples: list[list[float]] = [[] for _ in matchers]
            deadline = clock() + seconds
            while clock() < deadline:
                for (who, sequence), out in zip(matchers, samples):
                    start = clock()
                    who.match(sequence)
                    out.append(clock() - start)
                    for sock, echo_samples in zip(socks, echoes):
                        start = clock()
                        sock.send(payload)
                        sock.recv()
                        echo_samples.append(clock() - start)
            return samples

        # Phase 1, as this benchmark always ran: the plain match against the echoes.
        echoes: tuple[list[float], ...] = ([], [], [])
        [matches] = rounds([(client, packed)], echoes)
        # Phase 2: the plain and the CURVE match taking turns, each after a round of the
        # echoes (the daemon idle for the same while before either).
        curve_client, curve_exported, curve_packed = _engine_client(
            curve["endpoint"], os.getpid() % 1000 * 10_000 + 5000, server_key=curve["server_key"],
            key_file=curve["key_file"])
        for _ in range(200):
            curve_client.match(curve_packed)
        plain_beside, curve_matches = rounds([(client, packed), (curve_client, curve_packed)], ([], [], []))
        curve_client.close()
        curve_exported.close()
        for sock in socks:
            sock.send(b"stop")
            sock.recv()
            sock.close(linger=0)
        ctx.term()
        tuned_ctx.term()
        results.put((matches, *echoes, plain_beside, curve_matches))
        client.close()
        exported.close()
        return
    if start is not None:
        start.wait(120)  # every engine set up: all of them time their matches together
    samples = []
    deadline = time.perf_counter() + seconds
    ops = 0
    while True:
        start = time.perf_counter()
        if batch > 1:
            client.match_many([packed] * batch)
        else:
            client.match(packed)
        end = time.perf_counter()
        samples.append(end - start)
        ops += batch
        if end >= deadline:
            break
    results.put((ops, sum(samples), samples if batch == 1 else []))
    client.close()
    exported.close()


def engine_context():
    """Engines run in processes of their own, forked from a server that imported the
    client library (torch with it) once: a spawned engine took ~2 s to import them."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hicache.client", "hicache.engine.kv_pool"])
    return ctx


def run_latency(endpoint: str, echo_endpoints: tuple[str, str, str], payload_size: int, seconds: float,
                curve: dict):
    ctx = engine_context()
    results = ctx.Queue()
    proc = ctx.Process(target=engine, args=(endpoint, seconds, 1, None, results, echo_endpoints, payload_size,
                                            curve))
    proc.start()
    samples = results.get(timeout=120)
    proc.join(30)
    return samples


def run_engines(endpoint: str, count: int, seconds: float, batch: int = 1):
    ctx = engine_context()
    results = ctx.Queue()
    start = ctx.Barrier(count) if count > 1 else None
    procs = [ctx.Process(target=engine, args=(endpoint, seconds, batch, start, results)) for _ in range(count)]
    for proc in procs:
        proc.start()
    out = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    ops = sum(o[0] for o in out)
    busy = max(o[1] for o in out)
    samples = [s for o in out for s in o[2]]
    return ops / busy, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from hicache import protocol as p
    from hicache.auth import read_public, write_keypair
    from hicache.daemon.spawn import start_daemon, stop_daemon

    directory = Path(tempfile.mkdtemp(prefix="hicache-bench-rpc-"))
    payload_size = len(p.encode(p.Match(id=1, session=2**62, tokens=b"\0" * (4 * TOKENS))))

    ctx = multiprocessing.get_context("spawn")
    echo_endpoints = (f"ipc://{directory / 'echo.sock'}", f"ipc://{directory / 'router-echo.sock'}",
                      f"ipc://{directory / 'tuned-echo.sock'}")
    echoes = [ctx.Process(target=echo_server, args=(echo_endpoints[0],)),
              ctx.Process(target=echo_server, args=(echo_endpoints[1], True)),
              ctx.Process(target=echo_server, args=(echo_endpoints[2], False, True))]
    for echo in echoes:
        echo.start()

    _, server_secret = write_keypair(directory / "server")
    client_public, client_secret = write_keypair(directory / "engine")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    curve = {"endpoint": f"tcp://127.0.0.1:{port}", "server_key": str(directory / "server.key"),
             "key_file": str(client_secret)}
    daemon = start_daemon(directory, f'[server]\nsocket = "{directory / "hicache.sock"}"\n'
                                     f'tcp = "{curve["endpoint"]}"\n[disk]\nenabled = false\n'
                                     f'[metrics]\nport = 0\n[host]\nratio = 1.0\n'
                                     f'[auth]\nsecret_key_file = "{server_secret}"\n[[auth.identities]]\n'
                                     f'name = "bench"\npublic_keys = ["{read_public(client_public).decode()}"]\n',
                          name="bench_rpc")
    endpoint = f"ipc://{directory / 'hicache.sock'}"
    try:
        samples, echo_samples, router_echo_samples, tuned_echo_samples, beside_samples, curve_samples = run_latency(
            endpoint, echo_endpoints, payload_size, args.seconds, curve)
        for echo in echoes:
            echo.join(10)
        single_ops, _ = run_engines(endpoint, 1, args.seconds)
        four_ops, _ = run_engines(endpoint, 4, args.seconds)
        batched_ops, _ = run_engines(endpoint, 1, args.seconds, batch=16)
    finally:
        stop_daemon(daemon, directory, 30)

    figures = {
        "tokens": TOKENS,
        "payload_bytes": payload_size,
        "echo_p50_us": percentile_us(echo_samples, 50),
        "echo_p99_us": percentile_us(echo_samples, 99),
        "router_echo_p50_us": percentile_us(router_echo_samples, 50),
        "router_echo_p99_us": percentile_us(router_echo_samples, 99),
        "tuned_echo_p50_us": percentile_us(tuned_echo_samples, 50),
        "tuned_echo_p99_us": percentile_us(tuned_echo_samples, 99),
        "match_p50_us": percentile_us(samples, 50),
        "match_p99_us": percentile_us(samples, 99),
        "single_client_ops": single_ops,
        "four_client_ops": four_ops,
        "batched_match_ops": batched_ops,
        "curve_match_p50_us": percentile_us(curve_samples, 50),
        "curve_match_p99_us": percentile_us(curve_samples, 99),
        "plain_beside_curve_p50_us": percentile_us(beside_samples, 50),
    }
    figures["curve_p50_ratio"] = figures["curve_match_p50_us"] / figures["plain_beside_curve_p50_us"]
    figures["p50_ratio"] = figures["match_p50_us"] / figures["echo_p50_us"]
    figures["router_echo_ratio"] = figures["router_echo_p50_us"] / figures["echo_p50_us"]
    figures["p50_ratio_vs_router_echo"] = figures["match_p50_us"] / figures["router_echo_p50_us"]
    figures["p50_ratio_vs_tuned_echo"] = figures["match_p50_us"] / figures["tuned_echo_p50_us"]
    figures["scaling"] = four_ops / single_ops
    print(f"2,000-token match over ipc://, request {payload_size} bytes, {os.cpu_count()} cores")
    print(f"{'':26} {'p50 us':>8} {'p99 us':>8}")
    print(f"{'pyzmq REQ/REP echo':26} {figures['echo_p50_us']:8.1f} {figures['echo_p99_us']:8.1f}")
    print(f"{'pyzmq DEALER/ROUTER echo':26} {figures['router_echo_p50_us']:8.1f} {figures['router_echo_p99_us']:8.1f}"
          f"   ({figures['router_echo_ratio']:.2f}x the echo)")
    print(f"{'REQ/REP echo, batch I/O':26} {figures['tuned_echo_p50_us']:8.1f} {figures['tuned_echo_p99_us']:8.1f}")
    print(f"{'hicache match':26} {figures['match_p50_us']:8.1f} {figures['match_p99_us']:8.1f}"
          f"   ({figures['p50_ratio']:.2f}x the echo, {figures['p50_ratio_vs_router_echo']:.2f}x the ROUTER echo,"
          f" {figures['p50_ratio_vs_tuned_echo']:.2f}x the batch-I/O echo)")
    print(f"{'match, CURVE tcp://':26} {figures['curve_match_p50_us']:8.1f} {figures['curve_match_p99_us']:8.1f}"
          f"   ({figures['curve_p50_ratio']:.2f}x the ipc:// match beside it, "
          f"{figures['plain_beside_curve_p50_us']:.1f} us)")
    print(f"throughput: 1 client {single_ops:,.0f}/s, 4 clients {four_ops:,.0f}/s "
          f"({figures['scaling']:.2f}x), batched x16 {batched_ops:,.0f} lookups/s")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
