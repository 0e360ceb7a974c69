"""Sliding-window layers: what of an SWA layer's pages a hit needs, and what is dropped.

For an SWA layer, the token after a cached prefix of ``n`` pages attends back to
position ``n * page_size - window + 1`` only: a hit ending after ``n`` pages needs that
layer's bytes of its last :attr:`~hicache.spec.KVSpec.window_pages` pages (``W``), and
of no page before. The tree's node ends are the hit ends it knows (where inserts ended,
where paths branch, where checkpoints are), so:

* a backup (device -> host) copies the SWA layers' segments only for a node's last
  ``W`` pages; the pages before get the other layers only (the host page's SWA part is
  left as it was: never read). A disk write writes what the host copy holds: records of
  the pages without SWA bytes are the host page's first
  :attr:`~hicache.spec.KVSpec.kept_page_bytes` (the SWA segments come last);
* the tree records per node and slot from which page on its copy holds SWA bytes
  (:attr:`hicache.tree.Node.swa`, cut along with the node by a split). Device copies
  the engine computed hold all; one loaded from host or disk holds what its source did;
* a match ends at the deepest node end whose window — the last ``W`` pages before it,
  from wherever a load would take each page (the pool, host, disk) — has its SWA bytes
  (:meth:`Windows.usable`): a mid-edge end found later (a branch after a backup) may
  have lost them, and the hit falls back to an earlier end;
* after a restart, each page's record size tells whether it has its SWA bytes; nodes
  are cut where a run of such pages ends, so that each node's holds a suffix again.

Invariant (:meth:`Windows.check`): on host and disk, no node holds SWA bytes of a page
before its last ``W`` — pages outside every window are never backed up or written.
Device pages are the engine's: whole pages, all layers.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.spec import KVSpec
from hicache.tree import DISK_SLOT, HOST_SLOT, HiRadixTree, MatchResult, Node, swa_first


def cut_match(tree: HiRadixTree, result: MatchResult, pool_id: int, usable: Callable[[Node], bool]) -> MatchResult:
    """``result`` cut back to its deepest node for which ``usable(node)`` holds (nothing
    matched when none does), its parts counted again."""
    node = result.node
    if node is None or node.parent is None:
        return result
    end = node
    while end.parent is not None and not usable(end):
        end = end.parent
    if end is node:
        return result
    root = tree.root(node.namespace)
    if end is root:
        return MatchResult(root, root, root, b"", 0, 0, result.page_size)
    device: list[bytes] = []
    host = disk = 0
    last_device = last_host = root
    for n in tree.path(end):
        pages = n.residency.get(pool_id)
        if pages is not None:
            device.append(pages)
            last_device = last_host = n
        elif HOST_SLOT in n.residency:
            host += n.num_pages
            last_host = n
        else:
            disk += n.num_pages
    return MatchResult(end, last_device, last_host, b"".join(device), host, disk, result.page_size)


class Windows:
    """See the module docstring (a spec with SWA layers)."""

    def __init__(self, spec: KVSpec) -> None:
        self.pages = spec.window_pages  # W
        self.page_bytes = spec.host_page_bytes
        self.kept_bytes = spec.kept_page_bytes

    def first_backed_up(self, node: Node, source_first: int) -> int:
        """The first of ``node``'s pages whose SWA bytes a copy from a source holding
        them from ``source_first`` on keeps: its last ``W`` pages at most."""
        return max(source_first, node.num_pages - self.pages)

    def nbytes(self, num_pages: int, num_without_swa: int) -> int:
        """Bytes of ``num_pages`` host pages, ``num_without_swa`` of them without SWA."""
        return num_pages * self.page_bytes - num_without_swa * (self.page_bytes - self.kept_bytes)

    def usable(self, node: Node, pool_id: int) -> bool:
        """Has the window before ``node``'s end its SWA bytes, each page where a load for
        ``pool_id`` would take it from?"""
        need = self.pages
        n = node
        while need > 0 and n.parent is not None:
            take = min(need, n.num_pages)
            residency = n.residency
            slot = pool_id if pool_id in residency else HOST_SLOT if HOST_SLOT in residency else DISK_SLOT
            if swa_first(n, slot) > n.num_pages - take:
                return False
            need -= take
            n = n.parent
        return True

    def check(self, tree: HiRadixTree) -> None:
        """The invariant of the module docstring, and ``Node.swa`` only for slots the
        node is resident in, within its pages."""
        for node in tree.nodes():
            for slot, first in (node.swa or {}).items():
                assert slot in node.residency, (node, slot)
                assert 0 < first <= node.num_pages, (node, slot, first)
            for slot in (HOST_SLOT, DISK_SLOT):
                if slot in node.residency:
                    assert swa_first(node, slot) >= node.num_pages - self.pages, (
                        f"{node!r} holds SWA bytes of a page outside every window in slot {slot}")
