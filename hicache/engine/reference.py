"""A reference engine: a small decoder-only transformer that keeps its KV in hicache.

It exists to prove that the cache serves exactly the right KV: its logits with caching
(hits from device, host, disk, or a restarted daemon) must be bit-identical to a run
with caching disabled. So every computation is batch-size invariant — projections,
MLP and attention run one token row at a time — and the only thing that differs between
the two runs is where a prefix's K/V comes from.

Per request (the client lifecycle of :mod:`hicache.client`, with SGLang's request-to-token
row and paged slot assignment)::

    m  = client.match(prompt)                 # cached prefix, device / host / disk
    client.lock(m.handle); ld = client.load(m.handle)
    row = req_to_token.alloc(1)               # req_to_token row: prefix slots, then new ones
    slots = alloc_extend(prefix, seq, last_loc, client.alloc(pages))
    for layer in layers: client.wait_layer(ld.wait, layer); attention(... kv_indices ...)
    ... decode with alloc_decode ...
    client.insert(tokens, pages); client.release(tail); client.unlock(m.handle)

Model: token embedding, ``num_layers`` x (RMSNorm, GQA attention with rotary positions,
RMSNorm, SiLU MLP), final RMSNorm, LM head; float32 weights from a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hicache.engine.kv_pool import export_kv_pool
from hicache.engine.req_to_token import ReqToTokenPool
from hicache.kernels.kv_indices import build_kv_indices
from hicache.kernels.slot_alloc import alloc_decode, alloc_extend
from hicache.pages import PageAllocator
from hicache.spec import KVSpec


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotary_frequencies(head_dim: int) -> torch.Tensor:
    half = head_dim // 2
    return 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))


def rotary(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of one token's heads ``[heads, head_dim]``."""
    angles = position * inv_freq
    cos, sin = torch.cos(angles), torch.sin(angles)
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab: int = 512
    hidden: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    page_size: int = 16
    seed: int = 0

    @property
    def spec(self) -> KVSpec:
        return KVSpec.mha(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          page_size=self.page_size, dtype="float32", model=f"hicache-reference-{self.seed}")


class TinyTransformer:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        c = config

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(c.vocab, c.hidden, generator=g)
        self.layers = [
            {
                "wq": w(c.hidden, c.num_heads * c.head_dim),
                "wk": w(c.hidden, c.num_kv_heads * c.head_dim),
                "wv": w(c.hidden, c.num_kv_heads * c.head_dim),
                "wo": w(c.num_heads * c.head_dim, c.hidden),
                "w1": w(c.hidden, c.mlp),
                "w2": w(c.mlp, c.hidden),
            }
            for _ in range(c.num_layers)
        ]
        self.lm_head = w(c.hidden, c.vocab)
        self._inv_freq = rotary_frequencies(c.head_dim)

    _norm = staticmethod(rms_norm)

    def _rotate(self, x: torch.Tensor, position: int) -> torch.Tensor:
        return rotary(x, position, self._inv_freq)

    def qkv(self, layer: int, x: torch.Tensor, position: int) -> tuple[torch.Tensor, ...]:
        """One token: ``x [hidden]`` -> q ``[heads, hd]``, k and v ``[kv_heads, hd]``."""
        c, p = self.config, self.layers[layer]
        h = self._norm(x)[None]
        q = (h @ p["wq"]).view(c.num_heads, c.head_dim)
        k = (h @ p["wk"]).view(c.num_kv_heads, c.head_dim)
        v = (h @ p["wv"]).view(c.num_kv_heads, c.head_dim)
        return self._rotate(q, position), self._rotate(k, position), v

    def attend(self, layer: int, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """One token's attention over ``keys`` / ``values`` ``[n, kv_heads, hd]``, then the
        MLP; returns the new hidden state."""
        c, p = self.config, self.layers[layer]
        group = c.num_heads // c.num_kv_heads
        k = keys.repeat_interleave(group, dim=1)  # [n, heads, hd]
        v = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(c.head_dim)
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).reshape(1, -1)
        x = x + (out @ p["wo"])[0]
        h = self._norm(x)[None]
        return x + (torch.nn.functional.silu(h @ p["w1"]) @ p["w2"])[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(x)[None] @ self.lm_head)[0]


def page_source(client, spec: KVSpec, kv, num_pages: int):
    """Where an engine's pages come from: hicache through ``client`` (the pool ``kv``
    registered with it), or with caching disabled (``client`` None) a private allocator."""
    if client is None:
        return _LocalPages(num_pages)
    client.register(spec, [kv.handle])
    return client


class _LocalPages:
    """Caching disabled: pages from a private allocator, nothing shared."""

    def __init__(self, num_pages: int) -> None:
        self._alloc = PageAllocator.for_device(num_pages)

    def alloc(self, n: int):
        return self._alloc.alloc(n)

    def release(self, pages) -> None:
        self._alloc.free(pages)


@dataclass
class Generation:
    tokens: list[int]  # the generated tokens
    logits: list[torch.Tensor]  # the logits each one was chosen from
    cached_tokens: int  # prompt tokens served from the cache
    from_tier: dict[str, int]  # cached tokens by tier (device, host, disk, remote)


class ReferenceEngine:
    """The model plus its paged KV pool, talking to hicache through ``client`` (or with
    caching disabled when ``client`` is None)."""

    def __init__(self, model: TinyTransformer, *, num_pages: int = 256, max_requests: int = 8,
                 max_context: int = 8192, client=None) -> None:
        self.model = model
        c = model.config
        self.page_size = c.page_size
        self.kv = export_kv_pool(c.spec, num_pages)
        self.req_to_token = ReqToTokenPool(max_requests, max_context)
        self.client = client
        self.pages = page_source(client, c.spec, self.kv, num_pages)
        self.k = [self.kv.pool.k_buffer(i) for i in range(c.num_layers)]
        self.v = [self.kv.pool.v_buffer(i) for i in range(c.num_layers)]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.kv.close()

    def _page_of(self, slot: int) -> int:
        return slot // self.page_size

    def _forward(self, row: int, tokens: list[int], start: int, wait=()) -> torch.Tensor:
        """Run tokens ``start..`` of the row (K/V of ``0..start`` already in the pool),
        layer by layer; returns the hidden state of the last token."""
        model = self.model
        slots = self.req_to_token.req_to_token[row]
        x = [model.embed[t].clone() for t in tokens[start:]]
        end = len(tokens)
        for layer in range(model.config.num_layers):
            if wait:
                self.client.wait_layer(wait, layer, timeout_s=60)
            qs = []
            for i, pos in enumerate(range(start, end)):
                q, k, v = model.qkv(layer, x[i], pos)
                slot = int(slots[pos])
                self.k[layer][slot] = k
                self.v[layer][slot] = v
                qs.append(q)
            # The CSR kv_indices an attention backend reads: every key of the row so far.
            kv = build_kv_indices(self.req_to_token.req_to_token, torch.tensor([row]), torch.tensor([end]))
            keys = kv.indices.long()
            k_all, v_all = self.k[layer][keys], self.v[layer][keys]
            for i, pos in enumerate(range(start, end)):
                x[i] = model.attend(layer, x[i], qs[i], k_all[: pos + 1], v_all[: pos + 1])
        return x[-1]

    def generate(self, prompt: list[int], max_new_tokens: int, *, extra_key: str = "") -> Generation:
        ps = self.page_size
        client = self.client
        handle = None
        from_tier = {"device": 0, "host": 0, "disk": 0, "remote": 0}
        prefix_pages = np.empty(0, dtype=np.int32)
        wait = ()
        if client is not None:
            m = client.match(prompt, extra_key)
            handle = m.handle
            client.lock(handle)
            loaded = client.load(handle)
            wait = loaded.wait
            # Keep at least the last prompt token to compute: its logits start decoding.
            usable = min(len(loaded.device_pages), (len(prompt) - 1) // ps)
            prefix_pages = loaded.device_pages[:usable]
            device = min(m.num_device_pages, usable)
            host = min(m.num_host_pages, usable - device)
            remote = min(m.num_remote_pages, host)  # (the remote tier's pages land on host first)
            from_tier = {"device": device * ps, "host": (host - remote) * ps, "disk": (usable - device - host) * ps,
                         "remote": remote * ps}
        cached = len(prefix_pages) * ps
        (row,) = self.req_to_token.alloc(1)
        table = self.req_to_token.req_to_token
        if cached:
            slots = (torch.from_numpy(prefix_pages.astype(np.int64))[:, None] * ps + torch.arange(ps)).reshape(-1)
            table[row, :cached] = slots.to(table.dtype)
        own_pages: list[int] = []  # pages this request allocated (private until inserted)
        need = -(-len(prompt) // ps) - len(prefix_pages)
        new = self.pages.alloc(need) if need else np.empty(0, np.int32)
        if new is None:
            raise RuntimeError("no KV pages free")
        own_pages += new.tolist()
        last = int(table[row, cached - 1]) if cached else -1
        assignment = alloc_extend(torch.tensor([cached]), torch.tensor([len(prompt)]), torch.tensor([last]),
                                  torch.from_numpy(np.asarray(new, dtype=np.int64)), ps)
        table[row, cached : len(prompt)] = assignment.slots.to(table.dtype)
        tokens = list(prompt)
        hidden = self._forward(row, tokens, cached, wait)
        logits = [self.model.logits(hidden)]
        generated = []
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits[-1]))
            generated.append(token)
            tokens.append(token)
            if len(generated) == max_new_tokens:
                break
            seq = len(tokens)
            free = np.empty(0, np.int64)
            if (seq - 1) % ps == 0:
                page = self.pages.alloc(1)
                if page is None:
                    raise RuntimeError("no KV pages free")
                own_pages += page.tolist()
                free = np.asarray(page, dtype=np.int64)
            step = alloc_decode(torch.tensor([seq]), torch.tensor([int(table[row, seq - 2])]),
                                torch.from_numpy(free), ps)
            table[row, seq - 1] = int(step.slots[0])
            hidden = self._forward(row, tokens, seq - 1)
            logits.append(self.model.logits(hidden))
        # K/V exists for every token but the last generated one.
        with_kv = tokens[:-1]
        full = len(with_kv) // ps
        pages = [self._page_of(int(table[row, i * ps])) for i in range(-(-len(with_kv) // ps))]
        leftover = own_pages
        if client is not None and full:
            client.insert(with_kv[: full * ps], np.asarray(pages[:full], dtype=np.int32), extra_key)
            taken = set(pages[:full])  # the tree's now (or freed by the daemon as duplicates)
            leftover = [page for page in own_pages if page not in taken]
        if leftover:
            self.pages.release(np.asarray(leftover, dtype=np.int32))
        if client is not None:
            client.unlock(handle)
        self.req_to_token.free([row])
        return Generation(generated, logits, cached, from_tier)
