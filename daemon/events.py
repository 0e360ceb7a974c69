"""Which cached blocks live in which tier, published in vLLM's KV-event wire format.

Cache-aware routers (vLLM's own subscribers, NVIDIA Dynamo's KV router) keep a picture
of each engine's cache from a stream of events; the daemon publishes the same stream for
its tiers (medium ``CPU``, ``STORAGE``), so that they can route to the host whose host
memory or disk already holds a prefix. A block hash on the wire is the low 64 bits of a
page key (:func:`block_hash`). One message per batch, on a PUB socket::

    frame 0   topic                       (the stream's; subscribers filter on it)
    frame 1   seq, 8 bytes big-endian     (per stream, n, n+1, n+2, ...: see seq_from_clock)
    frame 2   msgpack [ts, [event, ...], data_parallel_rank]
              event: {"type": "BlockStored", "block_hashes": [u64, ...], ...}
                     {"type": "BlockRemoved", "block_hashes": [...], "medium": ...}
                     {"type": "AllBlocksCleared"}

A stream's first ``seq`` is the publisher's choice: 0 as vLLM's, or for a publisher that
restarts (the daemon) :func:`seq_from_clock`, so that a subscriber sees a restart as a
gap and its replay reaches back to the new stream's start. A daemon with a disk tier
keeps a :class:`StreamLedger` beside it: its next run starts every stream past each seq
this one sent even if the wall clock went back meanwhile, and ends, with
``AllBlocksCleared``, each stream of this run that the next does not open again. A
stream idle for :data:`IDLE_BEAT_S` sends a batch with no event, so that a subscriber
that reconnected meanwhile sees its gap even on a stream that stays idle; the replay
ring keeps only the last of consecutive batches with no event, so that the beats of a
long-idle stream never push the batches with events out of it.

A subscriber that missed batches (it joined late, or saw a gap in ``seq``) asks the
replay ROUTER for every batch from a ``seq`` on: ``[start_seq8]`` (vLLM's request: the
first pool's stream) or ``[topic, start_seq8]``, and gets ``[b"", topic, seq8, payload]`` for
each batch still in the stream's ring (of a run of batches with no event, the last
alone), then the end marker ``[b"", b"", -1 as 8 bytes,
b""]``. Every request gets its end marker, in the order asked: a reply that fills the
client's queue goes on as the client reads (the owner's next turns), up to
:data:`MAX_REPLIES_WAITING` replies per client — a request beyond those gets nothing.

A subscriber that misses events has a wrong picture, and nothing in the format says
which blocks it got wrong. So whenever events are lost (the bounded queue overflows, the
PUB socket refuses a batch) the stream discards what it has queued, queues
``AllBlocksCleared`` first, and raises :attr:`EventStream.needs_resync`: its owner clears
the flag and re-announces every block it holds. Events queued before a clear are
discarded too — a subscriber would clear them anyway.

Each event is encoded when it is queued (to ``msgspec.Raw``, as fast as building the
struct and encoding it with its batch): a bad argument raises at the caller rather than
at :meth:`EventPublisher.publish`, the caller's lists are not kept, and the batch is
one encoder call that copies the encoded events in.
"""

from __future__ import annotations

import json
import logging
import os
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from hicache.daemon.auth import EVENTS_REPLAY_ZAP_DOMAIN, EVENTS_ZAP_DOMAIN, own_events_domain, parse_user_id
from hicache.errors import InvalidArgument

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

MAX_QUEUE_EVENTS = 100_000
BUFFER_STEPS = 10_000
HWM = 100_000
MAX_REPLIES_WAITING = 64  # replay replies a client has not made room for yet, at most
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A stream starts below this seq: it has 2**63 more before its seqs reach END_SEQ's
# bytes (2**64 - 1), and a ledger's floor, however far ahead a past run's clock was,
# is below it too (see StreamLedger).
SEQ_START_LIMIT = 1 << 63

_PAGE_KEY_BYTES = 16
_U64_MASK = (1 << 64) - 1
_MAX_REQUEST_BYTES = 64 * 1024  # a replay request is a topic and 8 bytes
_NOBLOCK = int(zmq.NOBLOCK)
LEFT_CLEAR_S = 60.0  # how long the streams a killed run left open are cleared again and again
LEFT_RESEND_S = 1.0
IDLE_BEAT_S = 10.0  # a stream that sent nothing for this long sends a batch with no event
_REBIND_S = 2.0  # how long a rebind waits for the old listener to let its port go
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_WATCH_S = 0.1  # how often publish() reads the sockets' monitors (their queues are bounded)


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM (lora_name says it), always None; Dynamo still reads it
    medium: str
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one entry per block; omitted when None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


@dataclass(slots=True)
class _Reply:
    """A replay request being answered: the batches of stream ``topic`` from
    ``next_seq`` up to (without) ``end_seq`` — those published before it was asked —
    then the end marker. ``topic`` None: the end marker alone (nothing to replay).
    ``tenants``: those whose streams its asker reads (None: every stream)."""

    topic: bytes | None
    next_seq: int = 0
    end_seq: int = 0
    tenants: frozenset[str] | None = None


@dataclass(eq=False)
class _OwnSocket:
    """An identity's own PUB socket: the streams of its tenants' engines (see
    :meth:`EventPublisher.set_readers`). ``shown``: the topics it has carried a batch
    of; ``hiding``: those it no longer carries, each told ``AllBlocksCleared`` at its
    stream's batches until when."""

    endpoint: str  # as configured
    bound: str  # as bound (a tcp:// port 0 resolved)
    tenants: frozenset[str] | None
    sock: zmq.Socket
    shown: set[bytes] = field(default_factory=set)
    hiding: dict[bytes, float] = field(default_factory=dict)
    connections: _Connections | None = None

    def close(self, linger_ms: int = 0) -> None:
        if self.connections is not None:
            self.connections.close()
            self.connections = None
        self.sock.close(linger=linger_ms)


class _Connections:
    """The connections open on a PUB socket, from its monitor's accepted and
    disconnected events (a subscriber that failed its handshake counts until its
    disconnection, a moment later). Read by :meth:`EventPublisher.subscribers`."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_WATCHED)
        self._open: set[int] = set()  # their descriptors

    def count(self) -> int:
        while True:
            try:
                frames = self._monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return len(self._open)
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.discard(event["value"])

    def close(self) -> None:
        """Before its socket closes."""
        self._sock.disable_monitor()
        self._monitor.close(linger=0)


_ENCODER = msgspec.msgpack.Encoder()
_CLEARED = msgspec.Raw(_ENCODER.encode(AllBlocksCleared()))


def seq_from_clock() -> int:
    """A new stream's first sequence number, for a publisher that restarts: the wall
    clock in microseconds. A stream sends at most a batch a loop turn, far fewer than
    one a microsecond, so the stream a restarted daemon opens on a topic starts past
    every seq its predecessor sent there: a subscriber that was following the old one
    sees a gap, and its replay from the seq after its last (older than the new ring)
    gets the new stream from its start, ``AllBlocksCleared`` first — never the middle
    of it as if it went on from the old one."""
    return time.time_ns() // 1000


class StreamLedger:
    """What the next run of a daemon must know of this run's streams, kept in a small
    file (``<store>/events``, JSON, replaced whole: written beside, synced, renamed):

    - a seq floor, above every seq this run may have sent. The next run starts each
      stream at ``max(wall clock µs, floor)``: a clock stepped back across the restart
      (a bad RTC corrected at boot) cannot give a new stream the seqs its predecessor
      used, which a router would take for the old stream going on. The floor is
      reserved :data:`SEQ_STEP` ahead, so it is written about once per million batches.
      It is never held down below a seq sent: a floor near 2**62 (a run whose clock was
      far ahead) is followed past 2**62 as any other, ~2**42 runs short of
      :data:`SEQ_START_LIMIT` (a floor past that reads as a ledger that cannot be read).
    - the topics of the streams open now, with their data-parallel ranks (the last
      run's that this one has not ended yet among them). A run that
      ended without closing them (killed, a power loss) left routers counting on their
      blocks; the next run opens each again to say ``AllBlocksCleared`` (for a while,
      see :class:`EventPublisher`) — unless a pool takes the topic up again first,
      whose stream starts with that clear anyway.

    A file that cannot be read is a warning, and the run goes on as without a ledger
    (clock only, nothing to clear); one that cannot be written is a warning (once).
    ``path`` None: nothing kept (a daemon without a disk tier)."""

    SEQ_STEP = 1 << 20

    def __init__(self, path: Path | None, clock: Callable[[], int] = lambda: seq_from_clock()) -> None:
        self.path = path
        self._clock = clock
        self._floor = 0  # above every seq the last run sent
        self._reserved = 0  # above every seq this run sends (once written)
        self.topics: dict[bytes, int] = {}  # this run's open streams: topic -> data-parallel rank
        self.left: dict[bytes, int] = {}  # the last run's streams it did not end
        self._write_failed = False
        if path is not None:
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_bytes())
            floor, topics = data["seq_floor"], data["topics"]
            if type(floor) is not int or not 0 <= floor < SEQ_START_LIMIT or type(topics) is not dict:
                raise ValueError("fields of the wrong type")
            left = {bytes.fromhex(topic): rank for topic, rank in topics.items()}
            if any(type(rank) is not int or not 0 <= rank < 1 << 32 for rank in left.values()):
                raise ValueError("a rank out of range")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:  # (json's errors are ValueErrors)
            logger.warning("events: cannot read the stream ledger %s (%s): streams start at the clock, "
                           "and the last run's are not cleared", path, exc)
            return
        # Its topics stay open until this run ends them: every write names them, so a
        # run killed while it reopens them (or at any time after) leaves them all to the next.
        self._floor, self.left, self.topics = floor, left, dict(left)

    def first_seq(self) -> int:
        """A new stream's first seq: past the clock, and past every seq the last run sent."""
        seq = max(self._clock(), self._floor)
        self.sent(seq)
        return seq

    def sent(self, seq: int) -> None:
        """A stream sends (or starts at) ``seq``: the floor moves past it first."""
        if seq >= self._reserved:
            self._reserved = seq + self.SEQ_STEP
            self._save()

    def opened(self, topic: bytes, data_parallel_rank: int) -> None:
        if self.topics.get(topic) != data_parallel_rank:
            self.topics[topic] = data_parallel_rank
            self._save()

    def closed(self, topic: bytes) -> None:
        if self.topics.pop(topic, None) is not None:
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        data = {"seq_floor": max(self._reserved, self._floor),
                "topics": {topic.hex(): rank for topic, rank in self.topics.items()}}
        tmp = self.path.with_name(self.path.name + ".new")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
                f.write(json.dumps(data).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                logger.warning("events: cannot write the stream ledger %s (%s): after a restart, streams start "
                               "at the clock, and this run's are not cleared", self.path, exc)
            return
        self._write_failed = False


def block_hash(page_key: bytes) -> int:
    """The block hash of a page on the wire: the low 64 bits of its 16-byte key."""
    if len(page_key) != _PAGE_KEY_BYTES:
        raise InvalidArgument(f"a page key is {_PAGE_KEY_BYTES} bytes, not {len(page_key)}")
    return int.from_bytes(page_key, "big") & _U64_MASK


class EventStream:
    """One topic's events: a bounded queue of encoded events, its sequence numbers (from
    0) and a ring of the last ``buffer_steps`` batches for replay. Not thread-safe."""

    def __init__(self, topic: bytes, data_parallel_rank: int = 0, *, max_queue_events: int = MAX_QUEUE_EVENTS,
                 buffer_steps: int = BUFFER_STEPS, first_seq: int = 0) -> None:
        if not 0 <= data_parallel_rank < 1 << 32:  # Dynamo reads it as a u32
            raise InvalidArgument(f"data_parallel_rank {data_parallel_rank} is not a u32")
        if max_queue_events < 1 or buffer_steps < 1:
            raise InvalidArgument("max_queue_events and buffer_steps must be positive")
        if not 0 <= first_seq < SEQ_START_LIMIT:
            raise InvalidArgument(f"first_seq {first_seq} is out of range")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.max_queue_events = max_queue_events
        self.next_seq = first_seq
        # The tenants whose engines' blocks the stream shows (None: anyone's, or not
        # known), since batch ``scope_seq``: who else than every stream's readers may
        # read it (see :meth:`EventPublisher.set_readers`).
        self.scope: frozenset[str] | None = None
        self.scope_seq = first_seq
        self.needs_resync = False  # set when events were lost; the owner clears it and re-announces
        self.dropped = 0  # events that never reached the wire
        self.batches_sent = 0
        self.events_sent = 0
        self._clear_first = False  # the next batch starts with AllBlocksCleared (not counted in the bound)
        self._nudged = False  # the next batch goes out though it holds no event (see nudge)
        self._pending: list[msgspec.Raw] = []
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ring_ends_empty = False  # its last batch holds no event (see take_batch)

    @property
    def num_pending(self) -> int:
        """Events the next batch holds."""
        return len(self._pending) + self._clear_first

    def rescope(self, tenants: frozenset[str] | None) -> None:
        """The stream shows the blocks of ``tenants``' engines from its next batch on
        (:attr:`scope`); the owner starts it over (``AllBlocksCleared``, then what it
        shows now): a replay for a reader of those tenants only begins there, so that
        no batch of an earlier scope reaches it."""
        self.scope = tenants
        self.scope_seq = self.next_seq

    def visible_to(self, tenants: frozenset[str] | None) -> bool:
        """May a reader of ``tenants``' streams (None: of every stream) read it?"""
        return tenants is None or (bool(self.scope) and self.scope <= tenants)

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int,
               medium: str, lora_name: str | None = None, extra_keys: Sequence[Any] | None = None) -> None:
        """Blocks ``hashes`` (a chain: each the next one's parent; ``parent`` the first's)
        now live in ``medium``; ``token_ids`` are their tokens, ``block_size`` a block.
        An empty ``hashes`` queues nothing."""
        if not hashes:
            return
        if extra_keys is not None:
            extra_keys = list(extra_keys)
            if len(extra_keys) != len(hashes):
                raise InvalidArgument(f"{len(extra_keys)} extra keys for {len(hashes)} blocks")
        self._push(BlockStored(list(hashes), parent, list(token_ids), block_size, None, medium,
                               lora_name, extra_keys))

    def removed(self, hashes: Sequence[int], medium: str) -> None:
        """Blocks ``hashes`` no longer live in ``medium``. An empty ``hashes`` queues nothing."""
        if hashes:
            self._push(BlockRemoved(list(hashes), medium))

    def cleared(self) -> None:
        """Every block is gone, from every medium. O(1): what was queued is discarded."""
        self._pending = []
        self._clear_first = True

    def nudge(self) -> None:
        """The next batch goes out even if it holds no event: a subscriber that missed
        the batches before it (it connected after them) sees the gap in ``seq`` and
        replays them. O(1)."""
        self._nudged = True

    def _push(self, event: BlockStored | BlockRemoved) -> None:
        if len(self._pending) >= self.max_queue_events:
            self.lost(1)
            return
        self._pending.append(msgspec.Raw(_ENCODER.encode(event)))

    def lost(self, num_events: int) -> None:
        """``num_events`` events did not reach the wire: discard the queue (counted too)
        and restart it with ``AllBlocksCleared``; the owner re-announces what it holds."""
        self.dropped += num_events + len(self._pending)
        if not self.needs_resync:
            logger.warning("events stream %r lost events (%d so far): subscribers are told to clear and "
                           "the blocks are announced again", self.topic, self.dropped)
        self.needs_resync = True
        self._pending = []
        self._clear_first = True

    def take_batch(self, now: float) -> tuple[int, bytes] | None:
        """Everything queued as one batch stamped ``now``: ``(seq, payload)``, kept in the
        ring; ``None`` when nothing is queued. A batch with no event (a nudge) takes the
        place of one just before it with none either: an idle stream's beats would
        otherwise push the batches that say something out of the ring within
        ``buffer_steps`` beats, and a replay of a run of empty batches says nothing
        that its last does not (a replay skips their seqs). O(encoded bytes)."""
        if not self._pending and not self._clear_first and not self._nudged:
            return None
        self._nudged = False
        events, self._pending = self._pending, []
        if self._clear_first:
            events.insert(0, _CLEARED)
            self._clear_first = False
        seq = self.next_seq
        self.next_seq += 1
        payload = _ENCODER.encode((float(now), events, self.data_parallel_rank))
        if not events and self._ring_ends_empty:
            self._ring.pop()
        self._ring.append((seq, payload))
        self._ring_ends_empty = not events
        return seq, payload

    def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The batches in the ring from ``start_seq`` on (from the oldest kept, if older)."""
        return list(islice(self._ring, self._index(start_seq), None))

    def iter_replay(self, start_seq: int) -> Iterator[tuple[int, bytes]]:
        """:meth:`replay`, lazily (the ring must not change meanwhile): a reply that
        stops after a few batches does not copy the ring's references first."""
        for i in range(self._index(start_seq), len(self._ring)):
            yield self._ring[i]

    def _index(self, start_seq: int) -> int:
        """Where the ring's first batch from ``start_seq`` on is (its seqs ascend, with
        gaps where empty batches gave way). O(log buffer_steps) lookups."""
        return bisect_left(self._ring, start_seq, key=itemgetter(0))


def _bind_again(sock: zmq.Socket, endpoint: str) -> None:
    """Bind ``endpoint`` that ``sock`` just unbound: libzmq closes the old listener on
    its I/O thread, so a ``tcp://`` port may be in use for a moment (milliseconds)."""
    deadline = time.monotonic() + _REBIND_S
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.001)


class EventPublisher:
    """A PUB socket bound to ``endpoint`` carrying several streams (one per topic),
    optionally the replay ROUTER bound to ``replay_endpoint``, and the PUB sockets of
    identities that read their own tenants' streams (:meth:`set_readers`). Runs on its
    owner's thread: the owner calls :meth:`publish` and, when its poller sees a socket
    of :meth:`sockets` readable, :meth:`serve_replay`. Not thread-safe; no threads."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, hwm: int = HWM,
                 max_queue_events: int = MAX_QUEUE_EVENTS, buffer_steps: int = BUFFER_STEPS,
                 context: zmq.Context | None = None, secure: Callable[[zmq.Socket, str, bytes], None] | None = None,
                 clock: Callable[[], float] = time.time, first_seq: Callable[[], int] = lambda: 0,
                 ledger: StreamLedger | None = None, left_clear_s: float = LEFT_CLEAR_S,
                 idle_beat_s: float = IDLE_BEAT_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``context``: the sockets' (the daemon's server's, whose ZAP handler admits
        the subscribers); ``secure(socket, endpoint, ZAP domain)``: sets a socket's
        security options (CURVE, the domain) before it binds ``endpoint``; ``clock``: the batches'
        timestamps (wall-clock seconds, as vLLM's); ``first_seq()``: a new stream's
        first sequence number (see :func:`seq_from_clock`); ``ledger``: a restarting
        publisher's record of its streams (then it gives the first seqs). The streams
        its last run left open say ``AllBlocksCleared`` again every
        :data:`LEFT_RESEND_S` for ``left_clear_s`` (a router reconnects to the new
        socket when it will: a PUB sends nothing to one not connected yet, and a stream
        forgotten has no replay), then end — unless a pool takes the topic up first. A
        topic a pool took up sends a batch as often and for as long (with no event if
        it has none to send): a router that reconnects after that stream's first
        batches, still holding the last run's blocks, sees the gap and replays the
        stream from its ``AllBlocksCleared``. Past that, a stream that sent no batch for
        ``idle_beat_s`` sends one with no event: a subscriber back later (or one that
        lost its connection for a while) sees its gap within that time, even on a
        stream that stays idle."""
        if not idle_beat_s > 0:
            raise InvalidArgument(f"idle_beat_s must be positive, got {idle_beat_s}")
        self._clock = clock
        self._monotonic = monotonic
        self._left: dict[bytes, float] = {}  # the last run's topics still being cleared -> until when
        self._nudging: dict[bytes, float] = {}  # streams sending a batch every second -> until when
        self._left_clear_s = left_clear_s
        self._idle_beat_s = idle_beat_s
        self._beat_next = monotonic() + idle_beat_s
        self._beat_seqs: dict[bytes, int] = {}  # each stream's next seq at the last beat (see _beat)
        self._left_next = 0.0  # when they say it again
        self._first_seq = first_seq if ledger is None else ledger.first_seq
        self._ledger = ledger
        self._max_queue_events = max_queue_events
        self._buffer_steps = buffer_steps
        self._streams: dict[bytes, EventStream] = {}
        self._ending: set[bytes] = set()  # topics of streams whose last batch waits to go out (see end)
        # What the streams that ended sent and dropped (the totals are counters: they never go down).
        self._ended_batches = self._ended_events = self._ended_dropped = 0
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        self._replies: dict[bytes, deque[_Reply]] = {}  # client identity -> its replies not yet sent whole
        # identity -> the tenants whose streams it replays (None: every stream); None: no
        # identities told (a publisher no ZAP handler guards: every request answered)
        self._readers: dict[str, frozenset[str] | None] | None = None
        self._own: dict[str, _OwnSocket] = {}  # identity -> its own PUB socket
        context = context if context is not None else zmq.Context.instance()
        self._context, self._secure, self._hwm = context, secure, hwm
        self._pub = context.socket(zmq.PUB)
        self._connections = None
        self._watch_next = 0.0
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            if secure is not None:
                secure(self._pub, endpoint, EVENTS_ZAP_DOMAIN)
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # port 0 resolved
            self._connections: _Connections | None = _Connections(self._pub)
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A replay is up to one message per batch in the ring; past the queue's
                # bound (or to a client gone) a send raises rather than being dropped
                # unseen: the reply waits for the client to read (see serve_replay).
                self._replay.setsockopt(zmq.SNDHWM, max(hwm, buffer_steps + 1))
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
                if secure is not None:
                    secure(self._replay, replay_endpoint, EVENTS_REPLAY_ZAP_DOMAIN)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError:
            self.close()
            raise
        if ledger is not None:
            until = monotonic() + left_clear_s
            for topic, rank in ledger.left.items():
                self.stream(topic, data_parallel_rank=rank).cleared()
                self._left[topic] = until
            self._left_next = monotonic() + LEFT_RESEND_S

    def rebind(self) -> None:
        """Drop every subscriber and listen again on the same endpoints, so that each
        is admitted anew (a reload of the identities: one no longer allowed gets
        nothing more). One still allowed reconnects by itself, and replays the batches
        it missed meanwhile: it sees the gap at the next batch, which each stream sends
        every :data:`LEFT_RESEND_S` for ``left_clear_s`` (with no event if it has none;
        an idle stream would show none)."""
        bound = [(self._pub, self.endpoint), (self._replay, self.replay_endpoint),
                 *((own.sock, own.bound) for own in self._own.values())]
        for sock, endpoint in bound:
            if sock is not None:
                sock.unbind(endpoint)
                _bind_again(sock, endpoint)
        now = self._monotonic()
        for topic in self._streams:
            if topic not in self._left and topic not in self._ending:
                self._nudging[topic] = now + self._left_clear_s
        self._left_next = min(self._left_next, now + LEFT_RESEND_S) if self._left else now + LEFT_RESEND_S

    def set_readers(self, readers: dict[str, frozenset[str] | None] | None,
                    own: dict[str, tuple[str, frozenset[str] | None]]) -> list[str]:
        """Who reads what, by identity name. ``readers``: the identities whose replay
        requests are answered, each with the tenants whose streams it reads (a stream
        whose :attr:`~EventStream.scope` is within them) or None (every stream); an
        identity not named gets the end marker alone. ``None`` (as before the first
        call): every request is answered in full (no identities listed, or a publisher
        no ZAP handler guards).
        ``own``: the identities with a PUB socket of their own, its endpoint and the
        tenants whose streams it carries (None: every stream). A socket whose endpoint
        is unchanged is kept, with its subscribers (:meth:`rebind` admits them anew); a
        stream it carried and no longer may is told ``AllBlocksCleared`` there at that
        stream's batches for ``left_clear_s``, and nothing else. Returns the endpoints
        that could not be bound (each logged; the others serve)."""
        self._readers = None if readers is None else dict(readers)
        for name in [n for n, s in self._own.items() if n not in own or own[n][0] != s.endpoint]:
            self._own.pop(name).close()
        failed = []
        until = self._monotonic() + self._left_clear_s
        for name, (endpoint, tenants) in own.items():
            found = self._own.get(name)
            if found is None:
                try:
                    self._own[name] = self._bind_own(name, endpoint, tenants)
                except zmq.ZMQError as exc:
                    logger.error("KV events of identity %r: cannot listen on %s (%s)", name, endpoint, exc)
                    failed.append(endpoint)
                continue
            found.tenants = tenants
            for topic in list(found.shown):
                stream = self._streams.get(topic)
                if stream is None or not stream.visible_to(tenants):
                    found.shown.discard(topic)
                    found.hiding[topic] = until
        return failed

    def _bind_own(self, name: str, endpoint: str, tenants: frozenset[str] | None) -> _OwnSocket:
        sock = self._context.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            if self._secure is not None:
                self._secure(sock, endpoint, own_events_domain(name))
            sock.bind(endpoint)
            return _OwnSocket(endpoint, sock.getsockopt(zmq.LAST_ENDPOINT).decode(), tenants, sock,
                              connections=_Connections(sock))
        except BaseException:
            sock.close(linger=0)
            raise

    def subscribers(self) -> dict[str, int]:
        """The connections open on each PUB socket: ``daemon`` (the daemon's), and
        ``own:<identity>`` for each identity's own (see :class:`_Connections`)."""
        out = {"daemon": self._connections.count()} if self._connections is not None else {}
        out.update((f"own:{name}", own.connections.count()) for name, own in self._own.items()
                   if own.connections is not None)
        return out

    @property
    def own_endpoints(self) -> dict[str, str]:
        """Identity -> where its own socket listens (``tcp://`` port 0 resolved)."""
        return {name: own.bound for name, own in self._own.items()}

    def stream(self, topic: str | bytes = b"", data_parallel_rank: int = 0) -> EventStream:
        """The stream of ``topic``, created on first use (the oldest one a pool speaks on
        answers vLLM's one-frame replay requests); one that was ending goes on."""
        key = topic.encode() if isinstance(topic, str) else bytes(topic)
        found = self._streams.get(key)
        ending = key in self._ending or key in self._left
        if found is not None and ending and found.data_parallel_rank != data_parallel_rank:
            # (The new stream's first batch clears the topic just as well; the ledger
            # keeps the topic throughout, its rank replaced when the new stream opens.)
            self._forget(key)
            found = None
        self._ending.discard(key)
        until = self._left.pop(key, None)
        if until is not None:
            self._nudging[key] = until
        if found is None:
            found = self._streams[key] = EventStream(key, data_parallel_rank, max_queue_events=self._max_queue_events,
                                                     buffer_steps=self._buffer_steps, first_seq=self._first_seq())
            self._beat_seqs[key] = found.next_seq
            if self._ledger is not None:
                self._ledger.opened(key, data_parallel_rank)
        elif found.data_parallel_rank != data_parallel_rank:
            raise InvalidArgument(f"events stream {key!r} has data-parallel rank {found.data_parallel_rank}, "
                                  f"not {data_parallel_rank}")
        return found

    def end(self, stream: EventStream) -> None:
        """``stream`` is over (its pool is gone): its next batch, ``AllBlocksCleared``
        (its subscribers forget every block it announced), is its last; once that went
        out the publisher forgets it, its replay ring with it."""
        stream.cleared()
        self._ending.add(stream.topic)

    @property
    def streams(self) -> list[EventStream]:
        """In creation order."""
        return list(self._streams.values())

    def sockets(self) -> list[zmq.Socket]:
        """What the owner polls for input: the replay ROUTER, if any."""
        return [] if self._replay is None else [self._replay]

    @property
    def batches_sent(self) -> int:
        return self._ended_batches + sum(s.batches_sent for s in self._streams.values())

    @property
    def events_sent(self) -> int:
        return self._ended_events + sum(s.events_sent for s in self._streams.values())

    @property
    def dropped(self) -> int:
        return self._ended_dropped + sum(s.dropped for s in self._streams.values())

    def publish(self, now: float | None = None) -> int:
        """Send every stream's queued events as one batch each; returns batches sent. A
        batch the socket refuses stays in the ring, is counted as dropped, and makes
        its stream resync."""
        if now is None:
            now = self._clock()
        beat = self._monotonic()
        if beat >= self._watch_next:  # (their monitors' queues are bounded: read them now and then)
            self._watch_next = beat + _WATCH_S
            self.subscribers()
        if (self._left or self._nudging) and beat >= self._left_next:
            self._clear_left()
        if beat >= self._beat_next:
            self._beat(beat)
        sent = 0
        for stream in self._streams.values():
            num_events = stream.num_pending
            taken = stream.take_batch(now)
            if taken is None:
                continue
            seq, payload = taken
            if self._ledger is not None:
                self._ledger.sent(seq)
            try:
                self._pub.send_multipart([stream.topic, seq.to_bytes(8, "big"), payload], _NOBLOCK, copy=False)
            except zmq.Again:
                stream.lost(num_events)
                continue
            for own in self._own.values():
                self._send_own(own, stream, seq, payload, now, beat)
            stream.batches_sent += 1
            stream.events_sent += num_events
            sent += 1
        for topic in [t for t in self._ending if not self._streams[t].num_pending]:  # (a refused one: again)
            self._ending.discard(topic)
            self._forget(topic)
            if self._ledger is not None:
                self._ledger.closed(topic)
        return sent

    def _send_own(self, own: _OwnSocket, stream: EventStream, seq: int, payload: bytes, now: float,
                  beat: float) -> None:
        """A batch on an identity's own socket: as it is, if the identity reads the
        stream; ``AllBlocksCleared`` in its place (same seq), if the socket carried the
        stream before and may no more (for ``left_clear_s``: subscribers that reconnect
        after a reload get it too); else nothing."""
        topic = stream.topic
        if stream.visible_to(own.tenants):
            own.shown.add(topic)
            own.hiding.pop(topic, None)
        else:
            if topic in own.shown:
                own.shown.discard(topic)
                own.hiding[topic] = beat + self._left_clear_s
            until = own.hiding.get(topic)
            if until is None:
                return
            if beat >= until:
                del own.hiding[topic]
                return
            payload = _ENCODER.encode((float(now), [_CLEARED], stream.data_parallel_rank))
        own.sock.send_multipart([topic, seq.to_bytes(8, "big"), payload], _NOBLOCK, copy=False)

    def _clear_left(self) -> None:
        """The last run's streams no pool took up say ``AllBlocksCleared`` again; those
        past their time end (the clear their last batch). Those a pool took up, and every
        stream after a rebind, send a batch (see :meth:`EventStream.nudge`) until their
        time is over, or they end."""
        now = self._monotonic()
        self._left_next = now + LEFT_RESEND_S
        for topic, until in list(self._left.items()):
            if now >= until:
                self.end_left(topic)
            else:
                self._streams[topic].cleared()
        for topic, until in list(self._nudging.items()):
            if now >= until or topic not in self._streams:
                del self._nudging[topic]
            else:
                self._streams[topic].nudge()

    def _beat(self, now: float) -> None:
        """Each stream that sent no batch since the last beat (or its start) sends one
        now, with no event if it has none (see :meth:`EventStream.nudge`)."""
        self._beat_next = now + self._idle_beat_s
        seqs = {}
        for topic, stream in self._streams.items():
            idle = self._beat_seqs.get(topic) == stream.next_seq
            if idle:
                stream.nudge()
            seqs[topic] = stream.next_seq + idle  # (the nudged batch takes next_seq)
        self._beat_seqs = seqs

    def end_left(self, topic: bytes | None = None) -> None:
        """The last run's stream of ``topic`` (None: each of them) ends now, unless a
        pool took it up (see :meth:`end`); its clear is its last batch."""
        for key in list(self._left) if topic is None else [topic]:
            if self._left.pop(key, None) is not None:
                self.end(self._streams[key])

    def _forget(self, topic: bytes) -> None:
        for own in self._own.values():  # (its last batch, a clear, went to those it showed)
            own.shown.discard(topic)
            own.hiding.pop(topic, None)
        stream = self._streams.pop(topic)
        self._ended_batches += stream.batches_sent
        self._ended_events += stream.events_sent
        self._ended_dropped += stream.dropped

    def serve_replay(self, limit: int | None = None) -> int:
        """Go on with the replies a client's full queue held up, then answer the replay
        requests waiting (at most ``limit``: a reply may be a whole ring of batches, and
        a client sending requests back to back must not hold its owner's thread),
        without blocking; returns how many requests. A request that does not parse gets
        the end marker alone. O(messages sent + clients whose replies wait)."""
        if self._replay is None:
            return 0
        for identity in list(self._replies):
            self._send_replies(identity)
        served = 0
        while limit is None or served < limit:
            try:
                frames = self._replay.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return served
            served += 1
            identity = frames[0].bytes
            replies = self._replies.setdefault(identity, deque())
            if len(replies) >= MAX_REPLIES_WAITING:
                logger.debug("replay request of %r dropped: %d replies wait for it to read", identity, len(replies))
                continue
            allowed, tenants = self._reader(frames[-1])
            replies.append(self._reply_to([f.bytes for f in frames[1:]], tenants) if allowed else _Reply(None))
            if len(replies) == 1:
                self._send_replies(identity)
        return served

    def _reader(self, frame: zmq.Frame) -> tuple[bool, frozenset[str] | None]:
        """Whether the connection that sent ``frame`` may replay, and the tenants whose
        streams it reads (None: every stream) — by the identity its ZAP handler named
        in the frame's user id (see :meth:`set_readers`)."""
        if self._readers is None:
            return True, None
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:  # no handler was asked (a plain tcp:// socket: whoever reaches it reads)
            return True, None
        parsed = parse_user_id(user)
        if parsed is None or parsed[0] not in self._readers:
            return False, None
        return True, self._readers[parsed[0]]

    def _reply_to(self, body: list[bytes], tenants: frozenset[str] | None = None) -> _Reply:
        if body and not body[0]:  # the empty delimiter of a REQ socket (or a DEALER that mimics one)
            body = body[1:]
        stream = None
        if len(body) == 1:  # (the oldest stream a pool speaks on, that the asker reads: not a last run's)
            readable = [(topic, s) for topic, s in self._streams.items() if s.visible_to(tenants)]
            stream = next((s for topic, s in readable if topic not in self._left),
                          next((s for _, s in readable), None))
        elif len(body) == 2:  # (one the asker does not read: the end marker, see _send_replies)
            stream = self._streams.get(body[0])
        if stream is None or len(body[-1]) != 8:
            return _Reply(None)
        return _Reply(stream.topic, int.from_bytes(body[-1], "big"), stream.next_seq, tenants)

    def _send_replies(self, identity: bytes) -> None:
        """Send ``identity``'s replies in order, each ending with the end marker, until
        its queue is full (the rest waits for the next call); a client gone loses them.
        Batches that left the ring (or a stream that ended) meanwhile are skipped."""
        replies = self._replies[identity]
        try:
            while replies:
                reply = replies[0]
                stream = self._streams.get(reply.topic) if reply.topic is not None else None
                if stream is not None and reply.tenants is not None:  # (at each send: its scope may change)
                    if not stream.visible_to(reply.tenants):
                        stream = None
                    else:
                        reply.next_seq = max(reply.next_seq, stream.scope_seq)
                if stream is not None:
                    for seq, payload in stream.iter_replay(reply.next_seq):
                        if seq >= reply.end_seq:
                            break
                        self._replay.send_multipart([identity, b"", stream.topic, seq.to_bytes(8, "big"), payload],
                                                    _NOBLOCK, copy=False)
                        reply.next_seq = seq + 1
                self._replay.send_multipart([identity, b"", b"", END_SEQ, b""], _NOBLOCK)
                replies.popleft()
        except zmq.Again:  # its queue is full: on at the next call
            return
        except zmq.ZMQError as exc:  # the client is gone
            logger.debug("replay to %r dropped: %s", identity, exc)
        del self._replies[identity]

    def close(self, linger_s: float = 0.0) -> None:
        """Close the sockets. ``linger_s``: how long the batches already published may
        still go out to subscribers that have not taken them yet (a stream's last
        batch, behind the others for a router that reads slowly) — libzmq sends them on
        its I/O thread after this returns; the context's ``term`` waits that long at
        most. (On ``ipc://`` a subscriber whose receive queue is full when the
        connection then closes still loses what its socket buffer held: its libzmq
        drops it at the hang-up.) A replay in progress is cut short."""
        if self._connections is not None:
            self._connections.close()
            self._connections = None
        if self._pub is not None:
            self._pub.close(linger=max(0, int(linger_s * 1000)))
        for own in self._own.values():
            own.close(max(0, int(linger_s * 1000)))
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
