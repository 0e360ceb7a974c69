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
pages are noted (see ``CacheOps._claim``). Bounded per tenant: past :data:`MAX_ENTRIES`
namespaces of one tenant (a client storing under ever new extra keys) it stops
appending that tenant's, and says so once — the other tenants' are still kept (tenants
are named by the configuration, so the log is bounded too).

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
import zlib
from pathlib import Path

from collections import Counter

from hicache.config import check_name
from hicache.errors import InvalidArgument
from hicache.keys import PAGE_KEY_BYTES

logger = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # namespaces kept per tenant


class TenantLog:
    def __init__(self, path: Path | None, max_entries: int = MAX_ENTRIES, *, extra_keys: bool = True) -> None:
        """``path``: the log (``None``: nothing kept, no disk tier); ``max_entries``:
        namespaces kept per tenant; ``extra_keys``: hold the extra keys in memory too
        (only the KV events ask for them; the log keeps them either way)."""
        self.path = path
        self.max_entries = max_entries
        self._keeps_extra_keys = extra_keys
        self._by_spec: dict[bytes, dict[bytes, str]] = {}  # spec fingerprint -> namespace -> tenant
        self._extra_keys: dict[bytes, str] = {}  # namespace -> its extra key (namespaces that have one)
        self._entries: Counter = Counter()  # tenant -> namespaces kept
        self._full_said: set[str] = set()  # tenants whose namespaces are no longer kept (said once)
        self._file = None
        self._torn_at: int | None = None  # where the log's torn last line starts, if it has one
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
        whole = data.rfind(b"\n") + 1
        if whole < len(data):  # a line cut short: cut off before the next append
            self._torn_at = whole
            logger.warning("tenant log %s ends in a line cut short (%d bytes): skipped", path, len(data) - whole)
        skipped = 0
        for line in data[:whole].decode("utf-8", errors="replace").split("\n")[:-1]:
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
        ``tenant``'s: appended if new."""
        if self.path is None:
            return
        known = self._by_spec.get(fingerprint)
        if known is not None and known.get(namespace) == tenant:
            return
        if self._entries[tenant] >= self.max_entries:
            if tenant not in self._full_said:
                self._full_said.add(tenant)
                logger.warning("tenant log %s holds %d namespaces of tenant %s: no more of its are kept (after a "
                               "restart, pages of the others count as unattributed until their next request)",
                               self.path, self.max_entries, tenant)
            return
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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
