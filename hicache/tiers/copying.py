"""The copy-engine port: how a transfer's page copies run for one device pool.

* :class:`CpuCopy` — a CPU pool: the copies run on a transfer thread (itself spreading
  pages over the CPU copy threads); a load's layer is complete when its copies are done,
  and its counter is stamped right then.
* :class:`CudaCopy` — a CUDA pool: the copies are enqueued on the manager's stream for
  the device by a thread of that device's own, in the order they were asked for (one
  stream, one enqueuing thread: the stream runs them in that order, as when the owner
  thread enqueued them itself); each layer of a load is stamped on the counter ring as
  its CUDA event is recorded (the engine's stream then waits on that event); a transfer
  thread waits for the end. The owner thread only hands the copies over: its answer to
  a load goes out while they are enqueued (an engine's ``wait_layer`` polls for each
  layer's stamp), and it is not held while they are — measured on an H200, 32 Triton
  launches and the page-id checks kept it 2.9 ms per load, and the engine got its
  ticket only after them, while its first layer takes 0.7 ms on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from hicache.counters import LayerCounters, Ticket
from hicache.jobs import Completions, Workers

Done = Callable[[BaseException | None], None]


class CopyEngine(Protocol):
    timed: bool  # layer completions are stamped as they happen (first-layer latency is measurable)

    def run(self, enqueue: Callable[[], None], done: Done) -> None:
        """Run ``enqueue`` (which issues the copies) and call ``done(error)`` on the
        owner thread once they have all landed, or failed."""

    def layer_done(self, counters: LayerCounters, ticket: Ticket, layer: int) -> None:
        """``enqueue`` issued the last copy of ``layer`` for the load ``ticket``."""

    def load_done(self, counters: LayerCounters, ticket: Ticket, num_layers: int) -> None:
        """Every copy of the load landed."""

    def load_failed(self, counters: LayerCounters, ticket: Ticket) -> None:
        """``enqueue`` raised: fail the load's layers not landed if none of its copies
        can still run (an engine takes a failed ticket for a load that is over);
        otherwise the owner does once ``done`` says so."""


class CpuCopy:
    timed = True

    def __init__(self, workers: Workers) -> None:
        self._workers = workers

    def run(self, enqueue: Callable[[], None], done: Done) -> None:
        self._workers.copy(enqueue, lambda _, error: done(error))

    def layer_done(self, counters: LayerCounters, ticket: Ticket, layer: int) -> None:
        counters.complete_layer(ticket, layer)

    def load_done(self, counters: LayerCounters, ticket: Ticket, num_layers: int) -> None:
        pass

    def load_failed(self, counters: LayerCounters, ticket: Ticket) -> None:
        counters.fail(ticket)  # (the copies are synchronous, every copy thread's: none runs now)


class CudaCopy:
    timed = False

    def __init__(self, workers: Workers, completions: Completions, device: torch.device) -> None:
        self._workers = workers
        self._completions = completions
        self._stream = torch.cuda.Stream(device)
        self._enqueuer = ThreadPoolExecutor(1, thread_name_prefix=f"hicache-enqueue-{device}")

    def run(self, enqueue: Callable[[], None], done: Done) -> None:
        """Have the copies enqueued (on this device's enqueuing thread, after those asked
        for before); ``done(error)`` on the owner thread once the stream has run them —
        a failure to enqueue too, after what was enqueued before it (a load past its copy
        deadline: its engine takes a failed ticket for a load that is over, and reuses
        the blocks)."""
        self._enqueuer.submit(self._enqueue, enqueue, done)

    def _enqueue(self, enqueue: Callable[[], None], done: Done) -> None:
        failure: BaseException | None = None
        try:
            with torch.cuda.stream(self._stream):
                try:
                    enqueue()
                except BaseException as exc:  # noqa: BLE001 - reported through done(), after the stream
                    failure = exc
                finished = torch.cuda.Event()
                finished.record(self._stream)
        except BaseException as exc:  # noqa: BLE001 - the stream itself failed: nothing to wait for
            error = failure or exc
            self._completions.post(lambda: done(error))
            return
        try:
            self._workers.copy(finished.synchronize, lambda _, error: done(failure or error))
        except BaseException as exc:  # noqa: BLE001 - (no transfer thread: closed) said, not lost on this thread
            self._completions.post(lambda error=exc: done(failure or error))

    def layer_done(self, counters: LayerCounters, ticket: Ticket, layer: int) -> None:
        counters.events.record(ticket, layer, torch.cuda.current_stream())
        # Recorded for this load: the engine's stream may wait on the event now (before,
        # the stamps came once the stream had run the load, and an engine that waited
        # on a layer whose copy was never enqueued — a load cut short — waited on the
        # event's previous record, or on none).
        counters.complete_layer(ticket, layer)
        # Let the owner thread in between layers: a launch is mostly Python, and a thread
        # that gave the interpreter up (the loop, polling its sockets) gets it back only
        # when the holder lets go — else after the whole load's launches (~2 ms), or the
        # 5 ms switch interval. (A simulation of 32 launches: the other thread waited
        # 2.1 ms without this, 0.24 ms with it.)
        time.sleep(0)

    def load_done(self, counters: LayerCounters, ticket: Ticket, num_layers: int) -> None:
        pass  # (each layer was stamped as its event was recorded)

    def load_failed(self, counters: LayerCounters, ticket: Ticket) -> None:
        pass  # (layers enqueued before still run on the stream: the owner fails it after them)

    def close(self) -> None:
        """Once nothing is asked of it any more: the enqueuing thread ends after what it
        was given."""
        self._enqueuer.shutdown(wait=True)


class CopyEngines:
    """One copy engine per device: the CPU one, and a CUDA one per GPU (one stream each)."""

    def __init__(self, workers: Workers, completions: Completions) -> None:
        self._workers = workers
        self._completions = completions
        self._cpu = CpuCopy(workers)
        self._cuda: dict[torch.device, CudaCopy] = {}

    def for_device(self, device: torch.device) -> CopyEngine:
        if device.type != "cuda":
            return self._cpu
        if device not in self._cuda:
            self._cuda[device] = CudaCopy(self._workers, self._completions, device)
        return self._cuda[device]

    def close(self) -> None:
        for engine in self._cuda.values():
            engine.close()
