"""The deployment of systemd/hicache.service, for real: the daemon runs as one user, the
engines as another user in the daemon's group (both created here), with the unit's
directory modes and umask. A full engine lifecycle succeeds, the files have the modes
README's Security section states, a user outside the group cannot reach the socket, and
a pool offered by one user cannot be registered by another."""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from daemon_util import write_config

AS_USER = str(Path(__file__).with_name("as_user.py"))
TIMEOUT_S = 120


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)


@pytest.fixture
def accounts():
    """A group and three users: the daemon's (group primary), an engine's (group
    supplementary), and an outsider. Removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating users and switching to them needs root")
    tools = {name: _tool(name) for name in ("useradd", "groupadd", "userdel", "groupdel")}
    if not all(tools.values()):
        pytest.skip(f"no {', '.join(n for n, t in tools.items() if not t)} to create test users with")
    suffix = secrets.token_hex(3)
    group, names = f"hct{suffix}", {role: f"hct{role[0]}{suffix}" for role in ("daemon", "engine", "outsider")}
    made: list[tuple[str, str]] = []
    try:
        subprocess.run([tools["groupadd"], "--system", group], check=True)
        made.append(("groupdel", group))
        for role, name in names.items():
            args = [tools["useradd"], "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
            args += ["--gid", group] if role == "daemon" else (["--groups", group] if role == "engine" else [])
            subprocess.run(args + [name], check=True)
            made.insert(0, ("userdel", name))
        yield {"group": grp.getgrnam(group).gr_gid,
               **{role: pwd.getpwnam(name) for role, name in names.items()}}
    finally:
        for tool, name in made:
            subprocess.run([tools[tool], name], check=False)


def _owner(path: Path) -> int | None:
    try:
        return path.lstat().st_uid
    except FileNotFoundError:  # (gone meanwhile)
        return None


def _as(user: pwd.struct_passwd, umask: str, *args: str, **popen) -> subprocess.Popen:
    groups = ",".join(str(g) for g in os.getgrouplist(user.pw_name, user.pw_gid))
    return subprocess.Popen([sys.executable, AS_USER, str(user.pw_uid), str(user.pw_gid), groups, umask, *args],
                            **popen)


def _run_as(user, *args) -> dict:
    proc = _as(user, "0022", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _mode(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_daemon_and_engines_as_different_users_sharing_a_group(accounts):
    daemon_user, engine_user, gid = accounts["daemon"], accounts["engine"], accounts["group"]
    root = Path(tempfile.mkdtemp(prefix="hicache-multiuser-", dir="/tmp"))
    os.chmod(root, 0o755)
    run, state = root / "run", root / "state"
    # What systemd makes of RuntimeDirectory= / StateDirectory= (modes from the unit).
    run.mkdir(mode=0o750)
    state.mkdir(mode=0o700)
    os.chown(run, daemon_user.pw_uid, gid)
    os.chown(state, daemon_user.pw_uid, daemon_user.pw_gid)
    config = write_config(root, server={"socket": str(run / "hicache.sock")},
                          disk={"path": str(state / "lmdb")})
    shm_before = set(os.listdir("/dev/shm"))
    endpoint = f"ipc://{run / 'hicache.sock'}"
    log = open(root / "daemon.log", "wb")
    daemon = _as(daemon_user, "0007", "daemon", str(config), stdout=log, stderr=subprocess.STDOUT,
                 env={**os.environ, "HICACHE_HOME": str(state)})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run / "hicache.sock").exists():
            assert daemon.poll() is None, (root / "daemon.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not bind"
            time.sleep(0.05)
        result = _run_as(engine_user, "engine", endpoint)
        assert result == {"first_hit": 0, "second_hit": 5 * 4, "sessions": 1, "degraded": False, "inserted": 5}
        # The files, as the README's Security section says.
        assert _mode(run / "hicache.sock") == (0o660, daemon_user.pw_uid, gid)
        assert _mode(run / "hicache.sock.fds") == (0o660, daemon_user.pw_uid, gid)
        assert _mode(run / "hicache.sock.lock")[:2] == (0o600, daemon_user.pw_uid)
        assert _mode(state / "lmdb")[:2] == (0o700, daemon_user.pw_uid)
        for name in ("data.mdb", "lock.mdb", "hicache.lock"):
            assert _mode(state / "lmdb" / name)[:2] == (0o600, daemon_user.pw_uid), name
        # Pools and rings are memfds: nothing of the daemon's or the engine's in /dev/shm
        # (other processes' come and go meanwhile: multiprocessing's semaphores).
        users = {daemon_user.pw_uid, engine_user.pw_uid}
        assert not {name for name in set(os.listdir("/dev/shm")) - shm_before
                    if _owner(Path("/dev/shm") / name) in users}
        # Outside the group, the socket is out of reach. (That process runs while the
        # daemon's user offers a pool: two interpreters starting, one core each.)
        outsider = _as(accounts["outsider"], "0022", "engine", endpoint, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
        try:
            offered = _run_as(daemon_user, "offer", endpoint)
        finally:
            _, err = outsider.communicate(timeout=TIMEOUT_S)
        assert outsider.returncode != 0 and ("Permission denied" in err or "Unavailable" in err), err[-2000:]
        # An offer is its user's: registered by another user's session, it is refused.
        refused = _run_as(engine_user, "register_foreign", endpoint, offered["token"])
        assert refused["reply"] == "Error" and refused["code"] == 2 and "offered by uid" in refused["message"]
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(TIMEOUT_S)
        log.close()
        text = (root / "daemon.log").read_text()
        shutil.rmtree(root, ignore_errors=True)
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
