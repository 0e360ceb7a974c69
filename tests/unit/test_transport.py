"""hicache's ZeroMQ transport settings (``transport.new_context``): the I/O thread of the
daemon's and the client's contexts runs SCHED_BATCH, unless the process was given a
policy of its own or may not use that one."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from daemon_util import io_threads
from hicache import transport

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")


def new_io_thread_policies(context: zmq.Context, endpoint: str) -> tuple[zmq.Socket, list[int]]:
    """Start the context's I/O thread (it starts with the first socket) and wait for it
    to name itself — libzmq's thread applies its policy, then its name, once running:
    the socket, and the policies of the I/O threads that appeared."""
    before = io_threads()
    sock = context.socket(zmq.DEALER)
    sock.connect(endpoint)
    deadline = time.monotonic() + 10
    while True:
        new = [policy for tid, policy in io_threads().items() if tid not in before]
        if new or time.monotonic() > deadline:
            return sock, new
        time.sleep(0.001)


def test_new_context_runs_its_io_thread_batch_and_nothing_else(tmp_path):
    endpoint = f"ipc://{tmp_path / 'transport.sock'}"
    ours, plain = transport.new_context(), zmq.Context()
    try:
        sock, policies = new_io_thread_policies(ours, endpoint)
        assert policies == [os.SCHED_BATCH]
        sock.close(linger=0)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread keeps its policy
        sock, policies = new_io_thread_policies(plain, endpoint)
        assert policies == [os.SCHED_OTHER]  # pyzmq's own contexts are left alone
        sock.close(linger=0)
    finally:
        ours.destroy(linger=0)
        plain.destroy(linger=0)


def test_a_process_on_another_policy_keeps_it_for_the_io_thread(tmp_path):
    script = f"""
import os, sys
sys.path[:0] = {sys.path!r}
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
from hicache import transport
from test_transport import new_io_thread_policies
context = transport.new_context()
sock, policies = new_io_thread_policies(context, "ipc://{tmp_path / 'transport.sock'}")
print(policies)
sock.close(linger=0)
context.term()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([os.SCHED_IDLE])


def test_a_process_not_allowed_batch_keeps_the_default(tmp_path, monkeypatch):
    """libzmq aborts the process when it cannot apply its I/O thread's policy (a seccomp
    filter forbidding sched_setscheduler): new_context tries first and leaves it."""
    def forbidden(*args):
        raise PermissionError(1, "Operation not permitted")

    transport._batch_allowed.cache_clear()
    monkeypatch.setattr(os, "sched_setscheduler", forbidden)
    context = transport.new_context()
    try:
        sock, policies = new_io_thread_policies(context, f"ipc://{tmp_path / 'transport.sock'}")
        assert policies == [os.SCHED_OTHER]
        sock.close(linger=0)
    finally:
        context.destroy(linger=0)
        monkeypatch.undo()
        transport._batch_allowed.cache_clear()
    assert transport._batch_allowed()
