"""Per-layer completion counters of loads, shared between the daemon and an engine.

A load moves a path's pages into the engine's pool layer by layer; the engine starts
attention on layer *i* as soon as layer *i* has landed. The daemon owns a ring of
``num_slots`` slots; each load gets a :class:`Ticket` (slot, generation) and the daemon
stamps each layer when it is complete. The ring lives in a sealed memfd segment
(:mod:`hicache.shm`) that the engine maps read-only, int64 words::

    slot s:  [ generation | stamp L0 | stamp L1 | ... | stamp L(n-1) ]

    log:     [ outcome of generation g at g % log_words ] x log_words

``stamp == generation`` means done, ``stamp == -generation`` failed; any other value is
from an older load that used the slot. Generations never repeat, so a waiter can never
mistake an earlier (or a later) load's progress for its own: when the slot has moved on
to another generation, the load is over, and the log after the slots says how it ended —
``+generation`` every layer landed, ``-generation`` not — written by ``finish`` before
the slot can go to another load. A waiter reads the slot's generation first and the log
after (a store the daemon made before the one it sees is visible to it), so it finds
the outcome of any of the last ``log_words`` loads to end: ``LOG_WORDS_PER_SLOT`` times as
many as there are slots. (Before, a ticket whose slot had moved on read as stale: vLLM's
scheduler answers a step's loads before its worker waits on any, and where one step
had more loads than the ring has slots, the connector reported landed loads as failed.)
A ticket older than that — or of another ring — raises :class:`StaleTicket`. Nor do
they repeat across rings: each ring counts from a random start, so that a ticket of a
ring that is gone — a daemon that restarted, a pool registered again — is stale on the
ring its engine waits on now (where every ring counted from 1, a new daemon's first
load had the ticket of the old one's first load, and waiting on the old ticket returned
when the new load landed). The daemon writes the KV bytes before the stamp (x86 keeps
stores in order; the stamp is one aligned 8-byte store).

The daemon holds a shared ``flock`` on its descriptor of the ring for as long as it may
stamp it: until it lets the pool go — which it does only once no copy for the pool is
left — or until it exits, however it exits (the kernel drops the lock with the last
reference: the descriptor and the mapping). An engine's waiter, on a descriptor of its
own, tries for an exclusive lock now and then while it waits: when it gets one, nothing
can write the load's blocks any more, and a layer not stamped by then has failed — a
daemon killed mid-load costs its engine no wait for a timeout, and a load given up on is
known to be over (:attr:`CountersHandle.writer_lock`: daemons that say so).

GPU mode adds :class:`CudaLayerEvents`: an interprocess CUDA event per slot and layer,
recorded on the daemon's copy stream after each layer and waited on by the engine's
stream, with no CPU block. The handles name the events' GPU by its UUID besides the
daemon's index of it, since the engine's index of that GPU may be another
(:func:`hicache.cuda_ipc.local_device`). The shared ring still carries generations and failures, and
a layer's stamp there says that its event was recorded for this load (its copy is on
the stream): the engine waits for that before its stream waits on the event. A load found in the log
needs no event wait: the daemon ends a load only once its copies have run.
"""

from __future__ import annotations

import fcntl
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.cuda_ipc import device_uuid, local_device
from hicache.errors import InvalidArgument, LoadFailed, StaleTicket, WaitTimeout
from hicache.shm import SharedBuffer


_GENERATION_BITS = 52
_PROBE_WRITER_S = 0.01  # how often a waiter looks whether the ring's daemon is gone
LOG_WORDS_PER_SLOT = 16  # outcomes of loads that ended a ring remembers, per slot

_PENDING, _LANDED, _OVER = range(3)  # a layer: not yet; landed; landed, and its load ended


class Ticket(NamedTuple):
    slot: int
    generation: int


@dataclass(frozen=True)
class CountersHandle:
    """What an engine needs to wait on a pool's loads: the ring's shape, the token its
    read-only descriptor is fetched by (:func:`hicache.fdpass.fetch`), and in GPU mode
    the events' IPC handles."""

    token: bytes
    num_slots: int
    num_layers: int
    event_handles: tuple[bytes, ...] = ()  # slot-major, num_slots * num_layers (GPU mode)
    device: int = -1  # the daemon's index of the events' GPU
    writer_lock: bool = False  # the daemon holds the ring's flock while it may stamp it
    device_uuid: str | None = None  # the events' GPU in every process (older daemons: none)
    # The outcome log's words after the slots (older daemons: none). An older client maps
    # the slots only (ring_bytes without it), and reads them as before.
    log_words: int = 0

    @property
    def nbytes(self) -> int:
        return ring_bytes(self.num_slots, self.num_layers, self.log_words)

    def to_dict(self) -> dict[str, Any]:
        uuid = {} if self.device_uuid is None else {"device_uuid": self.device_uuid}
        log = {"log_words": self.log_words} if self.log_words else {}
        return {"token": self.token, "num_slots": self.num_slots, "num_layers": self.num_layers,
                "event_handles": list(self.event_handles), "device": self.device, "writer_lock": self.writer_lock,
                **uuid, **log}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CountersHandle":
        uuid = data.get("device_uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise InvalidArgument(f"bad counters handle: device_uuid has type {type(uuid).__name__}")
        try:
            handle = cls(bytes(data["token"]), int(data["num_slots"]), int(data["num_layers"]),
                         tuple(data.get("event_handles", ())), int(data.get("device", -1)),
                         data.get("writer_lock") is True, uuid, int(data.get("log_words", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad counters handle: {exc}") from None
        if handle.log_words < 0:
            raise InvalidArgument(f"bad counters handle: log_words {handle.log_words}")
        return handle


def ring_bytes(num_slots: int, num_layers: int, log_words: int = 0) -> int:
    """Bytes of a ring: one generation word and one stamp per layer, per slot; then the
    outcome log's words."""
    return (num_slots * (1 + num_layers) + log_words) * 8


def _ring(buffer: np.ndarray, num_slots: int, num_layers: int, log_words: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The slots (``num_slots`` x ``1 + num_layers`` words) and the outcome log."""
    words = buffer.view(np.int64)
    end = num_slots * (1 + num_layers)
    return words[:end].reshape(num_slots, 1 + num_layers), words[end : end + log_words]


class LayerCounters:
    """The daemon's side: hands out tickets and stamps layers.

    The shared ring is write-only for the daemon: the engine's mapping is read-only
    (and the segment sealed against new writers), but what lives in shared memory is
    never trusted all the same, so every decision — is this ticket live, are its layers
    all stamped — is taken on a private copy (``_words``) that each stamp goes to first."""

    def __init__(self, num_slots: int, num_layers: int, *, cuda_device: int | None = None) -> None:
        if num_slots <= 0 or num_layers <= 0:
            raise InvalidArgument("a counters ring needs at least one slot and one layer")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.log_words = LOG_WORDS_PER_SLOT * num_slots
        self.shared = SharedBuffer.create(ring_bytes(num_slots, num_layers, self.log_words), name="hicache-layers",
                                          others_read_only=True)
        # Held until the ring is closed or the process ends (see the module doc); the
        # descriptors handed to engines are their own (reader_fd), never this one.
        fcntl.flock(self.shared.fd, fcntl.LOCK_SH)
        self._ring, self._log = _ring(self.shared.array, num_slots, num_layers, self.log_words)
        self._words = np.zeros((num_slots, 1 + num_layers), dtype=np.int64)
        self._free = deque(range(num_slots))  # FIFO: a freed slot is reused as late as possible
        # (52 random bits: another ring's ticket matches a live slot by chance with odds of
        # one in ~10^15 per lookup, and one of the log's 16 x num_slots words with odds of
        # ~num_slots x 10^-14 — 10^-12 at 256 slots; generations stay far below int64's
        # end, negated as failures)
        self._next_generation = 1 + secrets.randbits(_GENERATION_BITS)
        self.events = CudaLayerEvents.create(num_slots, num_layers, cuda_device) if cuda_device is not None else None

    def handle(self, token: bytes = b"") -> CountersHandle:
        """The engine's handle, with the token its reader descriptor was published under."""
        if self.events is None:
            return CountersHandle(token, self.num_slots, self.num_layers, writer_lock=True, log_words=self.log_words)
        return CountersHandle(token, self.num_slots, self.num_layers, self.events.ipc_handles(), self.events.device,
                              writer_lock=True, device_uuid=device_uuid(self.events.device),
                              log_words=self.log_words)

    def reader_fd(self) -> int:
        """A read-only descriptor of the ring, for the engine (the caller hands it on)."""
        return self.shared.reader_fd()

    def waiter(self) -> "LayerWaiter":
        """A waiter over this ring in this process (tests, in-process engines)."""
        return LayerWaiter(self.handle(), self.reader_fd())

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def begin(self) -> Ticket | None:
        """A ticket for a new load, or ``None`` when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.popleft()
        ticket = Ticket(slot, self._next_generation)
        self._next_generation += 1
        self._stamp(slot, 0, ticket.generation)
        return ticket

    def complete_layer(self, ticket: Ticket, layer: int) -> None:
        self._check(ticket)
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"layer {layer} outside [0, {self.num_layers})")
        self._stamp(ticket.slot, 1 + layer, ticket.generation)

    def fail(self, ticket: Ticket) -> None:
        """Mark every layer not yet complete as failed."""
        self._check(ticket)
        stamps = self._words[ticket.slot, 1:]
        for layer in np.flatnonzero(stamps != ticket.generation).tolist():
            self._stamp(ticket.slot, 1 + layer, -ticket.generation)

    def finish(self, ticket: Ticket) -> None:
        """Give the slot back; every layer must be complete or failed. The load's outcome
        goes to the log first: a waiter that finds the slot moved on reads it there."""
        self._check(ticket)
        stamps = self._words[ticket.slot, 1:]
        if not np.all(np.abs(stamps) == ticket.generation):
            raise InvalidArgument(f"ticket {ticket} still has layers in flight")
        landed = bool(np.all(stamps == ticket.generation))
        self._log[ticket.generation % self.log_words] = ticket.generation if landed else -ticket.generation
        self._free.append(ticket.slot)

    def _stamp(self, slot: int, word: int, value: int) -> None:
        self._words[slot, word] = value
        self._ring[slot, word] = value  # after the KV bytes: one aligned 8-byte store

    def _check(self, ticket: Ticket) -> None:
        if not 0 <= ticket.slot < self.num_slots or self._words[ticket.slot, 0] != ticket.generation:
            raise InvalidArgument(f"{ticket} is not a live ticket of this ring")

    def close(self) -> None:
        self._ring = self._log = None  # type: ignore[assignment]
        self.shared.close()


class LayerWaiter:
    """The engine's side: waits for layers of a ticket, on a read-only mapping of the
    ring (``fd``, taken over: closed here)."""

    def __init__(self, handle: CountersHandle, fd: int) -> None:
        self.handle = handle
        self._shared = SharedBuffer.attach(fd, handle.nbytes, writable=False, keep_fd=handle.writer_lock)
        self._words, self._log = _ring(self._shared.array, handle.num_slots, handle.num_layers, handle.log_words)
        self.events = CudaLayerEvents.open(handle) if handle.event_handles else None

    def holds(self, ticket: Ticket) -> bool:
        """Is ``ticket`` the load that has its slot of this ring now (a ticket of another
        ring, or of a load whose slot has moved on since, is not)?"""
        return 0 <= ticket.slot < self.handle.num_slots and int(self._words[ticket.slot, 0]) == ticket.generation

    def knows(self, ticket: Ticket) -> bool:
        """Is ``ticket`` a load of this ring that it can tell about: the one that has its
        slot now, or one that ended whose outcome its log still has?"""
        return self.holds(ticket) or self._outcome(ticket) is not None

    def is_done(self, ticket: Ticket, layer: int) -> bool:
        """Non-blocking: has ``layer`` of the ticket's load completed? A load whose slot
        has moved on is over: done if every layer landed, else :class:`LoadFailed` —
        :class:`StaleTicket` once the ring no longer remembers it."""
        return self._state(ticket, layer) != _PENDING

    def _state(self, ticket: Ticket, layer: int) -> int:
        if not 0 <= ticket.slot < self.handle.num_slots or not 0 <= layer < self.handle.num_layers:
            raise InvalidArgument(f"bad ticket {ticket} or layer {layer}")
        if int(self._words[ticket.slot, 0]) != ticket.generation:
            return self._ended(ticket)
        stamp = int(self._words[ticket.slot, 1 + layer])
        if stamp == ticket.generation:
            return _LANDED
        if stamp == -ticket.generation:
            raise LoadFailed(f"layer {layer} of load {ticket} failed")
        # Not done: unless the slot was reused between the two reads above.
        if int(self._words[ticket.slot, 0]) != ticket.generation:
            return self._ended(ticket)
        return _PENDING

    def _ended(self, ticket: Ticket) -> int:
        """The slot has moved on from the ticket's load: how it ended, from the log
        (read after the slot's word: ``finish`` wrote it before the slot went on)."""
        landed = self._outcome(ticket)
        if landed is None:
            raise StaleTicket(f"slot {ticket.slot} has moved on from generation {ticket.generation}, "
                              "which the ring no longer remembers")
        if not landed:
            raise LoadFailed(f"load {ticket} failed")
        return _OVER

    def _outcome(self, ticket: Ticket) -> bool | None:
        """Did the ticket's load land (every layer), per the log; ``None`` if the log has
        no word of it: still in its slot, too old, or not a load of this ring."""
        log, generation = self._log, ticket.generation
        if not len(log) or generation <= 0:
            return None
        word = int(log[generation % len(log)])
        return True if word == generation else False if word == -generation else None

    def wait_layer(self, ticket: Ticket, layer: int, *, timeout_s: float | None = None,
                   stream: Any = None) -> None:
        """Return once ``layer`` of the load is complete (CPU mode: poll). GPU mode: poll
        until the layer's event is recorded for this load — its copy enqueued on the
        daemon's stream, which the daemon's enqueuing thread does layer by layer while
        its answer goes out (a launch each: ~60 µs on an H200) — then make ``stream``
        wait on the event, without blocking the CPU. An
        event waited on before it was recorded for this load would hold its previous
        record (or none): the stream would not wait for this load's copy at all. A
        load that has ended (its slot moved on) is waited on no event: its copies have
        run, and the slot's events may be a later load's by now."""
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        probe_at = now + _PROBE_WRITER_S
        pause = 0.0
        while (state := self._state(ticket, layer)) == _PENDING:
            now = time.monotonic()
            if now >= probe_at:
                probe_at = now + _PROBE_WRITER_S
                if self.writer_gone() and not self.is_done(ticket, layer):
                    raise LoadFailed(f"layer {layer} of load {ticket} never landed: the daemon let go of its "
                                     "ring (it exited), so nothing writes it any more")
            if deadline is not None and now >= deadline:
                raise WaitTimeout(f"layer {layer} of load {ticket} not complete after {timeout_s} s")
            # Spin briefly, then back off up to 50 us: layers land every few hundred us.
            time.sleep(pause)
            pause = min(pause * 2 or 1e-6, 5e-5)
        if self.events is not None and state == _LANDED:
            self.events.wait(ticket, layer, stream)

    def writer_gone(self) -> bool:
        """Has the daemon let go of this ring — closed it, or exited — so that no load
        of it can land, or write its blocks, any more? Never, for a daemon that holds
        no lock on it (:attr:`CountersHandle.writer_lock`)."""
        fd = self._shared.fd
        if fd < 0:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (EWOULDBLOCK: held — or another engine's waiter probing now)
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        self._words = self._log = None  # type: ignore[assignment]
        self._shared.close()


class CudaLayerEvents:
    """A slot x layer grid of interprocess CUDA events."""

    def __init__(self, events: list[list[Any]], device: int, handles: tuple[bytes, ...] = ()) -> None:
        self._events = events
        self.device = device
        self._handles = handles

    @classmethod
    def create(cls, num_slots: int, num_layers: int, device: int) -> "CudaLayerEvents":
        """Events of ``device``. Torch creates a CUDA event lazily — on the device of its
        first record's stream, or on the current device at its first ``ipc_handle()`` —
        so the handles are taken here, with ``device`` current: taken later, on a thread
        whose current device is another, they would create the events there, and every
        record on ``device``'s copy stream would fail."""
        with torch.cuda.device(device):
            events = [[torch.cuda.Event(interprocess=True) for _ in range(num_layers)] for _ in range(num_slots)]
            handles = tuple(ev.ipc_handle() for row in events for ev in row)
        return cls(events, device, handles)

    @classmethod
    def open(cls, handle: CountersHandle) -> "CudaLayerEvents":
        """The daemon's events, on this process's index of their GPU."""
        index = local_device(handle.device, handle.device_uuid)
        device = torch.device("cuda", index)
        flat = [torch.cuda.Event.from_ipc_handle(device, h) for h in handle.event_handles]
        layers = handle.num_layers
        return cls([flat[s * layers : (s + 1) * layers] for s in range(handle.num_slots)], index,
                   tuple(handle.event_handles))

    def ipc_handles(self) -> tuple[bytes, ...]:
        return self._handles

    def record(self, ticket: Ticket, layer: int, stream: Any) -> None:
        self._events[ticket.slot][layer].record(stream)

    def wait(self, ticket: Ticket, layer: int, stream: Any = None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        stream.wait_event(self._events[ticket.slot][layer])
