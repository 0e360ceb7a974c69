"""The wire protocol: every message hicache's daemon and clients exchange.

msgpack on the wire, through msgspec: each message is a typed ``Struct`` tagged by its
``op`` field, and decoding validates every field's type in C as it parses, so a message
either decodes into exactly one of the types below or is rejected with
:class:`ProtocolError` before anything looks at it. The reference is ``docs/protocol.md``.

Frames: a client's DEALER sends one frame (the encoded request); a REQ socket adds an
empty delimiter, which the server keeps and returns. Every request carries an ``id``
that its reply repeats; replies may come out of order (a load that waits for disk).

Token ids and page ids travel as packed little-endian int32 ``bytes``. Node handles are
integers. Load tickets are ``[slot, generation]`` pairs.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from hicache.errors import ErrorCode, HicacheError

PROTOCOL_VERSION = 2  # 2: memfd pools over the descriptor socket, per-session node handles


class ProtocolError(HicacheError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


# gc=False: messages hold only bytes, numbers, strings and plain containers of them — never
# a cycle — so the garbage collector need not track the two or three made per request.
class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True, gc=False):
    id: int


class Hello(_Request, tag="hello"):
    version: int
    client: str = ""
    pid: int = 0


class Register(_Request, tag="register"):
    """Register the session's engine: its KV spec (``KVSpec.to_dict()``), the
    fingerprint and page-key self-test the client computed (the daemon recomputes both),
    one pool handle per TP rank, and pages the engine still uses (after a daemon
    restart: they stay the session's private pages)."""

    session: int
    spec: dict[str, Any]
    fingerprint: bytes
    key_check: bytes
    pools: list[dict[str, Any]]
    in_use: bytes = b""


class Match(_Request, tag="match"):
    session: int
    tokens: bytes
    extra_key: str = ""


class MatchMany(_Request, tag="match_many"):
    session: int
    tokens: list[bytes]
    extra_key: str = ""


class Lock(_Request, tag="lock"):
    session: int
    node: int


class Unlock(_Request, tag="unlock"):
    session: int
    node: int


class Load(_Request, tag="load"):
    session: int
    node: int


class Alloc(_Request, tag="alloc"):
    session: int
    num_pages: int


class Insert(_Request, tag="insert"):
    session: int
    tokens: bytes
    pages: bytes
    extra_key: str = ""


class Release(_Request, tag="release"):
    session: int
    pages: bytes


class Heartbeat(_Request, tag="heartbeat"):
    session: int


class Bye(_Request, tag="bye"):
    session: int


class Stats(_Request, tag="stats"):
    pass


class Health(_Request, tag="health"):
    pass


class Flush(_Request, tag="flush"):
    pass


class Check(_Request, tag="check"):
    pass


Request = Union[
    Hello, Register, Match, MatchMany, Lock, Unlock, Load, Alloc, Insert, Release,
    Heartbeat, Bye, Stats, Health, Flush, Check,
]


class _Reply(msgspec.Struct, tag_field="op", kw_only=True, gc=False):
    id: int


class Error(_Reply, tag="error"):
    code: int
    message: str


class Ok(_Reply, tag="ok"):
    pass


class HelloReply(_Reply, tag="hello"):
    session: int
    version: int
    daemon: str
    lease_s: float
    fd_socket: str = ""  # where CPU pools' descriptors are offered (hicache.fdpass)


class RegisterReply(_Reply, tag="register"):
    pool: int
    counters: dict[str, Any]
    page_size: int
    num_pages: int


class MatchResult(msgspec.Struct, kw_only=True, gc=False):
    node: int
    device_pages: bytes
    host_pages: int
    disk_pages: int
    wait: list[tuple[int, int]]


class MatchReply(_Reply, tag="match"):
    node: int
    device_pages: bytes
    host_pages: int
    disk_pages: int
    wait: list[tuple[int, int]]


class MatchManyReply(_Reply, tag="match_many"):
    results: list[MatchResult]


class LoadReply(_Reply, tag="load"):
    node: int
    device_pages: bytes
    loaded_pages: int
    wait: list[tuple[int, int]]


class AllocReply(_Reply, tag="alloc"):
    pages: bytes  # empty: cannot now


class InsertReply(_Reply, tag="insert"):
    node: int
    device_pages: bytes  # the canonical pages of every whole page: write them to req_to_token
    freed: bytes  # the caller's duplicates, already returned to the pool
    prefix_pages: int


class StatsReply(_Reply, tag="stats"):
    stats: dict[str, Any]


class HealthReply(_Reply, tag="health"):
    state: str  # "serving" or "draining"
    sessions: int
    uptime_s: float
    version: str


Reply = Union[
    Error, Ok, HelloReply, RegisterReply, MatchReply, MatchManyReply, LoadReply, AllocReply,
    InsertReply, StatsReply, HealthReply,
]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


encode = _encoder.encode  # a message -> bytes (bound: no Python frame on the request path)

def decode_request(data: bytes) -> Request:
    """A request, or :class:`ProtocolError` for anything else — whatever the bytes. The
    decoder checks declared lengths against the bytes present before allocating, and
    nesting is bounded by the interpreter's recursion limit, which the parse of a
    ``dict[str, Any]`` field (or of a value skipped on the way to ``op``) can reach with
    a message of a few kilobytes: that is a bad request too."""
    try:
        return _request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad request: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad request: nested too deeply") from None
    except MemoryError:
        raise ProtocolError("bad request: too large to decode") from None


def decode_reply(data: bytes) -> Reply:
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad reply: {exc}") from None
    except (RecursionError, MemoryError):
        raise ProtocolError("bad reply: nested too deeply or too large") from None


class _Id(msgspec.Struct, gc=False):
    id: int = 0


_id_decoder = msgspec.msgpack.Decoder(_Id)


def request_id(data: bytes) -> int:
    """The ``id`` of a request that failed to decode, if it can be read (else 0), so that
    its error reply still reaches the right waiter."""
    try:
        rid = _id_decoder.decode(data).id
    except (msgspec.DecodeError, RecursionError, MemoryError):
        return 0
    return rid if 0 <= rid < 2**63 else 0
