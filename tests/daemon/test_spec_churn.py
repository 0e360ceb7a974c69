"""KV specs come and go (:mod:`hicache.daemon.specs`): a spec no engine uses is let go
when another needs room — at once if it caches nothing, at ``[server].max_specs`` if
all it caches is on disk (and its pages come back at its next registration) — and past
the limit with nothing to let go, a new spec is ``RESOURCE_EXHAUSTED``."""

from __future__ import annotations

import os

import pytest

from daemon_util import ClientEngine, DaemonProcess, RawPeer
from hicache import protocol as p
from hicache.errors import ErrorCode
from hicache.spec import KVSpec
from tiers_util import SPEC, Engine

PS = SPEC.page_size
SEQ = list(range(700, 700 + 4 * PS))


def _spec(model: str) -> KVSpec:
    return KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, model=model)


def _num_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _register(raw: RawPeer, spec: KVSpec) -> tuple[int, Engine, p.Reply]:
    engine = Engine(8, spec)
    session = raw.hello()
    handle = engine.exported.handle
    return session, engine, raw.register(session, [handle.to_dict() | {"token": raw.offer(handle.fd)}], spec=spec)


def _num_specs(raw: RawPeer) -> int:
    return len(raw.call(p.Stats(id=0)).stats.specs)


def _start(tmp_path, **sections) -> DaemonProcess:
    # Long leases: the raw sessions here send no heartbeats.
    server = {"lease_s": 60.0, "register_within_s": 60.0, **sections.pop("server", {})}
    return DaemonProcess(tmp_path, server=server, **sections).start()


def _stop(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0, daemon.log.read_text()[-3000:]
    log = daemon.log.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def test_specs_registered_and_left_do_not_accumulate(tmp_path):
    """Eighty new model names, each registered and left without caching anything (more
    than max_specs): every registration succeeds, and the daemon keeps tiers (threads,
    host pools) for one or two specs, not eighty."""
    daemon = _start(tmp_path)
    raw = RawPeer(daemon.endpoint)
    try:
        victim = ClientEngine(daemon.endpoint)
        victim.prefill(SEQ)
        threads = _num_threads(daemon.proc.pid)
        for i in range(80):
            session, engine, reply = _register(raw, _spec(f"churn-{i}"))
            assert isinstance(reply, p.RegisterReply), reply
            assert isinstance(raw.call(p.Bye(id=0, session=session)), p.Ok)
            engine.close()
        assert _num_specs(raw) <= 3  # the victim's, the last one left, and room for one more
        assert _num_threads(daemon.proc.pid) - threads < 16
        again = victim.client.match(SEQ)
        assert again.num_device_pages == 4
        victim.engine.check(victim.ns(), SEQ, again.device_pages)
        victim.close()
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
    finally:
        raw.close()
        _stop(daemon)


def test_past_max_specs_a_new_spec_waits_for_one_to_be_unused(tmp_path):
    daemon = _start(tmp_path, server={"max_specs": 2})
    raw = RawPeer(daemon.endpoint)
    engines = []
    try:
        x, engine, reply = _register(raw, _spec("x"))
        engines.append(engine)
        assert isinstance(reply, p.RegisterReply)
        y, engine, reply = _register(raw, _spec("y"))
        engines.append(engine)
        assert isinstance(reply, p.RegisterReply)
        z, engine, refused = _register(raw, _spec("z"))
        engines.append(engine)
        assert isinstance(refused, p.Error) and refused.code == ErrorCode.RESOURCE_EXHAUSTED, refused
        assert "max_specs" in refused.message
        raw.call(p.Bye(id=0, session=y))
        handle = engine.exported.handle
        reply = raw.register(z, [handle.to_dict() | {"token": raw.offer(handle.fd)}], spec=_spec("z"))
        assert isinstance(reply, p.RegisterReply), reply  # (y's tiers, caching nothing, were let go)
        assert _num_specs(raw) == 2
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
    finally:
        for engine in engines:
            engine.close()
        raw.close()
        _stop(daemon)


def test_a_spec_whose_pages_are_on_disk_is_let_go_and_comes_back(tmp_path):
    """At the limit, an unused spec whose pages are all on disk makes room; its engine,
    back, finds its pages (rebuilt from the store) byte-exact."""
    daemon = _start(tmp_path, server={"max_specs": 1})
    raw = RawPeer(daemon.endpoint)
    try:
        first = ClientEngine(daemon.endpoint)
        first.prefill(SEQ)
        assert isinstance(raw.call(p.Flush(id=0)), p.FlushReply)  # (written through to disk)
        first.close()
        other, engine, reply = _register(raw, _spec("other"))
        assert isinstance(reply, p.RegisterReply), reply
        assert _num_specs(raw) == 1
        raw.call(p.Bye(id=0, session=other))
        engine.close()
        back = ClientEngine(daemon.endpoint)
        m, _, _ = back.prefill(SEQ)  # match, lock, load — every page's bytes checked
        assert m.num_disk_pages + m.num_host_pages == 4 and m.num_device_pages == 0, m
        back.close()
        assert isinstance(raw.call(p.Check(id=0)), p.Ok)
    finally:
        raw.close()
        _stop(daemon)


def test_a_spec_with_pages_in_memory_only_is_kept(tmp_path):
    """Without a disk tier an unused spec's host pages are all there is of them: it is
    kept (a new spec past the limit is refused), and its engine, back, hits them."""
    daemon = _start(tmp_path, server={"max_specs": 1}, disk={"enabled": False})
    raw = RawPeer(daemon.endpoint)
    try:
        first = ClientEngine(daemon.endpoint)
        first.prefill(SEQ)
        first.close()
        _, engine, refused = _register(raw, _spec("other"))
        engine.close()
        assert isinstance(refused, p.Error) and refused.code == ErrorCode.RESOURCE_EXHAUSTED, refused
        back = ClientEngine(daemon.endpoint)
        m, _, _ = back.prefill(SEQ)
        assert m.num_host_pages == 4, m
        back.close()
    finally:
        raw.close()
        _stop(daemon)


@pytest.mark.parametrize("bad", [0, -1])
def test_max_specs_must_be_positive(bad):
    from hicache.config import DaemonConfig
    from hicache.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        DaemonConfig.from_dict({"server": {"max_specs": bad}})
