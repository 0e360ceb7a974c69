"""A hybrid reference model: one linear-attention layer, one sliding-window layer, one
full-attention layer (issue 20) — what Kimi Linear, Qwen3-Next and gpt-oss / Gemma mix.

It exists to prove that a cache serves hybrid models exactly, so everything is plain
torch, float32, one token at a time (the order of every sum is the same however a
prompt is cut into chunks), and each layer keeps what a cache would have to keep:

* **linear** (a gated delta-rule-like recurrence with a short causal convolution, the
  shape of SGLang's KDA / Mamba state): per request a *state* — conv state
  ``[conv_kernel - 1, hidden]`` (the last inputs) and temporal state ``[heads, head_dim,
  head_dim]`` — and no per-token KV. A prefix is reusable only with the state after
  exactly that prefix: a *checkpoint*;
* **swa**: per-token K / V, but a query at position ``p`` attends only to positions
  ``> p - window``: pages wholly before the window of every future token are dead;
* **full**: per-token K / V over the whole sequence.

:class:`HybridCache` is one request's caches; :meth:`HybridCache.checkpoint` is what a
cache stores at a page boundary and :meth:`HybridCache.resume` what it gives back, with
the sliding-window layer's K / V cut to the window (``drop_outside_window``), so that a
test can show that resuming from a checkpoint — whatever was dropped — gives the same
logits bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hicache.engine.reference import rms_norm, rotary, rotary_frequencies
from hicache.spec import KVSpec, MHALayer, StateLayer

KINDS = ("linear", "swa", "full")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    vocab: int = 512
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    page_size: int = 16
    window: int = 24  # the swa layer's sliding window, in tokens
    conv_kernel: int = 3
    seed: int = 0

    @property
    def spec(self) -> KVSpec:
        """The pool's spec: the state layer, then the two attention layers (the window
        is part of the fingerprint)."""
        return KVSpec(page_size=self.page_size, model=f"hicache-hybrid-reference-{self.seed}", layers=(
            StateLayer(conv_state_shape=(self.conv_kernel - 1, self.hidden),
                       temporal_state_shape=(self.num_heads, self.head_dim, self.head_dim),
                       conv_dtype="float32", temporal_dtype="float32"),
            MHALayer(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype="float32",
                     sliding_window=self.window),
            MHALayer(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype="float32")))


@dataclass
class HybridCache:
    """One request's caches after ``length`` tokens: the linear layer's state and, for
    each attention layer, K / V by position (``first[layer]``: the position of entry 0 —
    older entries of the swa layer may have been dropped)."""

    conv: torch.Tensor
    temporal: torch.Tensor
    keys: list[list[torch.Tensor]] = field(default_factory=lambda: [[], []])
    values: list[list[torch.Tensor]] = field(default_factory=lambda: [[], []])
    first: list[int] = field(default_factory=lambda: [0, 0])
    length: int = 0

    @classmethod
    def empty(cls, config: HybridConfig) -> "HybridCache":
        return cls(torch.zeros(config.conv_kernel - 1, config.hidden),
                   torch.zeros(config.num_heads, config.head_dim, config.head_dim))

    def checkpoint(self) -> "HybridCache":
        """A copy of everything after exactly ``length`` tokens (what a cache keeps)."""
        return HybridCache(self.conv.clone(), self.temporal.clone(), [list(k) for k in self.keys],
                           [list(v) for v in self.values], list(self.first), self.length)

    def append_kv(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Attention layer ``i``'s K / V of the token at position ``length``."""
        self.keys[i].append(k)
        self.values[i].append(v)

    def kv_since(self, i: int, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention layer ``i``'s K / V of positions ``lo ..`` (this token's included),
        each ``[n, kv_heads, head_dim]``."""
        if lo < self.first[i]:
            raise RuntimeError(f"the {KINDS[i + 1]} layer needs position {lo}, the cache starts at {self.first[i]}")
        start = lo - self.first[i]
        return torch.stack(self.keys[i][start:]), torch.stack(self.values[i][start:])

    def resume(self, config: HybridConfig, *, drop_outside_window: bool = True) -> "HybridCache":
        """:meth:`checkpoint`, with the swa layer's K / V before the window of the next
        token left out — what a cache that frees out-of-window pages gives back (whole
        pages: the entries from the page holding the window's first position)."""
        cache = self.checkpoint()
        if drop_outside_window:
            start = max(0, self.length + 1 - config.window)  # the next token sees positions >= start
            start -= start % config.page_size
            cut = start - cache.first[0]
            if cut > 0:
                cache.keys[0] = cache.keys[0][cut:]
                cache.values[0] = cache.values[0][cut:]
                cache.first[0] = start
        return cache


class HybridTransformer:
    """See the module docstring. Deterministic from ``config.seed``."""

    def __init__(self, config: HybridConfig) -> None:
        self.config = c = config
        g = torch.Generator().manual_seed(config.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(c.vocab, c.hidden, generator=g)
        hd = c.num_heads * c.head_dim
        self.linear = {"w_in": w(c.hidden, c.hidden), "conv": torch.randn(c.conv_kernel, c.hidden, generator=g) / 2,
                       "wq": w(c.hidden, hd), "wk": w(c.hidden, hd), "wv": w(c.hidden, hd),
                       "wg": w(c.hidden, c.num_heads), "wo": w(hd, c.hidden)}
        self.attn = [{"wq": w(c.hidden, hd), "wk": w(c.hidden, c.num_kv_heads * c.head_dim),
                      "wv": w(c.hidden, c.num_kv_heads * c.head_dim), "wo": w(hd, c.hidden)} for _ in range(2)]
        self.mlps = [{"w1": w(c.hidden, c.mlp), "w2": w(c.mlp, c.hidden)} for _ in KINDS]
        self.lm_head = w(c.hidden, c.vocab)
        self._inv_freq = rotary_frequencies(c.head_dim)

    _norm = staticmethod(rms_norm)

    def _rotate(self, x: torch.Tensor, position: int) -> torch.Tensor:
        return rotary(x, position, self._inv_freq)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = self.mlps[i]
        return x + (torch.nn.functional.silu(self._norm(x)[None] @ p["w1"]) @ p["w2"])[0]

    def _linear(self, x: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        c, p = self.config, self.linear
        u = (self._norm(x)[None] @ p["w_in"])[0]
        window = torch.cat((cache.conv, u[None]))  # [conv_kernel, hidden]: oldest first
        mixed = torch.nn.functional.silu((window * p["conv"]).sum(0))
        cache.conv = window[1:].clone()
        q = (mixed[None] @ p["wq"]).view(c.num_heads, c.head_dim)
        k = torch.nn.functional.normalize((mixed[None] @ p["wk"]).view(c.num_heads, c.head_dim), dim=-1)
        v = (mixed[None] @ p["wv"]).view(c.num_heads, c.head_dim)
        gate = torch.sigmoid((mixed[None] @ p["wg"])[0])  # [heads]
        cache.temporal = gate[:, None, None] * cache.temporal + torch.einsum("hd,he->hde", k, v)
        out = torch.einsum("hd,hde->he", q, cache.temporal).reshape(1, -1)
        return x + (out @ p["wo"])[0]

    def _attention(self, i: int, x: torch.Tensor, position: int, cache: HybridCache) -> torch.Tensor:
        c, p = self.config, self.attn[i]
        h = self._norm(x)[None]
        q = self._rotate((h @ p["wq"]).view(c.num_heads, c.head_dim), position)
        cache.append_kv(i, self._rotate((h @ p["wk"]).view(c.num_kv_heads, c.head_dim), position),
                        (h @ p["wv"]).view(c.num_kv_heads, c.head_dim))
        # The positions this query reads: all (full), or those > position - window (swa).
        lo = max(0, position - c.window + 1) if i == 0 else 0
        keys, values = cache.kv_since(i, lo)
        group = c.num_heads // c.num_kv_heads
        k = keys.repeat_interleave(group, dim=1)
        v = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(c.head_dim)
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).reshape(1, -1)
        return x + (out @ p["wo"])[0]

    def step(self, token: int, cache: HybridCache) -> torch.Tensor:
        """Run one token at position ``cache.length``; returns its logits."""
        position = cache.length
        x = self.embed[token].clone()
        x = self._mlp(0, self._linear(x, cache))
        x = self._mlp(1, self._attention(0, x, position, cache))
        x = self._mlp(2, self._attention(1, x, position, cache))
        cache.length += 1
        return (self._norm(x)[None] @ self.lm_head)[0]

    def prefill(self, tokens: list[int], cache: HybridCache, chunk: int | None = None) -> list[torch.Tensor]:
        """Every token of ``tokens`` after the cache's ``length``, in chunks of ``chunk``
        tokens (as a scheduler would cut a long prompt); the logits of each."""
        out = []
        pos = cache.length
        chunk = chunk or max(1, len(tokens) - pos)
        while pos < len(tokens):
            for token in tokens[pos : pos + chunk]:
                out.append(self.step(token, cache))
            pos = cache.length
        return out

    def generate(self, tokens: list[int], max_new_tokens: int, cache: HybridCache,
                 chunk: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding after a (chunked) prefill of at least one token: the tokens
        generated, and the logits each was chosen from."""
        steps = self.prefill(tokens, cache, chunk)[-1:]
        generated: list[int] = []
        for _ in range(max_new_tokens):
            generated.append(int(torch.argmax(steps[-1])))
            steps.append(self.step(generated[-1], cache))
        return generated, steps[:max_new_tokens]
