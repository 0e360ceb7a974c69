"""The CUDA copy engine's contract, on fake streams and events (no GPU needed): copies
are enqueued off the caller's thread — the daemon's loop answers a load while they are
— by one thread, in the order asked for (the stream runs them in that order), each
followed by its end's event; ``done`` comes on the owner thread, in the same order, a
failed enqueue's too; ``close`` returns once what it was given is enqueued."""

import threading

import pytest
import torch

from hicache.jobs import Completions, Workers
from hicache.tiers.copying import CopyEngines, CudaCopy

GUARD_S = 30  # (a deadlock guard only: nothing here is timed)


class _FakeCuda:
    """torch.cuda's Stream / stream / Event / current_stream, logging what each thread
    puts on which stream."""

    def __init__(self) -> None:
        self.log: list[tuple] = []  # (what, stream name, thread)
        self._current = threading.local()
        fake = self

        class Stream:
            count = 0

            def __init__(self, device=None) -> None:
                Stream.count += 1
                self.name = f"stream{Stream.count}"

        class Event:
            def record(self, stream=None) -> None:
                fake.log.append(("end", stream.name, threading.current_thread()))

            def synchronize(self) -> None:
                pass

        class StreamContext:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self):
                fake._current.stream = self.stream

            def __exit__(self, *exc) -> None:
                fake._current.stream = None

        self.Stream, self.Event, self.stream = Stream, Event, StreamContext

    def current_stream(self, device=None):
        return getattr(self._current, "stream", None)

    def install(self, monkeypatch) -> None:
        for name in ("Stream", "Event", "stream", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


@pytest.fixture
def cuda(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def parts():
    completions = Completions()
    workers = Workers(completions)
    yield completions, workers
    workers.close()


def _drain(completions: Completions, done: list, count: int) -> None:
    while len(done) < count:
        assert completions.drain(timeout_s=GUARD_S), f"only {len(done)} of {count} copies ended"


def test_copies_are_enqueued_off_the_callers_thread_in_order_and_end_in_order(cuda, parts):
    completions, workers = parts
    engine = CudaCopy(workers, completions, torch.device("cuda", 0))
    gate = threading.Event()
    done: list[tuple[int, BaseException | None, threading.Thread]] = []

    def enqueue(i: int):
        def run() -> None:
            if i == 0:
                gate.wait(GUARD_S)  # the first copy holds its thread until the caller has moved on
            stream = torch.cuda.current_stream()
            cuda.log.append((f"copy{i}", stream.name if stream else None, threading.current_thread()))
            if i == 2:
                raise ValueError("copy 2 cannot be enqueued")
        return run

    try:
        for i in range(5):
            engine.run(enqueue(i), lambda error, i=i: done.append((i, error, threading.current_thread())))
        # Every run() returned with nothing enqueued yet: the caller (the daemon's loop)
        # answers meanwhile. (Before, run() enqueued on the caller's thread.)
        assert cuda.log == []
        gate.set()
        _drain(completions, done, 5)
    finally:
        engine.close()
    main = threading.current_thread()
    stream = engine._stream.name
    # One enqueuing thread, not the caller's, each copy on the engine's stream and
    # followed there by its end's event — the failed one's too (what it enqueued before
    # failing still runs on the stream).
    threads = {thread for _, _, thread in cuda.log}
    assert len(threads) == 1 and main not in threads
    assert [(what, on) for what, on, _ in cuda.log] == [
        (what, stream) for i in range(5) for what in (f"copy{i}", "end")]
    # done on the owner thread (the one draining), in order, the failure reported.
    assert [i for i, _, _ in done] == [0, 1, 2, 3, 4]
    assert all(thread is main for _, _, thread in done)
    errors = {i: error for i, error, _ in done}
    assert isinstance(errors[2], ValueError) and all(errors[i] is None for i in (0, 1, 3, 4))


def test_close_returns_once_every_copy_given_is_enqueued(cuda, parts):
    completions, workers = parts
    engines = CopyEngines(workers, completions)
    engine = engines.for_device(torch.device("cuda", 0))
    assert engines.for_device(torch.device("cuda", 0)) is engine
    assert engines.for_device(torch.device("cpu")) is not engine
    gate = threading.Event()
    done: list[BaseException | None] = []

    def slow() -> None:
        gate.wait(GUARD_S)
        cuda.log.append(("slow", None, None))

    engine.run(slow, done.append)
    engine.run(lambda: cuda.log.append(("after", None, None)), done.append)
    closer = threading.Thread(target=engines.close)
    closer.start()
    gate.set()
    closer.join(GUARD_S)
    assert not closer.is_alive()
    assert [what for what, _, _ in cuda.log] == ["slow", "end", "after", "end"]
    _drain(completions, done, 2)
    assert done == [None, None]
    with pytest.raises(RuntimeError):  # (nothing is enqueued after close)
        engine.run(lambda: None, done.append)


def test_a_copy_whose_end_cannot_be_waited_for_is_reported_not_lost(cuda):
    """The transfer thread is gone (its pool shut down): the copy's ``done`` still
    comes, with the error — a transfer never ended would keep a flush waiting."""
    completions = Completions()
    workers = Workers(completions)
    engine = CudaCopy(workers, completions, torch.device("cuda", 0))
    workers.close()
    done: list[BaseException | None] = []
    try:
        engine.run(lambda: None, done.append)
        _drain(completions, done, 1)
    finally:
        engine.close()
    assert isinstance(done[0], RuntimeError)
