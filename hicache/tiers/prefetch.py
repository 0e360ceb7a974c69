"""Answering a match after its prefetch: once every disk read of its path has landed,
or, under the ``timeout`` prefetch policy, after the timeout if that comes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.tiers.policies import PrefetchPolicy
from hicache.tiers.timers import Timers
from hicache.tiers.transfers import Transfer

if TYPE_CHECKING:
    from hicache.tiers.remote import Fetch


def answer_after(reads: list[Transfer | Fetch], answer: Callable[[], None], policy: PrefetchPolicy,
                 timers: Timers) -> None:
    """Call ``answer`` when ``reads`` (disk reads, remote fetches) are done (at once if there are none) or at the
    policy's timeout; ``answer`` may be called twice and must ignore the second call."""
    if not reads:
        answer()
        return
    remaining = [len(reads)]

    def one_done() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            answer()

    for transfer in reads:
        transfer.waiters.append(one_done)
    if policy.timeout_s is not None:
        timers.add(policy.timeout_s, answer)
