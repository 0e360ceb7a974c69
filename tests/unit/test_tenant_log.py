"""The tenant log's compaction (:mod:`hicache.daemon.tenant_log`): at a tenant's bound
the namespaces that hold no page, and were not named lately, are dropped — from memory
at once, from the file by a rewrite on a thread renamed over it — and those waiting at
the bound are noted; nothing appended meanwhile is lost, and a rewrite cut short leaves
the old log."""

from __future__ import annotations

from hicache.daemon.tenant_log import GRACE_S, TenantLog
from hicache.keys import namespace_id
from tiers_util import SPEC

FP = SPEC.fingerprint
OTHER_FP = bytes(reversed(FP))


def ns(tenant: str, key: str, fp: bytes = FP) -> bytes:
    return namespace_id(fp, key, tenant)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Posted(list):
    """What the log asks to run on the owner thread, run when the test says."""

    def __call__(self, fn) -> None:
        self.append(fn)

    def run(self, log: TenantLog) -> None:
        if log._rewrite is not None:
            log._rewrite.join()
        while self:
            self.pop(0)()


def lines(log: TenantLog) -> list[str]:
    return log.path.read_text().splitlines()


def test_a_compaction_keeps_what_holds_pages_or_was_named_lately_and_then_notes_what_waited(tmp_path):
    clock, posted = Clock(), Posted()
    log = TenantLog(tmp_path / "tenants", max_entries=3, clock=clock)
    a0, a1, a2, a3, a4 = (ns("a", f"k{i}") for i in range(5))
    b0, other = ns("b", "k0"), ns("b", "k0", OTHER_FP)
    for namespace in (a0, a1, a2):
        log.note(FP, namespace, "a", namespace.hex()[:6])
    log.note(FP, b0, "b")
    log.note(OTHER_FP, other, "b")  # (a namespace of another spec)
    assert not log.wants_compaction
    clock.now = 10 * GRACE_S
    log.note(FP, a3, "a", "k3")  # at the bound: waits
    assert log.tenants_of(FP) == {a0: "a", a1: "a", a2: "a", b0: "b"} and log.wants_compaction
    wanted = log.begin_compaction()
    assert wanted[FP] == {a0, a1, a2, b0, a3} and wanted[OTHER_FP] == {other}  # (a3: waiting)
    assert not log.wants_compaction  # (one at a time)
    log.note(FP, a1, "a", a1.hex()[:6])  # named during the walk: kept, pages or not
    log.note(FP, a4, "a", "k4")  # waits too
    before = len(lines(log))

    dropped = log.compact({(FP, a0)}, posted)  # (the walk found a0's records only)

    assert dropped == 3  # a2, b0 and the other spec's: no page, not named lately
    assert log.tenants_of(FP) == {a0: "a", a1: "a", a3: "a"} and log.tenants_of(OTHER_FP) == {}
    assert log.extra_key(a3) == "k3" and log.extra_key(a2) is None
    assert len(lines(log)) == before + 1  # a3 appended to the old log until the rewrite lands
    # a4 still waits (a is at its bound with what holds pages); the next compaction comes
    # after a quarter of the bound's notes (here one), not at once
    assert not log.wants_compaction
    log.note(FP, ns("c", "x"), "c")  # appended while the rewrite runs: goes with it
    assert not log.wants_compaction  # (the rewrite has not landed)
    posted.run(log)
    assert not (tmp_path / "tenants.compact").exists()
    again = TenantLog(tmp_path / "tenants", max_entries=3)
    assert again.tenants_of(FP) == {a0: "a", a1: "a", a3: "a", ns("c", "x"): "c"}
    assert again.fingerprints() == [FP]
    assert [again.extra_key(n) for n in (a0, a3)] == [a0.hex()[:6], "k3"]
    assert len(lines(again)) == 4
    assert log.wants_compaction and log._waiting == {(FP, a4): ("a", "k4")}
    log.close()


def _at_the_bound(path):
    """A log of tenant a's namespaces k0 and k1 (its bound), and k2 noted long after
    them, waiting."""
    clock = Clock()
    log = TenantLog(path, max_entries=2, clock=clock)
    names = [ns("a", f"k{i}") for i in range(3)]
    log.note(FP, names[0], "a")
    log.note(FP, names[1], "a")
    clock.now = 2 * GRACE_S
    log.note(FP, names[2], "a")
    return log, names


def test_a_namespace_dropped_that_holds_pages_again_is_noted_again(tmp_path):
    path, posted = tmp_path / "tenants", Posted()
    log, (a0, a1, a2) = _at_the_bound(path)
    log.begin_compaction()
    assert log.compact(set(), posted) == 2  # (a2 waited: named, kept, appended)
    posted.run(log)
    assert TenantLog(path).tenants_of(FP) == {a2: "a"}
    log.note(FP, a0, "a")  # a0 stores pages again
    log.close()
    assert TenantLog(path).tenants_of(FP) == {a0: "a", a2: "a"}


def test_a_namespace_that_waited_and_holds_no_page_any_more_is_let_go(tmp_path):
    path, posted = tmp_path / "tenants", Posted()
    log, (a0, a1, a2) = _at_the_bound(path)
    log._clock.now += 2 * GRACE_S  # (a2 waited long: its pages went meanwhile)
    log.begin_compaction()
    assert log.compact({(FP, a0)}, posted) == 1  # (a1: no page)
    posted.run(log)
    assert log.tenants_of(FP) == {a0: "a"} and not log._waiting
    log.close()
    assert TenantLog(path).tenants_of(FP) == {a0: "a"}


def test_a_rewrite_that_does_not_land_leaves_the_old_log_and_its_appends(tmp_path):
    """The daemon stops while the rewrite runs (or the machine goes down before the
    rename): the log is the old one with what was appended since — it names more
    namespaces than it must, none fewer — and no rewritten file lies beside it."""
    path, posted = tmp_path / "tenants", Posted()
    log, (a0, a1, a2) = _at_the_bound(path)
    log.begin_compaction()
    log.compact({(FP, a1)}, posted)
    log.note(FP, ns("b", "x"), "b")
    log.close()  # (before the owner thread renames the rewrite over the log)
    posted.run(log)
    assert not (tmp_path / "tenants.compact").exists()
    assert TenantLog(path).tenants_of(FP) == {a0: "a", a1: "a", a2: "a", ns("b", "x"): "b"}


def test_a_failed_walk_drops_nothing_and_a_torn_log_is_compacted_whole(tmp_path):
    clock, posted = Clock(), Posted()
    path = tmp_path / "tenants"
    log = TenantLog(path, max_entries=2, clock=clock)
    a0, a1, a2 = (ns("a", f"k{i}") for i in range(3))
    log.note(FP, a0, "a")
    log.note(FP, a1, "a")
    log.close()
    path.write_bytes(path.read_bytes() + b"0123 torn")  # a power loss mid-append
    clock.now = 2 * GRACE_S
    log = TenantLog(path, max_entries=2, clock=clock)
    log.note(FP, a2, "a")
    log.begin_compaction()
    log.abandon_compaction()  # (the store could not be walked)
    assert log.tenants_of(FP) == {a0: "a", a1: "a"} and not log.wants_compaction
    log.note(FP, ns("b", "x"), "b")  # (a quarter of the bound's notes later: again)
    assert log.wants_compaction
    log.begin_compaction()
    assert log.compact({(FP, a0)}, posted) == 1
    posted.run(log)
    assert path.read_bytes().endswith(b"\n") and b"torn" not in path.read_bytes()
    assert TenantLog(path).tenants_of(FP) == {a0: "a", a2: "a", ns("b", "x"): "b"}
    log.close()


def test_what_waits_at_the_bound_is_bounded(tmp_path, monkeypatch, caplog):
    import hicache.daemon.tenant_log as tenant_log

    monkeypatch.setattr(tenant_log, "WAITING", 3)
    log = TenantLog(tmp_path / "tenants", max_entries=1)
    for i in range(10):
        log.note(FP, ns("a", f"k{i}"), "a")
    assert len(log._waiting) == 3
    assert sum("no more of its are kept" in r.getMessage() for r in caplog.records) == 1
    log.close()
