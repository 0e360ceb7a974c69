"""The systemd integration: the unit, sysusers and example config under ``systemd/``, and
the sd_notify client (:mod:`hicache.daemon.sd_notify`) driven against a socket we listen on."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hicache.config import DaemonConfig
from hicache.errors import InvalidArgument
from hicache.daemon.sd_notify import Notifier, NullNotifier

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "hicache.service"
SYSUSERS = SYSTEMD / "hicache.sysusers.conf"
EXAMPLE = SYSTEMD / "hicache.toml"


def _unit_directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}`` of a unit file (no line continuations)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"directive outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _seconds(span: str) -> float:
    """A systemd time span such as ``90s``, ``5min`` or ``1min 30s`` (the units we use)."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), span
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return _unit_directives(UNIT)["Service"]


def _one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key, [])
    assert len(values) == 1, f"{key}= should be set once, got {values}"
    return values[0]


def test_unit_passes_systemd_analyze_verify():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    proc = subprocess.run([analyze, "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # Unknown keys and unparsable values are only warnings (exit 0): fail on them too.
    # Lines about other units (a host's own broken units) are not ours to judge.
    assert [line for line in output.splitlines() if "hicache" in line] == []


def test_unit_sandbox_exposure_stays_low():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    if "--offline" not in subprocess.run([analyze, "--help"], capture_output=True, text=True).stdout:
        pytest.skip("this systemd-analyze cannot analyse a unit file offline (systemd < 250)")
    # Exposure on systemd-analyze's 0-100 scale; the unit scores about 21 with systemd 252.
    proc = subprocess.run([analyze, "security", "--offline=yes", "--threshold=30", "--no-pager", str(UNIT)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_unit_has_the_directives_the_daemon_relies_on(service):
    assert _one(service, "Type") == "notify"
    assert _one(service, "NotifyAccess") == "main"
    assert _seconds(_one(service, "WatchdogSec")) > 0
    assert _one(service, "LimitMEMLOCK") == "infinity"
    assert _one(service, "RuntimeDirectory") == "hicache"
    assert _one(service, "StateDirectory") == "hicache"
    assert _one(service, "User") == "hicache"
    assert _one(service, "Group") == "hicache"
    assert _one(service, "Restart") == "on-failure"
    assert _one(service, "ExecStart").endswith("hicache serve --config /etc/hicache/hicache.toml")
    # The drain must finish before systemd sends SIGKILL.
    assert _seconds(_one(service, "TimeoutStopSec")) > DaemonConfig.load(EXAMPLE).server.drain_timeout_s


def test_unit_execstart_names_the_console_script(service):
    program, *args = _one(service, "ExecStart").split()
    assert program == "/usr/bin/env"
    with open(ROOT / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert args[0] in scripts


def test_unit_sandbox_leaves_engines_and_gpus_reachable(service):
    assert _one(service, "ProtectSystem") == "strict"
    assert _one(service, "NoNewPrivileges") == "yes"
    # Nothing the daemon makes is world-readable; the host's /dev, IPC namespace and user
    # ids stay ours (GPUs, CUDA IPC, the pool ownership checks).
    assert _one(service, "UMask") == "0007"
    for absent in ("PrivateDevices", "PrivateIPC", "RemoveIPC", "DynamicUser", "ProcSubset",
                   "MemoryDenyWriteExecute"):
        assert absent not in service, f"{absent}= breaks the daemon (see the comment in the unit)"
    # ProtectClock= adds a DeviceAllow= entry, so the GPU devices must be allowed explicitly.
    if "DeviceAllow" in service or "ProtectClock" in service:
        assert "char-nvidia* rw" in service["DeviceAllow"]
    families = set(_one(service, "RestrictAddressFamilies").split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= families


def test_sysusers_declares_the_service_user(service):
    entries = [line.split() for line in SYSUSERS.read_text().splitlines() if line and not line.startswith("#")]
    assert ["u", _one(service, "User")] in [entry[:2] for entry in entries]


def test_sysusers_dry_run(tmp_path):
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    proc = subprocess.run([sysusers, f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
                          capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Creating group 'hicache'" in output
    assert "Creating user 'hicache'" in output
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_example_config_covers_every_key():
    with open(EXAMPLE, "rb") as f:
        data = tomllib.load(f)
    sections = {f.name: f.default_factory for f in dataclasses.fields(DaemonConfig)}
    assert set(data) == set(sections)
    for name, section_cls in sections.items():
        keys = {f.name for f in dataclasses.fields(section_cls)}
        assert set(data[name]) == keys, f"[{name}] in {EXAMPLE.name} is missing {keys - set(data[name])}"


def test_example_config_explains_every_key():
    lines = [line.strip() for line in EXAMPLE.read_text().splitlines()]
    for i, line in enumerate(lines):
        if re.match(r"^\w+\s*=", line):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_example_config_states_the_defaults_under_the_unit(monkeypatch):
    # What the embedded defaults resolve to with the directories the unit creates.
    directives = _unit_directives(UNIT)["Service"]
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"/run/{_one(directives, 'RuntimeDirectory')}")
    monkeypatch.setenv("STATE_DIRECTORY", f"/var/lib/{_one(directives, 'StateDirectory')}")
    defaults = DaemonConfig.load()
    example = DaemonConfig.load(EXAMPLE)
    assert example.server.socket_path == defaults.server.socket_path == Path("/run/hicache/hicache.sock")
    assert example.disk.store_path == defaults.disk.store_path == Path("/var/lib/hicache/lmdb")
    assert dataclasses.replace(example.server, socket="") == defaults.server
    assert dataclasses.replace(example.disk, path="") == defaults.disk
    for section in ("host", "tiers", "remote", "events", "sharing", "metrics"):
        assert getattr(example, section) == getattr(defaults, section)


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    """A datagram socket standing in for systemd's, and the NOTIFY_SOCKET naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify")
        sock.bind(address)
    else:
        address = f"@hicache-test-{os.getpid()}-{secrets.token_hex(4)}"
        sock.bind("\0" + address[1:])
    sock.settimeout(5)  # a missing datagram fails the test instead of hanging it
    yield sock, address
    sock.close()


def test_notifier_sends_one_datagram_per_call(listener, monkeypatch):
    sock, address = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_env()
    assert type(notifier) is Notifier
    assert notifier.watchdog_interval_s == 15.0

    notifier.ready(status="serving on ipc:///run/hicache/hicache.sock")
    notifier.watchdog()
    notifier.status("2 sessions\nREADY=1")  # a newline must not smuggle in an assignment
    notifier.extend_timeout(90)
    notifier.stopping()
    notifier.stopping(status="draining")

    assert [sock.recv(4096) for _ in range(6)] == [
        b"READY=1\nSTATUS=serving on ipc:///run/hicache/hicache.sock",
        b"WATCHDOG=1",
        b"STATUS=2 sessions READY=1",
        b"EXTEND_TIMEOUT_USEC=90000000",
        b"STOPPING=1",
        b"STOPPING=1\nSTATUS=draining",
    ]


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", "self", 15.0),
        ("30000000", None, 15.0),  # WATCHDOG_PID unset: meant for us
        ("30000000", "other", None),  # inherited from a parent systemd watches
        (None, None, None),
        ("0", None, None),
        ("soon", None, None),
    ],
)
def test_watchdog_interval(monkeypatch, tmp_path, usec, pid, expected):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            own = os.getpid()
            monkeypatch.setenv(name, {"self": str(own), "other": str(own + 1)}.get(value, value))
    assert Notifier.from_env().watchdog_interval_s == expected


def test_no_notify_socket_gives_a_null_notifier(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    notifier = Notifier.from_env()
    assert type(notifier) is NullNotifier
    assert notifier.watchdog_interval_s is None
    notifier.ready(status="serving")
    notifier.status("idle")
    notifier.watchdog()
    notifier.extend_timeout(10)
    notifier.stopping()


def test_unsupported_notify_socket_gives_a_null_notifier(monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    with caplog.at_level(logging.WARNING, logger="hicache.daemon.sd_notify"):
        assert type(Notifier.from_env()) is NullNotifier
    assert "unsupported NOTIFY_SOCKET" in caplog.text


def test_notifier_rejects_an_address_it_cannot_reach():
    with pytest.raises(InvalidArgument):
        Notifier("run/notify")


def test_a_vanished_notify_socket_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    address = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(address))
    monkeypatch.setenv("NOTIFY_SOCKET", str(address))
    notifier = Notifier.from_env()
    sock.close()
    address.unlink()

    with caplog.at_level(logging.WARNING, logger="hicache.daemon.sd_notify"):
        notifier.ready()
        notifier.watchdog()
        notifier.stopping()
    # Warned once for the run of failures, not once per ping.
    assert [r.getMessage().startswith("cannot notify systemd") for r in caplog.records] == [True]

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(address))
        sock.settimeout(5)
        notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_a_full_notify_queue_drops_instead_of_blocking(listener, caplog):
    sock, address = listener
    notifier = Notifier(address)

    def ping() -> None:
        # Nobody reads: more than the kernel queues for an AF_UNIX datagram socket
        # (net.unix.max_dgram_qlen, 512 by default).
        for _ in range(2000):
            notifier.watchdog()

    with caplog.at_level(logging.WARNING, logger="hicache.daemon.sd_notify"):
        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        pinger.join(timeout=30)  # a hang guard, not a timing assertion
    assert not pinger.is_alive(), "the notifier blocked on a full socket"
    assert "cannot notify systemd" in caplog.text
