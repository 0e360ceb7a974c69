"""Why a page is not cached: the tier it was last evicted from, remembered for a bounded
number of recent evictions, else ``never_stored``."""

from __future__ import annotations

from collections import OrderedDict

from hicache.keys import TOKEN_BYTES, NamespaceId, PageKey, chain_page_keys
from hicache.metrics import NullMetrics
from hicache.tree import MatchResult, Node, Tier

EVICTED_MEMORY = 1 << 18  # page keys remembered (~30 MiB at most)


class MissReasons:
    def __init__(self, metrics=None, memory: int = EVICTED_MEMORY) -> None:
        self.metrics = metrics if metrics is not None else NullMetrics()
        self._memory = memory
        self._evicted: OrderedDict[bytes, Tier] = OrderedDict()  # page key -> the tier it left last

    def evicted(self, node: Node, tier: Tier) -> None:
        """``node``'s pages are leaving ``tier``."""
        evicted = self._evicted
        for key in node.page_key_list():
            evicted[key] = tier
            evicted.move_to_end(key)
        while len(evicted) > self._memory:
            evicted.popitem(last=False)
        self.metrics.evicted(tier, node.num_pages)

    def reason(self, page_key: PageKey) -> str:
        """``evicted_<tier>`` if this page was evicted recently, else ``never_stored``."""
        tier = self._evicted.get(page_key)
        return f"evicted_{tier.label}" if tier is not None else "never_stored"

    def after(self, namespace: NamespaceId, tokens: bytes, match: MatchResult) -> str:
        """The reason for the first page after ``match`` (a match of the packed
        ``tokens``); ``never_stored`` for a partial page."""
        ps = match.page_size
        start = match.num_tokens * TOKEN_BYTES
        page = tokens[start : start + ps * TOKEN_BYTES]
        if len(page) < ps * TOKEN_BYTES or match.node is None:
            return "never_stored"
        return self.reason(chain_page_keys(namespace, match.node.last_page_key, page, ps))
