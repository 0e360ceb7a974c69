"""Run the daemon or an engine as another Unix user (for test_multiuser.py).

    python as_user.py UID GID GROUPS UMASK daemon CONFIG
    python as_user.py UID GID GROUPS UMASK engine ENDPOINT
    python as_user.py UID GID GROUPS UMASK offer ENDPOINT

Started as root: everything it will need is imported first (the interpreter and the
checkout may live where the target user cannot look, e.g. under /root or in a 0700
temporary directory), then it drops to UID / GID / GROUPS (comma-separated, may be
empty) with UMASK, the way systemd's User= / Group= / SupplementaryGroups= / UMask=
start the unit, and runs its role. What the roles import only once running was listed
by running them with AS_USER_IMPORTS=<file> (an audit hook writes each import made
after the drop there): keep the list below in step with it.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/


import lmdb._envid  # noqa: E402,F401  (imported by lmdb.open)
import numpy.ma  # noqa: E402,F401
import numpy.random  # noqa: E402,F401  (the test engine's page bytes)

import hicache.client  # noqa: E402,F401
import hicache.daemon.cli  # noqa: E402
import hicache.daemon.server  # noqa: E402,F401
import hicache.storage.lmdb_backend  # noqa: E402,F401
from daemon_util import ClientEngine, RawPeer  # noqa: E402
from hicache import fdpass  # noqa: E402
from tiers_util import SPEC, Engine  # noqa: E402


def drop(uid: int, gid: int, groups: list[int], umask: int) -> None:
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    os.umask(umask)
    os.environ["HOME"] = os.environ.get("HICACHE_TEST_HOME", "/")


def engine(endpoint: str) -> dict:
    """A full lifecycle twice (the second hits), every page checked byte for byte."""
    seq = list(range(300, 300 + 5 * SPEC.page_size))
    e = ClientEngine(endpoint)
    try:
        first, _, inserted = e.prefill(seq)
        e.client.flush()
        again, loaded, _ = e.prefill(seq + list(range(9000, 9000 + SPEC.page_size)))
        e.client.check()
        stats = e.client.stats()
        return {"first_hit": first.num_tokens, "second_hit": again.num_tokens, "sessions": stats["sessions"],
                "degraded": e.client.degraded, "inserted": len(inserted.device_pages)}
    finally:
        e.close()


def offer(endpoint: str) -> dict:
    """Offer this user's pool and say under which token (another user will try it)."""
    e = Engine(8)
    token = fdpass.offer(fdpass.socket_path_for(endpoint[len("ipc://"):]), e.exported.handle.fd)
    return {"token": token.hex(), "handle": {k: v for k, v in e.exported.handle.to_dict().items() if k != "token"}}


def register_foreign(endpoint: str, token_hex: str) -> dict:
    """Register a pool under a token another user's offer was made with."""
    e = Engine(8)
    raw = RawPeer(endpoint)
    try:
        session = raw.hello()
        reply = raw.register(session, [e.exported.handle.to_dict() | {"token": bytes.fromhex(token_hex)}])
        return {"reply": type(reply).__name__, "code": getattr(reply, "code", 0),
                "message": getattr(reply, "message", "")}
    finally:
        raw.close()
        e.close()


def main() -> int:
    uid, gid, groups, umask, role, *args = sys.argv[1:]
    drop(int(uid), int(gid), [int(g) for g in groups.split(",") if g], int(umask, 8))
    if os.environ.get("AS_USER_IMPORTS"):
        import atexit
        seen = []
        sys.addaudithook(lambda event, a: event == "import" and a[0] not in sys.modules and seen.append(a[0]))
        atexit.register(lambda: open(os.environ["AS_USER_IMPORTS"], "a").write("\n".join(seen) + "\n"))
    if role == "daemon":
        return hicache.daemon.cli.main(["--log-level", "INFO", "serve", "--config", args[0]])
    result = {"engine": engine, "offer": offer, "register_foreign": register_foreign}[role](*args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
