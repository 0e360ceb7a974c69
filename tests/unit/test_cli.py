import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_util import HICACHE, ClientEngine, DaemonProcess, run_hicache
from hicache import __version__
from hicache.daemon.cli import main


def run_side_by_side(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Run independent commands at once, each to its end: every one is an interpreter
    importing torch and the client, ~2 s of a core, and there are two cores. (For the
    console script as installed, imports and all; the other tests here fork theirs from
    the daemons' zygote: :func:`daemon_util.run_hicache`.)"""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "hicache"
    assert exe.exists(), "make test installs the package, console script included"
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"hicache {__version__}"


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_status_and_check_against_a_running_daemon(tmp_path):
    daemon = DaemonProcess(tmp_path).start()
    engine = ClientEngine(daemon.endpoint)
    try:
        engine.prefill(list(range(100, 100 + 3 * 4)))
        engine.client.flush()  # (its pages on host and disk)
        run = [HICACHE, "--log-level", "WARNING"]
        as_json, as_text, watched, checked = run_side_by_side(
            [*run, "status", "--endpoint", daemon.endpoint, "--json"],
            [*run, "status", "--endpoint", daemon.endpoint],
            [*run, "status", "--endpoint", daemon.endpoint, "--watch", "0.05", "--count", "3"],
            [*run, "check", "--endpoint", daemon.endpoint])
        assert as_json.returncode == 0, as_json.stderr
        stats = json.loads(as_json.stdout)
        assert stats["sessions"] == 1 and stats["version"] == __version__
        (spec,) = stats["specs"].values()
        assert spec["nodes"] == 1
        assert as_text.returncode == 0 and "1 sessions" in as_text.stdout
        assert "tenant default: 3 host pages, 3 disk pages" in as_text.stdout, as_text.stdout
        assert "losses: none" in as_text.stdout, as_text.stdout
        assert watched.returncode == 0 and watched.stdout.count("1 sessions") == 3
        assert checked.returncode == 0 and "ok" in checked.stdout
    finally:
        engine.close()
        assert daemon.stop() == 0
    done = subprocess.run([HICACHE, "status", "--endpoint", daemon.endpoint, "--timeout", "0.3"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "no answer" in done.stderr


def test_status_shows_what_the_daemon_lost_on_one_line(capsys):
    """``hicache status`` names each loss ``stats`` reports that is not zero; an older
    daemon, which reports none, gets no such line."""
    from hicache.daemon.cli import _print_status

    stats = {"version": __version__, "uptime_s": 5.0, "sessions": 0, "draining": False, "requests": {}, "specs": {},
             "losses": {"pages_dropped": {"device": 0, "host": 3, "disk": 2},
                        "transfer_failed_pages": {"d2h": 0, "host_to_disk": 4}, "remote_put_skipped_pages": 0,
                        "sessions_expired": 1, "kv_events_dropped": 7, "checkpoints_lost": 0}}
    _print_status(stats, as_json=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("losses:")]
    assert lines == ["losses: pages dropped from the cache: host 3, disk 2; pages of failed transfers: "
                     "host_to_disk 4; sessions expired 1; KV events dropped 7"]
    del stats["losses"]
    _print_status(stats, as_json=False)
    assert "losses" not in capsys.readouterr().out


def test_serve_refuses_a_tcp_endpoint_without_curve_and_a_secret_readable_by_others(tmp_path):
    from daemon_util import write_config
    from hicache.auth import write_keypair

    config = write_config(tmp_path, server={"tcp": "tcp://127.0.0.1:0"})
    (done,) = run_hicache([HICACHE, "serve", "--config", str(config)])
    assert done.returncode == 2 and "needs CURVE" in done.stderr, done.stderr
    _, secret = write_keypair(tmp_path / "server")
    secret.chmod(0o644)
    config = write_config(tmp_path, server={"tcp": "tcp://127.0.0.1:0"}, auth={"secret_key_file": str(secret)})
    (done,) = run_hicache([HICACHE, "serve", "--config", str(config)])
    assert done.returncode == 2 and "readable by others" in done.stderr, done.stderr
    assert not (tmp_path / "hicache.sock").exists()  # nothing was opened


def test_every_command_the_docs_and_runbooks_name_exists():
    """An operator copies `hicache <command>` from the README, the alerts' runbooks or the
    example config: each must be a command this CLI has."""
    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "dashboards/prometheus/alerts.yml",
            *sorted((root / "systemd").iterdir())]
    named = {(path.name, command) for path in docs for command in re.findall(r"`hicache ([a-z]+)", path.read_text())}
    assert {command for _, command in named} >= {"serve", "status", "check"}  # (the pattern finds them)
    missing = []
    for where, command in sorted(named):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        if exc.value.code != 0:
            missing.append(f"{where}: hicache {command}")
    assert not missing, missing


@pytest.mark.parametrize("taken_by", ["metrics", "tcp"])
def test_serve_on_a_port_in_use_exits_with_a_clear_error(tmp_path, taken_by):
    """Another process on [metrics] port (two daemons on one host with the default 9477)
    or on [server] tcp: one line saying which address, not a traceback, and no socket
    left behind for engines to find."""
    from daemon_util import write_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sections = ({"metrics": {"enabled": True, "address": "127.0.0.1", "port": port}} if taken_by == "metrics"
                    else {"server": {"tcp": f"tcp://127.0.0.1:{port}"}, "auth": {"insecure_tcp": True}})
        config = write_config(tmp_path, **sections)
        (done,) = run_hicache([HICACHE, "serve", "--config", str(config)])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "not starting" in done.stderr, done.stderr
    assert not (tmp_path / "hicache.sock").exists()


def test_reload_refuses_what_only_a_restart_applies(tmp_path):
    """The sockets took the daemon's key pair and ``curve_ipc`` when they were bound: a
    reload that changes either cannot apply it, and says so (exit 1) rather than answer
    success while plain ipc:// clients keep getting in. The identities stay in force."""
    from daemon_util import DaemonProcess
    from hicache.auth import write_keypair

    _, secret = write_keypair(tmp_path / "server")
    _, other = write_keypair(tmp_path / "other")
    daemon = DaemonProcess(tmp_path, auth={"secret_key_file": str(secret)}).start()
    reload = [HICACHE, "--log-level", "WARNING", "reload", "--endpoint", daemon.endpoint]
    try:
        for changed, auth in (("curve_ipc", {"secret_key_file": str(secret), "curve_ipc": True}),
                              ("secret_key_file", {"secret_key_file": str(other)})):
            daemon.rewrite(auth=auth)
            (done,) = run_hicache(reload, timeout_s=30)
            assert done.returncode == 1, (changed, done.stdout)
            assert changed in done.stderr and "restart" in done.stderr, done.stderr
        daemon.rewrite(auth={"secret_key_file": str(secret)})  # as started: reloads
        (done,) = run_hicache(reload, timeout_s=30)
        assert done.returncode == 0, done.stderr
    finally:
        assert daemon.stop() == 0


def test_status_refused_to_a_non_administrator_is_one_line(tmp_path):
    """With identities listed, ``stats`` is for administrators: ``hicache status`` run by
    anyone else says so and exits 1, as ``check`` and ``reload`` do, not a traceback."""
    import os

    daemon = DaemonProcess(tmp_path, auth={"identities": [{"name": "me", "uids": [os.getuid()]}]}).start()
    try:
        commands = ("status", "check", "reload")
        runs = run_hicache(*([HICACHE, "--log-level", "WARNING", command, "--endpoint", daemon.endpoint]
                             for command in commands))
        for command, done in zip(commands, runs):
            assert done.returncode == 1, (command, done.stdout)
            assert "Traceback" not in done.stderr and "administrators" in done.stderr, (command, done.stderr)
    finally:
        assert daemon.stop() == 0


def test_client_commands_find_a_system_daemon_by_its_config_file(tmp_path, monkeypatch, capsys):
    """A shell has no RUNTIME_DIRECTORY: without --endpoint or --config, ``status`` reads
    the socket from /etc/hicache/hicache.toml, where the unit's daemon listens."""
    from hicache.daemon import cli

    daemon = DaemonProcess(tmp_path).start()
    try:
        config = tmp_path / "system.toml"
        config.write_text(f'[server]\nsocket = "{daemon.endpoint.removeprefix("ipc://")}"\n')
        monkeypatch.setattr(cli, "SYSTEM_CONFIG", config)
        monkeypatch.chdir(tmp_path)  # (not where the embedded defaults' socket would be)
        assert main(["--log-level", "WARNING", "status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["version"] == __version__
        monkeypatch.setattr(cli, "SYSTEM_CONFIG", tmp_path / "absent.toml")
        from argparse import Namespace

        from hicache.config import DaemonConfig

        assert cli._endpoint(Namespace(endpoint=None, config=None)) == DaemonConfig().server.endpoints[0]
    finally:
        daemon.stop()


@pytest.mark.parametrize("argv, named", [
    (["--log-level", "verbose", "status"], "--log-level"),  # was a ValueError traceback from logging
    (["status", "--watch", "-1"], "--watch"),  # was a ValueError traceback from time.sleep, after one status
    (["status", "--timeout", "-1"], "--timeout"),  # was "no answer ... within -1 s"
    (["check", "--timeout", "0"], "--timeout"),
])
def test_a_bad_option_value_is_a_usage_error(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--endpoint", f"ipc://{tmp_path}/nobody.sock"])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def _run_one_line(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        (done,) = run_hicache([HICACHE, "--log-level", "WARNING", *argv])
        return done
    except subprocess.TimeoutExpired:  # (a hang guard, not a timing assertion)
        pytest.fail(f"hicache {' '.join(argv)} never ended")


@pytest.mark.parametrize("command", ["status", "check", "reload"])
def test_an_endpoint_that_is_not_one_is_one_line(command):
    """``--endpoint /run/hicache/hicache.sock`` (a path, not ipc://...): ZeroMQ refuses
    to connect. It was a traceback, and then the command hung for good (the context
    waited for the socket that failed to connect, never closed)."""
    done = _run_one_line([command, "--endpoint", "bogus"])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "bogus" in done.stderr, done.stderr


def test_demo_against_a_daemon_that_is_not_there_is_one_line(tmp_path):
    done = _run_one_line(["demo", "--endpoint", f"ipc://{tmp_path}/nobody.sock"])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "no answer" in done.stderr, done.stderr


@pytest.mark.parametrize("section, key", [("disk", "path"), ("server", "socket")])
def test_serve_with_a_directory_it_cannot_make_exits_with_a_clear_error(tmp_path, section, key):
    """[disk] path or [server] socket under a regular file (a typo, a mount missing):
    one line naming the key and exit 2, as for any other bad value — it was a
    FileExistsError / NotADirectoryError traceback."""
    from daemon_util import write_config

    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / ("lmdb" if key == "path" else "hicache.sock")
    config = write_config(tmp_path, **{section: {key: str(where)}})
    done = _run_one_line(["serve", "--config", str(config)])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"[{section}].{key}" in done.stderr and "not starting" in done.stderr, done.stderr


def test_serve_on_a_socket_path_too_long_for_a_unix_socket_exits_with_a_clear_error(tmp_path):
    """A Unix socket's path holds at most 107 bytes, and the descriptor socket beside
    it (``<socket>.fds``) is longer still: a deep [server].socket was an OSError
    traceback ("AF_UNIX path too long") from the descriptor exchange."""
    from daemon_util import write_config

    socket_path = tmp_path / ("s" * max(1, 110 - len(str(tmp_path)))) / "hicache.sock"
    config = write_config(tmp_path, server={"socket": str(socket_path)})
    done = _run_one_line(["serve", "--config", str(config)])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "[server].socket" in done.stderr and "not starting" in done.stderr, done.stderr
    assert not socket_path.exists()


@pytest.mark.parametrize("damage", ["not_lmdb", "cut_short"])
def test_serve_on_a_damaged_store_exits_with_a_clear_error(tmp_path, damage):
    """A ``data.mdb`` that is no LMDB file, or one cut short after its meta pages (a
    crash without sync, a copy cut short): the store cannot be opened. One line naming
    the store and exit 1, as for a socket another daemon holds — it was a
    StorageUnavailable traceback — and no socket left for engines to find."""
    import lmdb

    from daemon_util import write_config

    store = tmp_path / "lmdb"
    store.mkdir()
    if damage == "not_lmdb":
        (store / "data.mdb").write_bytes(b"not an LMDB file\n" * 512)
    else:
        env = lmdb.open(str(store), max_dbs=2)
        with env.begin(write=True) as txn:
            for i in range(200):
                txn.put(i.to_bytes(4, "big"), bytes(700))
        page_bytes = env.stat()["psize"]
        env.close()
        os.truncate(store / "data.mdb", 2 * page_bytes)  # the two meta pages only
    config = write_config(tmp_path)
    done = _run_one_line(["serve", "--config", str(config)])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert str(store) in done.stderr and "not starting" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "hicache.sock").exists()
