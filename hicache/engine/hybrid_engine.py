"""The hybrid reference engine: :class:`~hicache.engine.hybrid_reference.HybridTransformer`
on a paged KV pool with a state region, talking to hicache like a real engine would
(issue 20), or with caching disabled.

Per request it takes a row of a :class:`~hicache.engine.req_to_token.HybridReqToTokenPool`
(token slots, and a state slot in the pool's state region for the linear layer), then:

1. matches the prompt but its last token (which must be computed: its logits start
   decoding), locks the hit and loads it with the request's state slot: the daemon
   copies the hit's checkpoint there before any layer. A hit is used only when the
   state came (``Loaded.state``) with every page of it; otherwise the request starts
   from nothing;
2. runs the rest of the prompt in chunks (``chunk`` tokens), then decodes, token by
   token, K / V of both attention layers into its pages, the linear layer's state in
   its slot;
3. takes checkpoints as it goes: a copy of its state into a scratch slot at every
   ``checkpoint_every``-th page boundary that ends a prefill chunk or a decode step,
   and at the last page boundary it reaches (the end of the turn);
4. inserts its whole pages with those checkpoints (the answer comes once the daemon has
   copied them: the scratch slots are free again), unlocks, frees its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hicache.engine.hybrid_reference import HybridTransformer
from hicache.engine.kv_pool import export_kv_pool
from hicache.engine.reference import Generation, page_source
from hicache.engine.req_to_token import HybridReqToTokenPool

STATE_LAYER, SWA_LAYER, FULL_LAYER = 0, 1, 2  # the spec's layers (HybridConfig.spec)
ATTENTION_LAYERS = (SWA_LAYER, FULL_LAYER)


class PagedHybridCache:
    """One request's caches in the engine's pool: what :class:`HybridTransformer` reads
    and writes through a ``HybridCache``, at the row's token slots and state slot."""

    def __init__(self, engine: "HybridReferenceEngine", row: int, length: int) -> None:
        self._engine = engine
        self._slots = engine.req_to_token.req_to_token[row]
        self._state = engine.req_to_token.state_slot(row)
        self.length = length

    @property
    def conv(self) -> torch.Tensor:
        return self._engine.conv[self._state]

    @conv.setter
    def conv(self, value: torch.Tensor) -> None:
        self._engine.conv[self._state] = value

    @property
    def temporal(self) -> torch.Tensor:
        return self._engine.temporal[self._state]

    @temporal.setter
    def temporal(self, value: torch.Tensor) -> None:
        self._engine.temporal[self._state] = value

    def append_kv(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slot = int(self._slots[self.length])
        self._engine.k[i][slot] = k
        self._engine.v[i][slot] = v

    def kv_since(self, i: int, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots[lo : self.length + 1].long()
        return self._engine.k[i][slots], self._engine.v[i][slots]


@dataclass
class HybridGeneration(Generation):
    checkpoints: list[int] | None = None  # page counts of the checkpoints offered


class HybridReferenceEngine:
    """See the module docstring. One request at a time."""

    def __init__(self, model: HybridTransformer, *, num_pages: int = 256, max_requests: int = 4,
                 max_context: int = 4096, scratch_slots: int = 16, checkpoint_slots: int = 8, client=None) -> None:
        """``checkpoint_slots``: state slots lent to hicache for checkpoints kept on the
        device (after the rows' and the scratch slots)."""
        self.model = model
        c = model.config
        self.page_size = c.page_size
        self.kv = export_kv_pool(c.spec, num_pages, num_state_slots=max_requests + scratch_slots,
                                 checkpoint_slots=checkpoint_slots if client is not None else 0)
        self.req_to_token = HybridReqToTokenPool(max_requests, max_context, num_state_slots=max_requests)
        self.scratch = list(range(max_requests + 1, max_requests + scratch_slots + 1))
        self.client = client
        self.pages = page_source(client, c.spec, self.kv, num_pages)
        pool = self.kv.pool
        self.k = [pool.k_buffer(layer) for layer in ATTENTION_LAYERS]
        self.v = [pool.v_buffer(layer) for layer in ATTENTION_LAYERS]
        self.conv = pool.buffer_of(STATE_LAYER, "conv")
        self.temporal = pool.buffer_of(STATE_LAYER, "temporal")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.kv.close()

    def _copy_state(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.temporal[dst] = self.temporal[src]

    def _hit(self, prompt: list[int], slot: int, extra_key: str):
        """Match, lock and load the prompt but its last token; returns (handle, usable
        device pages, pages by tier)."""
        client = self.client
        m = client.match(prompt[:-1], extra_key)
        handle = m.handle
        client.lock(handle)
        if handle is None:
            return None, np.empty(0, np.int32), {}
        loaded = client.load(handle, state_slot=slot)
        pages = loaded.device_pages
        if not (loaded.state and loaded.handle == handle and len(pages) == m.num_device_pages + m.num_host_pages + m.num_disk_pages):
            return handle, np.empty(0, np.int32), {}
        for layer in range(self.model.config.spec.num_layers):
            client.wait_layer(loaded.wait, layer, timeout_s=60)
        remote = min(m.num_remote_pages, m.num_host_pages)
        tiers = {"device": m.num_device_pages, "host": m.num_host_pages - remote, "disk": m.num_disk_pages,
                 "remote": remote}
        return handle, pages, tiers

    def generate(self, prompt: list[int], max_new_tokens: int, *, extra_key: str = "", chunk: int | None = None,
                 checkpoint_every: int = 0) -> HybridGeneration:
        """Greedy decoding of ``max_new_tokens`` after ``prompt`` (prefilled in chunks of
        ``chunk`` tokens); checkpoints at every ``checkpoint_every``-th page boundary a
        chunk or a step ends at (0: only the turn's last), and at the last one."""
        ps = self.page_size
        (row,) = self.req_to_token.alloc(1)
        slot = self.req_to_token.state_slot(row)
        handle, prefix, tiers = None, np.empty(0, np.int32), {}
        if self.client is not None:
            handle, prefix, tiers = self._hit(prompt, slot, extra_key)
        cached = len(prefix) * ps
        if not cached:
            self.conv[slot] = 0
            self.temporal[slot] = 0
        table = self.req_to_token.req_to_token
        total = len(prompt) + max_new_tokens - 1  # tokens that get K / V
        need = -(-total // ps) - len(prefix)
        own = self.pages.alloc(need) if need else np.empty(0, np.int32)
        if own is None:
            raise RuntimeError("no KV pages free")
        pages = np.concatenate((np.asarray(prefix, np.int64), np.asarray(own, np.int64)))
        slots = (torch.from_numpy(pages)[:, None] * ps + torch.arange(ps)).reshape(-1)[:total]
        table[row, :total] = slots.to(table.dtype)
        cache = PagedHybridCache(self, row, cached)
        offered: dict[int, int] = {}  # page count -> scratch slot
        scratch = list(self.scratch)
        last_slot = scratch.pop()

        def boundary() -> None:
            """After a chunk or a step: a checkpoint if the cache ends a page."""
            if cache.length % ps:
                return
            n = cache.length // ps
            self._copy_state(slot, last_slot)
            offered[-1] = n
            if checkpoint_every and n % checkpoint_every == 0 and scratch and n not in offered:
                offered[n] = scratch.pop()
                self._copy_state(slot, offered[n])

        model = self.model
        logits = []
        step = chunk or len(prompt)
        pos = cached
        while pos < len(prompt):
            for token in prompt[pos : pos + step]:
                logits_now = model.step(token, cache)
            pos = cache.length
            boundary()
        logits.append(logits_now)
        generated: list[int] = []
        for _ in range(max_new_tokens):
            generated.append(int(torch.argmax(logits[-1])))
            if len(generated) == max_new_tokens:
                break
            logits.append(model.step(generated[-1], cache))
            boundary()
        # Insert every whole page with K / V (the last generated token has none).
        full = total // ps
        last = offered.pop(-1, 0)
        checkpoints = sorted((n, s) for n, s in offered.items() if n <= full)
        if last and last <= full and last not in offered:
            checkpoints.append((last, last_slot))
            checkpoints.sort()
        leftover = np.asarray(own, np.int32)
        if self.client is not None and full:
            tokens = (list(prompt) + generated)[: full * ps]
            self.client.insert(tokens, pages[:full].astype(np.int32), extra_key, checkpoints=checkpoints)
            leftover = leftover[max(0, full - len(prefix)):]
        if len(leftover):
            self.pages.release(leftover)
        if self.client is not None:
            self.client.unlock(handle)
        self.req_to_token.free([row])
        return HybridGeneration(generated, logits, cached,
                                {t: n * ps for t, n in tiers.items()} or {"device": 0, "host": 0, "disk": 0,
                                                                         "remote": 0},
                                [n for n, _ in checkpoints])
