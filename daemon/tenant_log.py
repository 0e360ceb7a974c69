"""Which tenant each namespace belongs to, kept across restarts.

A namespace id is a hash of the model, the tenant and the extra key: the daemon cannot
tell a stored page's tenant from it. So that the disk tier's pages count as their
tenants' again after a restart (occupancy, space quotas) rather than as "unattributed"
until each tenant's next request, the daemon appends each namespace it first sees, with
its spec, tenant and extra key, to a small log next to the disk tier (``<store>/tenants``,
one line ``<spec fingerprint hex> <namespace hex> <tenant> <extra key> <crc32 hex>``, the
extra key as the hex of its UTF-8, ``-`` for none), reads it back at start, and names a
new tier manager's namespaces from it. The extra key goes with the restored pages' KV
events (a router indexes a LoRA's or a cache salt's blocks by it), which the namespace
id cannot give back either. Only namespaces that store
pages are noted (see ``CacheOps._claim``).

Bounded per tenant (``[disk].tenant_namespaces``, :data:`MAX_ENTRIES`): a client storing
under ever new extra keys (a cache salt per user) must not grow it for good, nor crowd
out the other tenants' (tenants are named by the configuration, so the log is bounded
too). A namespace whose pages are all gone (evicted, purged) needs no line: when a
tenant is at its bound the daemon *compacts* the log (:meth:`TenantLog.begin_compaction`,
:meth:`TenantLog.compact`) to the namespaces that still hold pages — found by a walk of
the store, and in the tier managers' trees — and those named in the :data:`GRACE_S`
before it began (a store under way may have no node yet). The namespaces noted at the
bound meanwhile wait for that (up to :data:`WAITING`), then are appended. The file is
rewritten beside the log, off the owner thread, and renamed over it: a crash meanwhile
leaves the old log, whole. A tenant whose namespaces *holding pages* pass the bound has
the rest unnamed after a restart (said once); compactions come at most every quarter of
the bound's notes, each a walk of the store.

A power loss may cut the last line short, and a cut tenant name is often another
tenant's (``team`` of ``team-a``): its quota would count the namespace's pages. So a
line counts only whole — ended by its newline, its checksum (of the text before it)
verified; a line that does not parse, or fails its checksum, is skipped. The torn end
of the file is cut off before the next append, which would otherwise join it (and be
lost with it, or end it with a newline). Lines of three fields (logs written before
the checksum) and of four (before the extra key) are read as before, their extra key
unknown.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hicache.config import check_name
from hicache.errors import InvalidArgument
from hicache.keys import PAGE_KEY_BYTES

logger = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # namespaces kept per tenant (the default of [disk].tenant_namespaces)
WAITING = 1 << 16  # namespaces noted at their tenant's bound, kept until the next compaction
GRACE_S = 60.0  # a namespace named this recently is kept by a compaction, pages or not

Key = tuple[bytes, bytes]  # (spec fingerprint, namespace)


class TenantLog:
    def __init__(self, path: Path | None, max_entries: int = MAX_ENTRIES, *, extra_keys: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``path``: the log (``None``: nothing kept, no disk tier); ``max_entries``:
        namespaces kept per tenant; ``extra_keys``: hold the extra keys in memory too
        (only the KV events ask for them; the log keeps them either way); ``clock``:
        when a namespace was named (see :data:`GRACE_S`)."""
        self._clock = clock
        self.path = path
        self.max_entries = max_entries
        self._keeps_extra_keys = extra_keys
        self._by_spec: dict[bytes, dict[bytes, str]] = {}  # spec fingerprint -> namespace -> tenant
        self._extra_keys: dict[bytes, str] = {}  # namespace -> its extra key (namespaces that have one)
        self._entries: Counter = Counter()  # tenant -> namespaces kept
        self._full_said: set[str] = set()  # tenants whose namespaces are no longer kept (said once)
        self._file = None
        self._torn_at: int | None = None  # where the log's torn last line starts, if it has one
        # Compaction (see the module's docstring): the namespaces noted at their tenant's
        # bound, waiting for one (key -> (tenant, extra key)); when each namespace was last
        # named (those of the last GRACE_S, at least); the notes since the last one (one
        # begins after max_entries // 4); a rewrite under way.
        self._waiting: dict[Key, tuple[str, str]] = {}
        self._named: dict[Key, float] = {}
        self._pruned = float("-inf")  # when _named was last pruned
        self._notes = 0
        self._compacting = False
        self._tried = False  # a compaction began since the start
        self._began = 0.0  # when the last one began (on the clock)
        self._rewrite: threading.Thread | None = None
        self._rewrite_cancelled = threading.Event()
        self.compactions = 0  # done since the start
        if path is not None:
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            logger.warning("cannot read the tenant log %s (%s): stored pages count as unattributed", path, exc)
            return
        whole = _whole(data)
        if len(whole) < len(data):  # a line cut short: cut off before the next append
            self._torn_at = len(whole)
            logger.warning("tenant log %s ends in a line cut short (%d bytes): skipped", path, len(data) - len(whole))
        skipped = 0
        for line in _lines(whole):
            entry = _parse(line)
            if entry is None:
                skipped += 1
                continue
            self._set(*entry)
        if skipped:
            logger.warning("tenant log %s: %d lines that do not parse or fail their checksum were skipped",
                           path, skipped)

    def _set(self, fingerprint: bytes, namespace: bytes, tenant: str, extra_key: str | None) -> None:
        known = self._by_spec.setdefault(fingerprint, {})
        old = known.get(namespace)
        if old is not None:
            self._entries[old] -= 1
        self._entries[tenant] += 1
        known[namespace] = tenant
        if extra_key and self._keeps_extra_keys:
            self._extra_keys[namespace] = extra_key

    def fingerprints(self) -> list[bytes]:
        """The specs whose namespaces it names."""
        return list(self._by_spec)

    def tenants_of(self, fingerprint: bytes) -> dict[bytes, str]:
        """Namespace -> tenant, of one spec."""
        return dict(self._by_spec.get(fingerprint, {}))

    def extra_key(self, namespace: bytes) -> str | None:
        """The extra key ``namespace`` was made with, if it has one and it is known
        (and kept: see ``extra_keys``). O(1)."""
        return self._extra_keys.get(namespace)

    def note(self, fingerprint: bytes, namespace: bytes, tenant: str, extra_key: str = "") -> None:
        """``namespace`` (of spec ``fingerprint``, made with ``extra_key``) is
        ``tenant``'s, and holds pages or is about to: appended if new; at ``tenant``'s
        bound, kept for after the next compaction. O(1) (called for each request that
        stores, or finds a namespace the tree holds)."""
        if self.path is None:
            return
        key = (fingerprint, namespace)
        now = self._clock()
        if key not in self._named and len(self._named) >= self.max_named and now - self._pruned >= 1.0:
            self._forget_named(now - GRACE_S)  # (at most once a second: O(named))
            self._pruned = now
        if key in self._named or len(self._named) < self.max_named:
            self._named[key] = now
        known = self._by_spec.get(fingerprint)
        if known is not None and known.get(namespace) == tenant:
            return
        if self._entries[tenant] >= self.max_entries:
            if key in self._waiting:
                return
            if len(self._waiting) < WAITING:
                self._waiting[key] = (tenant, extra_key)
                self._notes += 1
            elif tenant not in self._full_said:
                self._full_said.add(tenant)
                logger.warning("tenant log %s holds %d namespaces of tenant %s that hold pages: no more of its are "
                               "kept (after a restart, pages of the others count as unattributed until their next "
                               "request, and a purge of the tenant alone does not find them)",
                               self.path, self.max_entries, tenant)
            return
        self._notes += 1
        self._append(fingerprint, namespace, tenant, extra_key)

    def _append(self, fingerprint: bytes, namespace: bytes, tenant: str, extra_key: str) -> None:
        self._set(fingerprint, namespace, tenant, extra_key)
        try:
            if self._file is None:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                if self._torn_at is not None:
                    os.ftruncate(fd, self._torn_at)
                    self._torn_at = None
                self._file = os.fdopen(fd, "a", encoding="utf-8")
            text = f"{fingerprint.hex()} {namespace.hex()} {tenant} {extra_key.encode().hex() or '-'}"
            self._file.write(f"{text} {_checksum(text)}\n")
            self._file.flush()
        except OSError as exc:
            logger.warning("cannot append to the tenant log %s: %s", self.path, exc)

    # -- compaction ---------------------------------------------------------------------

    @property
    def max_named(self) -> int:
        """Namespaces named lately whose time it keeps, at most (more than that in
        :data:`GRACE_S`: the others' are not, and a compaction may drop them)."""
        return self.max_entries + WAITING

    def _forget_named(self, before: float) -> None:
        self._named = {key: at for key, at in self._named.items() if at >= before}

    @property
    def wants_compaction(self) -> bool:
        """A tenant is at its bound with namespaces waiting, and enough was noted since
        the last compaction (none under way)."""
        return (bool(self._waiting) and not self._compacting
                and (not self._tried or self._notes >= max(1, self.max_entries // 4)))

    def begin_compaction(self) -> dict[bytes, set[bytes]]:
        """A compaction begins: the namespaces the log names and those waiting, per spec
        fingerprint, for a walk of the store to tell which hold pages (those noted from
        now on are kept whatever :meth:`compact` is given: named lately)."""
        self._compacting = self._tried = True
        self._began = self._clock()
        wanted = {fingerprint: set(known) for fingerprint, known in self._by_spec.items()}
        for fingerprint, namespace in self._waiting:
            wanted.setdefault(fingerprint, set()).add(namespace)
        return wanted

    def abandon_compaction(self) -> None:
        """The walk failed: nothing is dropped (the next compaction tries again)."""
        self._compacting = False
        self._notes = 0

    def compact(self, holding: set[Key], post: Callable[[Callable[[], None]], None]) -> int:
        """Keep the namespaces in ``holding`` (those that hold pages: in the store, in a
        tree) or named since :data:`GRACE_S` before the compaction began (a namespace
        noted during it among them); the others are forgotten now and
        their lines dropped by a rewrite of the file on a thread of its own, renamed
        over the log by ``post`` (which runs a callable on the owner thread) — lines
        appended meanwhile go with it. Then the namespaces waiting are noted, as room
        allows (those that hold no page and were not named lately are let go). How many
        namespaces were dropped from the log."""
        dropped: set[Key] = set()
        self._forget_named(self._began - GRACE_S)
        for fingerprint, known in self._by_spec.items():
            for namespace in [ns for ns in known if (fingerprint, ns) not in holding
                              and (fingerprint, ns) not in self._named]:
                self._entries[known.pop(namespace)] -= 1
                self._extra_keys.pop(namespace, None)
                dropped.add((fingerprint, namespace))
        self._by_spec = {fp: known for fp, known in self._by_spec.items() if known}
        self._notes = 0
        self.compactions += 1
        self._full_said = {t for t in self._full_said if self._entries[t] >= self.max_entries}
        if dropped:
            self._start_rewrite(dropped, post)
        else:
            self._compacting = False
        for key, (tenant, extra_key) in list(self._waiting.items()):
            if key not in holding and key not in self._named:  # (its pages went while it waited)
                del self._waiting[key]
            elif self._entries[tenant] < self.max_entries:
                del self._waiting[key]
                self._append(*key, tenant, extra_key)
        logger.info("tenant log %s compacted: %d namespaces that hold no page dropped, %d kept, %d waiting",
                    self.path, len(dropped), sum(self._entries.values()), len(self._waiting))
        return len(dropped)

    def _start_rewrite(self, dropped: set[Key], post: Callable[[Callable[[], None]], None]) -> None:
        try:
            if self._file is not None:
                self._file.flush()
            upto = self.path.stat().st_size
        except OSError as exc:
            logger.warning("cannot compact the tenant log %s: %s", self.path, exc)
            self._compacting = False
            return
        if self._torn_at is not None:
            upto = min(upto, self._torn_at)
        temp = self.path.with_name(self.path.name + ".compact")
        cancelled = self._rewrite_cancelled

        def rewrite() -> None:
            try:
                _rewrite(self.path, temp, upto, dropped)
            except OSError as exc:
                error: OSError | None = exc
            else:
                error = None
            if not cancelled.is_set():
                post(lambda: self._finish_rewrite(temp, upto, error))

        self._rewrite = threading.Thread(target=rewrite, name="hicache-tenant-log", daemon=True)
        self._rewrite.start()

    def _finish_rewrite(self, temp: Path, upto: int, error: OSError | None) -> None:
        """On the owner thread: the lines appended since the rewrite began follow it,
        and it replaces the log."""
        self._rewrite = None
        self._compacting = False
        if self._rewrite_cancelled.is_set():
            return
        try:
            if error is not None:
                raise error
            if self._file is not None:
                self._file.close()
                self._file = None
            with open(self.path, "rb") as old:
                old.seek(upto)
                tail = old.read()
            tail = _whole(tail)  # (a torn line past the rewrite: left out)
            with open(temp, "ab") as new:
                new.write(tail)
                new.flush()
                os.fsync(new.fileno())
            os.replace(temp, self.path)
            _fsync_dir(self.path.parent)
            self._torn_at = None
        except OSError as exc:  # the old log stays: it names more than it must, nothing less
            logger.warning("cannot rewrite the tenant log %s: %s", self.path, exc)
            temp.unlink(missing_ok=True)

    def close(self) -> None:
        """(A rewrite under way is left: its file is removed, the log stays as it is.)"""
        self._rewrite_cancelled.set()
        rewrite, self._rewrite = self._rewrite, None
        if rewrite is not None:
            rewrite.join()
            self.path.with_name(self.path.name + ".compact").unlink(missing_ok=True)
        if self._file is not None:
            self._file.close()
            self._file = None


def _rewrite(path: Path, temp: Path, upto: int, dropped: set[Key]) -> None:
    """The log's first ``upto`` bytes into ``temp``, but the lines of ``dropped`` and
    those that do not parse (torn, damaged), fsynced."""
    with open(path, "rb") as old:
        data = old.read(upto)
    kept = []
    for line in _lines(_whole(data)):
        entry = _parse(line)
        if entry is not None and (entry[0], entry[1]) not in dropped:
            kept.append(line + "\n")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as new:
        new.writelines(kept)
        new.flush()
        os.fsync(new.fileno())


def _whole(data: bytes) -> bytes:
    """``data`` up to its last newline: its whole lines."""
    return data[: data.rfind(b"\n") + 1]


def _lines(whole: bytes) -> list[str]:
    return whole.decode("utf-8", errors="replace").split("\n")[:-1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checksum(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _parse(line: str) -> tuple[bytes, bytes, str, str | None] | None:
    """``(spec fingerprint, namespace, tenant, extra key)`` of a whole line; ``None`` for
    one that does not parse or fails its checksum (a line of three fields has none:
    written before the checksum was; one of three or four fields no extra key: written
    before it was kept)."""
    parts = line.split(" ")
    if len(parts) in (4, 5):
        text, checksum = line.rpartition(" ")[::2]
        if checksum != _checksum(text):
            return None
    elif len(parts) != 3:
        return None
    extra_key = None
    try:
        fingerprint, namespace, tenant = bytes.fromhex(parts[0]), bytes.fromhex(parts[1]), parts[2]
        check_name("tenant", tenant)
        if len(parts) == 5 and parts[3] != "-":
            extra_key = bytes.fromhex(parts[3]).decode("utf-8")
    except (ValueError, InvalidArgument):
        return None
    if len(namespace) != PAGE_KEY_BYTES or not fingerprint:
        return None
    return fingerprint, namespace, tenant, extra_key
