"""Daemon configuration: one tree of frozen dataclasses, from TOML plus overrides.

Every environment variable hicache reads is read here:

* ``RUNTIME_DIRECTORY`` / ``STATE_DIRECTORY`` — set by systemd for ``RuntimeDirectory=``
  and ``StateDirectory=``; the default socket goes in the first, the LMDB store in the
  second;
* ``HICACHE_HOME`` — where the embedded defaults put both when systemd does not
  (default ``./state``, so ``make run`` works from a checkout).

(systemd's ``NOTIFY_SOCKET`` / ``WATCHDOG_*`` belong to the notify protocol and are read
by :meth:`hicache.daemon.sd_notify.Notifier.from_env`.)

Sections and keys (all optional; see ``systemd/hicache.toml`` for an annotated file)::

    [server]   socket, socket_mode, tcp, max_message_bytes, max_tokens, max_sessions,
               max_batch, lease_s, register_within_s, max_unregistered_per_peer,
               max_specs, max_pool_pages, drain_timeout_s
    [host]     bytes, ratio, max_bytes
    [disk]     enabled, path, capacity_bytes, sync, tenant_namespaces
    [tiers]    write_policy, write_threshold, disk_policy, prefetch_policy,
               prefetch_timeout_s, prefetch_min_pages, counter_slots, eviction,
               copy_threads, io_threads, disk_write_backlog, eviction_log_slots,
               capacity, host_checkpoints
    [remote]   enabled, master, metadata_server, protocol, device_names,
               local_hostname, segment_bytes, buffer_bytes, policy, lookup_pages,
               prefetch_policy, timeout_s, retry_s, write_backlog, miss_ttl_s
    [events]   enabled, endpoint, replay_endpoint, topic, buffer_steps, hwm,
               max_queue_events, insecure_tcp
    [sharing]  enabled, disabled_extra_keys
    [metrics]  enabled, address, port
    [auth]     secret_key_file, curve_ipc, insecure_tcp, default_identity,
               max_sessions_per_identity, [[auth.identities]] (name, public_keys, uids,
               gids, tenants, admin, events, max_locks, max_sessions, requests_per_s,
               host_pages, disk_pages)
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hicache.errors import InvalidArgument
from hicache.pools import MAX_POOL_PAGES
from hicache.tiers.config import TierConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _env_dir(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    # systemd may pass several directories separated by ':'; the first is ours.
    return Path(value.split(":")[0]) if value else default


def _home() -> Path:
    return Path(os.environ.get("HICACHE_HOME", "state"))


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    socket: str = ""  # path of the ipc:// socket; "" = <runtime dir>/hicache.sock
    socket_mode: int = 0o660
    tcp: str = ""  # e.g. "tcp://127.0.0.1:7400"; "" = no TCP endpoint
    max_message_bytes: int = 64 << 20
    max_tokens: int = 1 << 20  # per request
    max_sessions: int = 256
    max_batch: int = 256  # lookups in one batched match
    lease_s: float = 10.0
    register_within_s: float = 5.0  # a session that has not registered by then is ended
    # Sessions one user (ipc://) or address (tcp://; CURVE: an identity at it) may hold unregistered.
    max_unregistered_per_peer: int = 8
    max_specs: int = 64  # KV specs (tier managers) kept at once; see hicache.daemon.specs
    # Pages (and lent checkpoint slots) of one pool of hicache's layout: the daemon keeps
    # ~6 bytes of bookkeeping for each (192 MiB at this bound), sized by the engine's
    # word (a sparse memfd makes any claim free to it). Engine-owned pools keep none.
    max_pool_pages: int = 1 << 25
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _positive(self, "max_message_bytes", "max_tokens", "max_sessions", "max_batch", "lease_s", "drain_timeout_s",
                  "register_within_s", "max_unregistered_per_peer", "max_specs", "max_pool_pages")
        if self.max_pool_pages > MAX_POOL_PAGES:
            raise InvalidArgument(f"[server].max_pool_pages must be at most {MAX_POOL_PAGES} (int32 page ids)")
        if not 0 <= self.socket_mode <= 0o777:  # (chmod'ed after the socket is bound)
            raise InvalidArgument(f"[server].socket_mode must be permission bits 0o000-0o777, got {self.socket_mode:#o}")

    @property
    def socket_path(self) -> Path:
        if self.socket:
            return Path(self.socket)
        return (_env_dir("RUNTIME_DIRECTORY", _home() / "run") / "hicache.sock").absolute()

    @property
    def endpoints(self) -> list[str]:
        endpoints = [f"ipc://{self.socket_path}"]
        if self.tcp:
            endpoints.append(self.tcp)
        return endpoints


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    bytes: int = 0  # host pool per KV spec; 0 = use ratio
    ratio: float = 2.0  # host pages = ratio x the first registered device pool's pages
    max_bytes: int = 0  # every spec's host pool together; 0 = 80 % of the machine's memory

    def __post_init__(self) -> None:
        if self.bytes < 0 or self.max_bytes < 0:
            raise InvalidArgument("[host].bytes and [host].max_bytes must be >= 0")
        if not self.bytes:
            _positive(self, "ratio")

    @property
    def limit_bytes(self) -> int:
        """The host tier's ceiling: a registration that would need more is refused, so
        that an engine's declared pool size cannot make the daemon allocate without end."""
        if self.max_bytes:
            return self.max_bytes
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)


@dataclass(frozen=True, kw_only=True)
class DiskConfig:
    enabled: bool = True
    path: str = ""  # "" = <state dir>/lmdb
    capacity_bytes: int = 64 << 30
    sync: bool = False
    tenant_namespaces: int = 100_000  # namespaces holding pages kept per tenant in the tenant log

    def __post_init__(self) -> None:
        _positive(self, "capacity_bytes", "tenant_namespaces")

    @property
    def store_path(self) -> Path:
        if self.path:
            return Path(self.path)
        return (_env_dir("STATE_DIRECTORY", _home()) / "lmdb").absolute()


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """The remote tier (Mooncake Store): how to join it, and how the tiers use it (see
    :mod:`hicache.tiers.remote` and :mod:`hicache.storage.mooncake_backend`)."""

    enabled: bool = False
    master: str = ""  # the mooncake_master's host:port
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_names: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 0  # memory this daemon contributes to the store
    buffer_bytes: int = 16 << 20
    policy: str = "write_through"
    lookup_pages: int = 256
    prefetch_policy: str = "timeout"
    timeout_s: float = 0.5
    retry_s: float = 2.0
    write_backlog: int = 4096
    miss_ttl_s: float = 1.0

    def __post_init__(self) -> None:
        if self.enabled:
            self.store_config()
        self.settings()

    def store_config(self):
        from hicache.storage.mooncake_backend import MooncakeConfig

        return MooncakeConfig(master=self.master, metadata_server=self.metadata_server, protocol=self.protocol,
                              device_names=self.device_names, local_hostname=self.local_hostname,
                              segment_bytes=self.segment_bytes, buffer_bytes=self.buffer_bytes)

    def settings(self):
        from hicache.tiers.remote import RemoteSettings

        return RemoteSettings(policy=self.policy, lookup_pages=self.lookup_pages,
                              prefetch_policy=self.prefetch_policy, timeout_s=self.timeout_s, retry_s=self.retry_s,
                              write_backlog=self.write_backlog, miss_ttl_s=self.miss_ttl_s)


@dataclass(frozen=True, kw_only=True)
class EventsConfig:
    """KV events for routers (see :mod:`hicache.daemon.kv_events`): a PUB socket and a
    replay ROUTER. They carry every tenant's token ids: their subscribers are admitted as
    the server's peers are, and only identities allowed ``events`` (or ``admin``); a
    ``tcp://`` endpoint takes CURVE (``[auth].secret_key_file``) or, readable by anyone
    who reaches it, ``insecure_tcp = true``. An identity with an ``events_endpoint``
    reads its own tenants' engines' streams on a socket of its own instead."""

    enabled: bool = False
    endpoint: str = ""  # "" = ipc://<the server socket's directory>/hicache-events.sock
    replay_endpoint: str = ""  # "" = ipc://<...>/hicache-events-replay.sock; "none": no replay
    topic: str = ""  # each pool's stream is <topic><pool id>
    buffer_steps: int = 10_000  # batches kept for replay, per stream
    hwm: int = 100_000
    max_queue_events: int = 100_000  # events waiting for the next batch, per stream
    insecure_tcp: bool = False

    def __post_init__(self) -> None:
        _positive(self, "buffer_steps", "hwm", "max_queue_events")
        for endpoint in (self.endpoint, "" if self.replay_endpoint == "none" else self.replay_endpoint):
            if not endpoint:
                continue
            if not endpoint.startswith(("ipc://", "tcp://")):
                raise InvalidArgument(f"[events] endpoints are ipc:// or tcp://, got {endpoint!r}")

    @property
    def uses_tcp(self) -> bool:
        return any(e.startswith("tcp://") for e in (self.endpoint, self.replay_endpoint))

    def endpoints(self, socket_path: Path) -> tuple[str, str | None]:
        """(PUB endpoint, replay endpoint or None), defaults next to the server's socket."""
        here = socket_path.parent
        endpoint = self.endpoint or f"ipc://{here / 'hicache-events.sock'}"
        replay = (None if self.replay_endpoint == "none"
                  else self.replay_endpoint or f"ipc://{here / 'hicache-events-replay.sock'}")
        return endpoint, replay


@dataclass(frozen=True, kw_only=True)
class SharingConfig:
    enabled: bool = True
    disabled_extra_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # (an extra key is a string on the wire: any other value would match none, and
        # the sharing it was meant to turn off would stay on without a word)
        for key in self.disabled_extra_keys:
            if not isinstance(key, str):
                raise InvalidArgument(f"[sharing].disabled_extra_keys must be strings, got {key!r}")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    enabled: bool = True
    address: str = "127.0.0.1"
    port: int = 9477

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:  # (else a traceback from the HTTP server's bind)
            raise InvalidArgument(f"[metrics].port must be 0-65535, got {self.port}")


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
DEFAULT_TENANT = "default"  # its namespaces are those of a daemon without [auth] (a cache survives turning it on)


def check_name(what: str, name: str) -> str:
    """Identity and tenant names: 1-64 of ``[A-Za-z0-9._-]`` (they are metric labels)."""
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= _NAME_CHARS:
        raise InvalidArgument(f"{what} {name!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    return name


@dataclass(frozen=True, kw_only=True)
class IdentityConfig:
    """A client the daemon knows: by CURVE public key (Z85, 40 characters) and / or,
    on ``ipc://`` without CURVE, by Unix user or group; the tenants it may use (the
    first is its default) and its quotas (0: none)."""

    name: str
    public_keys: tuple[str, ...] = ()
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    tenants: tuple[str, ...] = (DEFAULT_TENANT,)
    admin: bool = False  # may call stats, flush, check and reload (and read the KV events)
    events: bool = False  # may subscribe to the KV events: every tenant's token ids (routers)
    # Its own KV events: the streams of its tenants' engines only, published on this
    # endpoint (ipc:// or tcp://, CURVE on tcp://) for this identity alone; "": none.
    events_endpoint: str = ""
    max_locks: int = 0  # node locks its sessions hold together
    max_sessions: int = 0  # sessions (each with its pool) its clients hold together; 0: [auth]'s default
    requests_per_s: float = 0.0  # sustained; bursts of up to one second's worth
    host_pages: int = 0  # host pages its tenants may hold together (per KV spec)
    disk_pages: int = 0  # disk pages likewise

    def __post_init__(self) -> None:
        check_name("identity", self.name)
        if not self.tenants:
            raise InvalidArgument(f"identity {self.name!r} needs at least one tenant")
        for tenant in self.tenants:
            check_name("tenant", tenant)
        for key in self.public_keys:
            if not isinstance(key, str) or len(key) != 40:
                raise InvalidArgument(f"identity {self.name!r}: a public key is 40 Z85 characters, got {key!r}")
        for value in (*self.uids, *self.gids):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"identity {self.name!r}: uids and gids are non-negative integers")
        for limit in ("max_locks", "max_sessions", "requests_per_s", "host_pages", "disk_pages"):
            if getattr(self, limit) < 0:
                raise InvalidArgument(f"identity {self.name!r}: {limit} must be >= 0 (0: no limit)")
        if self.events_endpoint and not self.events_endpoint.startswith(("ipc://", "tcp://")):
            raise InvalidArgument(f"identity {self.name!r}: events_endpoint is ipc:// or tcp://, "
                                  f"got {self.events_endpoint!r}")


@dataclass(frozen=True, kw_only=True)
class AuthConfig:
    secret_key_file: str = ""  # the daemon's CURVE key pair (``hicache keygen``): CURVE on tcp://
    curve_ipc: bool = False  # CURVE on ipc:// too (else its peers are known by Unix user)
    insecure_tcp: bool = False  # allow tcp:// without CURVE: any peer that reaches it is default_identity
    # Peers no identity names; "" = refuse them. The built-in "default" (tenant "default") is
    # an administrator only while no identities are listed.
    default_identity: str = DEFAULT_TENANT
    # Sessions one identity may hold together, unless it says (its max_sessions): so that no
    # identity takes all of [server].max_sessions. Only with identities listed (without, the
    # default identity is every client, and max_sessions its limit).
    max_sessions_per_identity: int = 64
    identities: tuple[IdentityConfig, ...] = ()

    def __post_init__(self) -> None:
        _positive(self, "max_sessions_per_identity")
        names = [identity.name for identity in self.identities]
        if len(set(names)) != len(names):
            raise InvalidArgument("[[auth.identities]] names must be unique")
        keys = [key for identity in self.identities for key in identity.public_keys]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("a public key belongs to one identity only")
        own = [identity.events_endpoint for identity in self.identities if identity.events_endpoint]
        if len(set(own)) != len(own):
            raise InvalidArgument("an events_endpoint belongs to one identity only")
        if self.default_identity:
            check_name("identity", self.default_identity)

    @property
    def curve(self) -> bool:
        return bool(self.secret_key_file)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    sharing: SharingConfig = field(default_factory=SharingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)

    def __post_init__(self) -> None:
        if self.server.tcp and not (self.auth.curve or self.auth.insecure_tcp):
            raise InvalidArgument("a tcp:// endpoint needs CURVE ([auth].secret_key_file, from `hicache keygen`) "
                                  "or, on a network you trust, [auth].insecure_tcp = true")
        if self.auth.curve_ipc and not self.auth.curve:
            raise InvalidArgument("[auth].curve_ipc needs [auth].secret_key_file")
        if self.events.uses_tcp and not (self.auth.curve or self.events.insecure_tcp):
            raise InvalidArgument("[events] on tcp:// needs CURVE ([auth].secret_key_file) or, since it then sends "
                                  "token ids in the clear to whoever reaches it, [events].insecure_tcp = true")
        for identity in self.auth.identities:
            own = identity.events_endpoint
            if own and not self.events.enabled:
                raise InvalidArgument(f"identity {identity.name!r}: an events_endpoint needs the KV events "
                                      "([events] enabled = true)")
            if own.startswith("tcp://") and not self.auth.curve:
                raise InvalidArgument(f"identity {identity.name!r}: an events_endpoint on tcp:// needs CURVE "
                                      "([auth].secret_key_file): its subscribers are told apart by their keys")
            if own and own in (*self.events.endpoints(self.server.socket_path), *self.server.endpoints):
                raise InvalidArgument(f"identity {identity.name!r}: events_endpoint {own!r} is taken by the daemon")

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None) -> "DaemonConfig":
        """Embedded defaults, then the TOML file (if any), then ``overrides``
        (``{"section.key": value}``)."""
        data: dict[str, dict[str, Any]] = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except OSError as exc:
                raise InvalidArgument(f"cannot read config {path}: {exc}") from None
            except tomllib.TOMLDecodeError as exc:
                raise InvalidArgument(f"bad TOML in {path}: {exc}") from None
        for dotted, value in (overrides or {}).items():
            section, _, key = dotted.partition(".")
            data.setdefault(section, {})[key] = value
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DaemonConfig":
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise InvalidArgument(f"unknown config sections: {', '.join(sorted(unknown))}")
        built = {}
        for name, value in data.items():
            if not isinstance(value, Mapping):
                raise InvalidArgument(f"config section [{name}] must be a table")
            built[name] = _build(sections[name].default_factory, name, value)  # type: ignore[misc]
        return cls(**built)


def _positive(section: Any, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise InvalidArgument(f"{type(section).__name__}.{name} must be positive")


def _build(section_cls: type, name: str, values: Mapping[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise InvalidArgument(f"unknown keys in [{name}]: {', '.join(sorted(unknown))}")
    defaults = section_cls(name="x") if section_cls is IdentityConfig else section_cls()
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if section_cls is AuthConfig and key == "identities":
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise InvalidArgument("[[auth.identities]] must be an array of tables")
            kwargs[key] = tuple(_build(IdentityConfig, f"auth.identities.{i}", v) for i, v in enumerate(value))
            continue
        if section_cls is IdentityConfig and key == "name":
            kwargs[key] = value
            continue
        expected = type(getattr(defaults, key))
        if key == "socket_mode" and isinstance(value, str):
            try:
                value = int(value, 8)
            except ValueError:
                raise InvalidArgument(f"[{name}].{key} must be an octal mode like \"0660\"") from None
        if expected is tuple and isinstance(value, list):
            value = tuple(value)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise InvalidArgument(
                f"[{name}].{key} must be {expected.__name__}, got {type(value).__name__} {value!r}"
            )
        # TOML has nan and inf, which every "must be positive" check lets through (no
        # comparison with nan holds): a lease of nan never ends, a drain of inf cannot
        # be told to systemd. No setting means anything by them.
        if expected is float and not math.isfinite(value):
            raise InvalidArgument(f"[{name}].{key} must be a finite number, got {value!r}")
        kwargs[key] = value
    try:
        return section_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad [{name}]: {exc}") from None
