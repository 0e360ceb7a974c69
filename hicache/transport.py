"""hicache's ZeroMQ transport settings, shared by the daemon and its clients: a context
whose I/O thread does not preempt the thread that queued a message, and a frame send
without pyzmq's Python wrapper. The messages themselves are :mod:`hicache.protocol`."""

from __future__ import annotations

import functools
import os
import threading

import zmq
import zmq.backend

# ``send_frame(socket, data, flags)``: pyzmq's ``Socket.send`` is a Python wrapper (for
# draft sockets' routing ids and groups) around its backend's, which this calls directly —
# one Python frame less for every frame sent on the request path.
send_frame = zmq.backend.Socket.send


def new_context() -> zmq.Context:
    """A ZeroMQ context whose I/O thread runs ``SCHED_BATCH`` (Linux).

    Queuing a message wakes the I/O thread, and an ordinary thread woken on the core of
    the one that queued it preempts it there: the daemon's owner thread midway through
    sending a reply (half of all replies on a 2-core VM, ~20 us each), an engine right
    after sending its request. A batch thread does not preempt on waking — it runs once
    that thread blocks in its receive a few microseconds later, or at once on an idle
    core — and still gets its fair share of the CPU. bench_rpc: a match's p50 went from
    1.21-1.48x to 1.02-1.29x a plain REQ/REP echo (an echo on these settings gains as
    much: see the README).

    Only for a process on the default policy (one an operator gave another, systemd's
    ``CPUSchedulingPolicy=``, keeps it for the I/O thread too) and allowed to use it.
    """
    context = zmq.Context()
    if os.name == "posix" and hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) == os.SCHED_OTHER \
            and _batch_allowed():
        try:
            context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        except (AttributeError, zmq.ZMQError):  # a libzmq without the option: the default
            pass
    return context


@functools.cache
def _batch_allowed() -> bool:
    """Whether a thread of this process may switch to ``SCHED_BATCH``, tried on a
    short-lived thread of its own: libzmq aborts the whole process when applying its
    I/O threads' policy fails (a seccomp filter that forbids ``sched_setscheduler``)."""
    allowed = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            allowed.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="hicache-sched-probe")
    thread.start()
    thread.join()
    return bool(allowed)
