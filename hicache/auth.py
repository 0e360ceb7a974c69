"""CURVE key pairs and a client's credentials.

``hicache keygen NAME`` writes ``NAME.key`` (the public key, to list in the daemon's
``[[auth.identities]]`` or to hand to clients as the server key) and ``NAME.key_secret``
(both keys, mode 0600), in ZeroMQ's certificate format, so that libzmq's and pyzmq's
tools read them too. A key is 40 characters of Z85 (32 bytes).

A client's credentials come from its arguments, else from the environment:

* ``HICACHE_SERVER_KEY`` — the daemon's public key (Z85), or a file holding it;
* ``HICACHE_CLIENT_KEY_FILE`` — the client's ``.key_secret`` file;
* ``HICACHE_TENANT`` — the tenant its requests name (default: its identity's first).

With a server key, every connection the client makes uses CURVE (and fails to get any
answer from a daemon that does not list the client's key).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85 as z85

from hicache.errors import InvalidArgument

KEY_CHARS = 40


def check_key(key: str | bytes, what: str = "key") -> bytes:
    """A Z85 key as bytes, or :class:`InvalidArgument`."""
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    raw = raw.strip()
    if len(raw) != KEY_CHARS:
        raise InvalidArgument(f"{what} must be {KEY_CHARS} Z85 characters, got {len(raw)}")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, IndexError, TypeError):
        raise InvalidArgument(f"{what} is not Z85") from None
    return raw


def write_keypair(stem: str | os.PathLike) -> tuple[Path, Path]:
    """A new key pair: ``<stem>.key`` (public, 0644) and ``<stem>.key_secret`` (0600).
    Refuses to overwrite either."""
    public, secret = zmq.curve_keypair()
    stem = Path(stem)
    public_path, secret_path = stem.with_name(stem.name + ".key"), stem.with_name(stem.name + ".key_secret")
    for path in (public_path, secret_path):
        if path.exists():
            raise InvalidArgument(f"{path} exists; not overwriting a key")
    header = "#   ZeroMQ CURVE certificate written by hicache keygen\n"
    _write(secret_path, f"{header}#   THIS FILE IS SECRET\ncurve\n"
                        f"    public-key = \"{public.decode()}\"\n    secret-key = \"{secret.decode()}\"\n", 0o600)
    _write(public_path, f"{header}curve\n    public-key = \"{public.decode()}\"\n", 0o644)
    return public_path, secret_path


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # whatever the umask


def read_public(path: str | os.PathLike) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read a public key from {path}: {exc}") from None
    return check_key(public, f"the public key in {path}")


def read_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a ``.key_secret`` file, which must not be readable by
    others (like ssh, refuse a secret anyone can read)."""
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read a key pair from {path}: {exc}") from None
    if mode & 0o077:
        raise InvalidArgument(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    if secret is None:
        raise InvalidArgument(f"{path} holds no secret key")
    public, secret = check_key(public, f"the public key in {path}"), check_key(secret, f"the secret key in {path}")
    if zmq.curve_public(secret) != public:
        raise InvalidArgument(f"the keys in {path} are not a pair")
    return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """What a client's sockets need for CURVE."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes

    @classmethod
    def load(cls, server_key: str | bytes | os.PathLike | None = None,
             key_file: str | os.PathLike | None = None) -> "ClientKeys | None":
        """From the arguments, else the environment; ``None`` when neither names a
        server key (plain ZeroMQ)."""
        if server_key is None:
            server_key = os.environ.get("HICACHE_SERVER_KEY") or None
        if key_file is None:
            key_file = os.environ.get("HICACHE_CLIENT_KEY_FILE") or None
        if server_key is None:
            if key_file is not None:
                raise InvalidArgument("a client key file without the server's public key (HICACHE_SERVER_KEY)")
            return None
        if key_file is None:
            raise InvalidArgument("a server key without the client's key pair (HICACHE_CLIENT_KEY_FILE)")
        if isinstance(server_key, os.PathLike) or (
                isinstance(server_key, str) and len(server_key.strip()) != KEY_CHARS):
            server = read_public(server_key)
        else:
            server = check_key(server_key, "the server key")
        public, secret = read_secret(key_file)
        return cls(server, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the daemon (before it connects)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


def tenant_from_env() -> str:
    return os.environ.get("HICACHE_TENANT", "")
