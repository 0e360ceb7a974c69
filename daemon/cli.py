"""The ``hicache`` command line.

    hicache serve [--config FILE] [--socket PATH] [--tcp ENDPOINT] [--no-disk]
    hicache status [--endpoint E] [--json] [--watch [SECONDS]]
    hicache check [--endpoint E]
    hicache reload [--endpoint E]
    hicache keygen PATH_STEM
    hicache demo [--endpoint E] [--conversations N] [--turns N]

``serve`` runs the daemon in the foreground (embedded defaults: CPU mode, LMDB under
the state directory, socket in the runtime directory — see :mod:`hicache.config`).
SIGTERM or SIGINT drains it and it exits 0 within ``[server].drain_timeout_s`` and a
few seconds, also when a transfer never finishes (then logged with the pages it loses).
If another daemon serves the same socket or store, it exits 1 at once, having touched
neither; if another process has a port it is to listen on (``[metrics]``, ``[server]
tcp``, ``[events]``), it exits 1 naming the address; if it cannot open its store (a
``data.mdb`` that is no LMDB file, or one cut short), it exits 1 naming the store.
``status`` prints the live figures of a running daemon, ``check`` runs its invariant
checks (exit 1 if one fails), ``reload`` makes it re-read the ``[auth]`` section of its
configuration file (as SIGHUP does). ``keygen`` writes a CURVE key pair (``<stem>.key``, ``<stem>.key_secret`` mode
0600). The client commands find the daemon by ``--endpoint``, else by the socket of
``--config``, else of ``/etc/hicache/hicache.toml`` where there is one (the unit's: a
shell has no ``RUNTIME_DIRECTORY``), else of the embedded defaults. They take
``--server-key`` / ``--key-file`` (or ``HICACHE_SERVER_KEY`` /
``HICACHE_CLIENT_KEY_FILE``) for a CURVE endpoint. This is the only place that
configures logging.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from hicache import __version__


SYSTEM_CONFIG = Path("/etc/hicache/hicache.toml")  # where systemd/hicache.service reads it


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return args.endpoint
    from hicache.config import DaemonConfig

    path = args.config or (SYSTEM_CONFIG if SYSTEM_CONFIG.is_file() else None)
    config = DaemonConfig.load(path) if path else DaemonConfig()
    return config.server.endpoints[0]


def _raise_fd_limit() -> None:
    """The daemon holds descriptors per engine (its pool, its counter ring, offers and
    rings waiting to be fetched, connections): the soft limit a shell hands down (often
    1,024) goes up to the hard one, which only the administrator sets (the unit's
    ``LimitNOFILE=``)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # over the kernel's nr_open: keep the soft limit
            pass


def _serve(args: argparse.Namespace) -> int:
    from hicache.config import DaemonConfig
    from hicache.daemon.server import CannotListen, Server
    from hicache.daemon.statelock import AlreadyRunning

    overrides = {}
    if args.socket:
        overrides["server.socket"] = args.socket
    if args.tcp:
        overrides["server.tcp"] = args.tcp
    if args.no_disk:
        overrides["disk.enabled"] = False
    from hicache.errors import HicacheError, InvalidArgument

    try:
        config = DaemonConfig.load(args.config, overrides)
        _raise_fd_limit()
        server = Server(config, config_path=args.config)
    except AlreadyRunning as exc:
        print(f"hicache: {exc}; not starting", file=sys.stderr)
        return 1
    except InvalidArgument as exc:  # the configuration, or a key file it names
        print(f"hicache: {exc.message}; not starting", file=sys.stderr)
        return 2
    except HicacheError as exc:  # a store it cannot open (damaged), a remote tier that refuses it
        print(f"hicache: {exc.message}; not starting", file=sys.stderr)
        return 1
    try:
        endpoints = server.bind()
    except CannotListen as exc:  # another process has the port: as AlreadyRunning, exit 1
        print(f"hicache: {exc}; not starting", file=sys.stderr)
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    signal.signal(signal.SIGHUP, lambda *_: server.request_reload())
    metrics = f", metrics on {server.metrics_url}" if server.metrics_url else ""
    print(f"hicache {__version__} serving on {' '.join(endpoints)}{metrics}", flush=True)
    server.serve_forever()
    if server.unfinished:
        # Threads stuck in a transfer (a storage that hangs) would hold the interpreter's
        # exit, which joins its worker threads: exit now, what they held is lost (logged).
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


def _status(args: argparse.Namespace) -> int:
    from hicache.errors import HicacheError

    client = _client(args)
    try:
        shown = 0
        while True:
            try:
                stats = client.stats()
            except HicacheError as exc:  # (refused: an identity that is no administrator; no daemon; ...)
                print(f"hicache: {exc}", file=sys.stderr)
                return 1
            if args.watch:
                print("\033[H\033[2J", end="")  # clear the terminal
            _print_status(stats, args.json)
            shown += 1
            if not args.watch or (args.count and shown >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _print_status(stats: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(stats, indent=2, default=str), flush=True)
        return
    requests = stats["requests"]
    matches = sum(n for key, n in requests.items() if key.startswith("match"))
    errors = sum(n for key, n in requests.items() if not key.endswith("/OK"))
    print(f"hicache {stats['version']}: up {stats['uptime_s']:.0f} s, {stats['sessions']} sessions"
          f"{', draining' if stats['draining'] else ''}; {sum(requests.values())} requests "
          f"({matches} matches, {errors} errors)")
    for fingerprint, spec in stats["specs"].items():
        print(f"spec {fingerprint[:12]}: {spec['nodes']} nodes")
        for tier, account in spec.items():
            if isinstance(account, dict):
                print(f"  {tier:10} " + "  ".join(f"{k} {v}" for k, v in account.items()))
    for tenant, figures in sorted(stats.get("tenants", {}).items()):
        print(f"tenant {tenant}: {figures['host_pages']} host pages, {figures['disk_pages']} disk pages")
    storage = stats.get("storage")
    if storage:
        print(f"disk: {storage['records']} records, {storage['bytes'] / 2**20:.1f} MiB of "
              f"{storage['capacity_bytes'] / 2**20:.0f} MiB, {storage['corrupt_records']} corrupt")
    losses = stats.get("losses")
    if losses is not None:  # (absent from an older daemon's)
        print(f"losses: {_losses(losses)}")
    sys.stdout.flush()


def _losses(losses: dict) -> str:
    """The losses that are not zero, on one line ("none" when all are)."""
    parts = []
    for key, name in (("pages_dropped", "pages dropped from the cache"),
                      ("transfer_failed_pages", "pages of failed transfers")):
        shown = ", ".join(f"{label} {n}" for label, n in losses[key].items() if n)
        if shown:
            parts.append(f"{name}: {shown}")
    for key, name in (("remote_put_skipped_pages", "pages the remote tier never got"),
                      ("sessions_expired", "sessions expired"), ("kv_events_dropped", "KV events dropped"),
                      ("checkpoints_lost", "checkpoints lost")):
        if losses.get(key):
            parts.append(f"{name} {losses[key]}")
    return "; ".join(parts) or "none"


def _check(args: argparse.Namespace) -> int:
    from hicache.errors import HicacheError

    client = _client(args)
    try:
        client.check()
    except HicacheError as exc:
        print(f"hicache check: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print("hicache check: ok")
    return 0


def _client(args: argparse.Namespace):
    from hicache.client import CacheClient
    from hicache.errors import InvalidArgument

    try:
        return CacheClient(_endpoint(args), timeout_s=args.timeout, heartbeat=False,
                           server_key=args.server_key, key_file=args.key_file)
    except InvalidArgument as exc:
        raise SystemExit(f"hicache {args.command}: {exc.message}") from None


def _reload(args: argparse.Namespace) -> int:
    from hicache.errors import HicacheError

    client = _client(args)
    try:
        figures = client.reload()
    except HicacheError as exc:
        print(f"hicache reload: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"hicache reload: {figures['identities']} identities, {figures['sessions_ended']} sessions ended")
    return 0


def _purge(args: argparse.Namespace) -> int:
    """Purge until nothing of the tenant is left or ``--wait`` has passed (what a lock
    or a transfer holds goes once it is let go; the remote tier's store is asked again
    while it was down)."""
    import time

    from hicache.errors import HicacheError

    client = _client(args)
    totals: dict[str, int] = {}
    deadline = time.monotonic() + args.wait
    try:
        while True:
            figures = client.purge(args.tenant, args.extra_key)
            for key, value in figures.items():
                totals[key] = (value if key in ("namespaces", "left_pages", "remote_left_namespaces")
                               else totals.get(key, 0) + value)
            left = figures["left_pages"] or figures.get("remote_left_namespaces", 0)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    except HicacheError as exc:
        print(f"hicache purge: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    what = f"tenant {args.tenant!r}" + ("" if args.extra_key is None else f", extra key {args.extra_key!r}")
    print(f"hicache purge: {what}: {totals['namespaces']} namespaces; pages dropped: {totals['device_pages']} device, "
          f"{totals['host_pages']} host, {totals['disk_pages']} disk, {totals['remote_pages']} from the remote "
          f"store; {totals['left_pages']} left" + (f"; {totals['remote_left_namespaces']} namespaces not purged from "
                                                  "the remote store (down)" if totals.get("remote_left_namespaces")
                                                  else ""))
    return 0 if not totals["left_pages"] and not totals.get("remote_left_namespaces") else 2


def _keygen(args: argparse.Namespace) -> int:
    from hicache.auth import write_keypair
    from hicache.errors import InvalidArgument

    try:
        public, secret = write_keypair(args.stem)
    except (InvalidArgument, OSError) as exc:
        print(f"hicache keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public} (list it in [[auth.identities]], or give it to clients as the server key)\n"
          f"secret key: {secret} (mode 0600: keep it with the process it identifies)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hicache.daemon.demo import run
    from hicache.errors import HicacheError

    try:
        return run(args.endpoint, args.conversations, args.turns, args.seed)
    except HicacheError as exc:  # (no daemon at --endpoint, or it refused the demo's engine)
        print(f"\nhicache demo: {exc}", file=sys.stderr)
        return 1


def _log_level(text: str) -> str:
    if not isinstance(logging.getLevelName(text.upper()), int):  # (a name it knows maps to its number)
        raise argparse.ArgumentTypeError(f"unknown level {text!r}: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return text.upper()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description="hierarchical KV-cache tier daemon")
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    parser.add_argument("--log-level", default="INFO", type=_log_level, help="DEBUG, INFO, WARNING, ...")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", help="TOML configuration file")
    serve.add_argument("--socket", help="ipc socket path (overrides [server].socket)")
    serve.add_argument("--tcp", help="also listen on this tcp:// endpoint")
    serve.add_argument("--no-disk", action="store_true", help="no disk tier")
    serve.set_defaults(run=_serve)

    for name, run, text in (("status", _status, "live figures of a running daemon"),
                            ("check", _check, "run a running daemon's invariant checks"),
                            ("reload", _reload, "make a running daemon re-read its [auth] section"),
                            ("purge", _purge, "forget a tenant's cached pages (or one extra key's of it)")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config", help=f"TOML configuration file, to find the socket (default: {SYSTEM_CONFIG} "
                                          "if there is one, else the embedded defaults)")
        sub.add_argument("--endpoint", help="e.g. ipc:///run/hicache/hicache.sock")
        sub.add_argument("--timeout", type=_seconds, default=5.0)
        sub.add_argument("--server-key", help="the daemon's public key (Z85) or its .key file: CURVE")
        sub.add_argument("--key-file", help="this client's .key_secret file (with --server-key)")
        if name == "purge":
            sub.add_argument("--tenant", required=True)
            sub.add_argument("--extra-key", help="only this extra key's namespace (a cache salt, a LoRA's name)")
            sub.add_argument("--wait", type=_seconds, default=30.0,
                             help="purge again until nothing is left (pages held by a lock) or this long")
        if name == "status":
            sub.add_argument("--json", action="store_true")
            sub.add_argument("--watch", type=_seconds, nargs="?", const=2.0, default=0.0, metavar="SECONDS",
                             help="refresh every SECONDS (default 2) until Ctrl-C")
            sub.add_argument("--count", type=int, default=0, help="with --watch: stop after this many")
        sub.set_defaults(run=run)

    keygen = commands.add_parser("keygen", help="write a CURVE key pair")
    keygen.add_argument("stem", help="writes STEM.key (public) and STEM.key_secret (0600)")
    keygen.set_defaults(run=_keygen)

    demo = commands.add_parser("demo", help="the reference engine on a multi-turn chat, through a daemon")
    demo.add_argument("--endpoint", help="use this running daemon instead of starting one")
    demo.add_argument("--conversations", type=int, default=4)
    demo.add_argument("--turns", type=int, default=5)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)
