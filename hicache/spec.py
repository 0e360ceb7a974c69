"""KV geometry: what one page of KV cache is, in bytes, for every layer of a model.

A :class:`KVSpec` is the single description that pools, copy kernels, disk records and
the compatibility check all derive from. Layer geometry is one tensor-parallel rank's
shard; a TP group registers as one pool, and one host page holds every rank's shard of
that page, rank after rank::

    host page (page-first: one page, all layers, contiguous)
    +--------------------- rank 0 ---------------------+-- rank 1 --+ ...
    | L0.k | L0.v | L1.k | L1.v | ... | L31.k | L31.v  |    ...     |
    +--------------------------------------------------+------------+
      each component = page_size tokens x its per-token bytes

A spec with sliding-window (SWA) layers puts every rank's SWA segments after all the
full-attention ones, so that a page whose SWA part fell out of every window (see
:mod:`hicache.tiers.windows`) is the page's first :attr:`KVSpec.kept_page_bytes`.

Layers come in three kinds, after SGLang's KV pools:

* :class:`MHALayer` — full attention, separate K ``[heads, head_dim]`` and V
  ``[heads, v_head_dim]`` per token (MHATokenToKVPool);
* :class:`MLALayer` — one fused latent ``[1, kv_lora_rank + qk_rope_head_dim]`` per token
  (MLATokenToKVPool);
* :class:`StateLayer` — linear attention / Mamba / KDA: no per-token KV, a fixed-size
  recurrent state per request (conv state + temporal state, MambaPool).

fp8 KV is stored as uint8 (SGLang's "store_dtype"); the logical dtype still enters the
fingerprint, so e4m3 and e5m2 caches never mix.

The fingerprint is a 16-byte blake2b digest of the canonical JSON of everything that
affects the bytes (format version, page size, TP size, model identity, every layer's
kind, shape and dtype, and an engine's own block layout when its pool is in one). Two
specs with equal fingerprints produce interchangeable pages.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Union

from hicache.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

SPEC_FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16
MAX_LAYERS = 4096  # far above any model's; bounds what a registration makes the daemon build


@dataclass(frozen=True, slots=True)
class _DType:
    itemsize: int
    storage: str


# Logical dtype name -> element size and the dtype the bytes are stored as.
DTYPES: dict[str, _DType] = {
    "float32": _DType(4, "float32"),
    "float16": _DType(2, "float16"),
    "bfloat16": _DType(2, "bfloat16"),
    "float8_e4m3fn": _DType(1, "uint8"),
    "float8_e5m2": _DType(1, "uint8"),
    "uint8": _DType(1, "uint8"),
    "int8": _DType(1, "int8"),
}


def dtype_itemsize(name: str) -> int:
    return _lookup_dtype(name).itemsize


def storage_dtype(name: str) -> str:
    """The dtype a buffer of logical dtype ``name`` is allocated with (fp8 -> uint8)."""
    return _lookup_dtype(name).storage


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of the *storage* buffer for logical dtype ``name``."""
    import torch

    return getattr(torch, storage_dtype(name))


def _lookup_dtype(name: str) -> _DType:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):  # TypeError: not even hashable (a spec off the wire)
        raise InvalidArgument(
            f"unsupported dtype {name!r}; supported: {', '.join(sorted(DTYPES))}"
        ) from None


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgument(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Component:
    """One buffer of a layer: per-token shape (for KV) or per-request shape (state)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of one token (KV components) or one request slot (state components)."""
        return math.prod(self.shape) * dtype_itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class MHALayer:
    """Attention: K ``[num_kv_heads, head_dim]``, V ``[num_kv_heads, v_head_dim]``; over
    the whole sequence, or with ``sliding_window`` over the last that many tokens (SWA:
    gpt-oss, Gemma) — the bytes of a token are the same, what a hit needs is not."""

    kind: ClassVar[str] = "mha"
    num_kv_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0 means "same as head_dim"
    dtype: str = "float16"
    sliding_window: int = 0  # tokens a query attends back over; 0: full attention
    # Fields left out of the spec's canonical form while at their default, so that the
    # fingerprints of specs made before they existed stay what they were.
    omitted_at_default: ClassVar[tuple[str, ...]] = ("sliding_window",)

    def __post_init__(self) -> None:
        _require_positive("MHALayer", num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 0:
            raise InvalidArgument(f"MHALayer.sliding_window must be a non-negative int, got {self.sliding_window!r}")
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _require_positive("MHALayer", v_head_dim=self.v_head_dim)
        _lookup_dtype(self.dtype)

    @property
    def token_components(self) -> tuple[Component, ...]:
        return (
            Component("k", (self.num_kv_heads, self.head_dim), self.dtype),
            Component("v", (self.num_kv_heads, self.v_head_dim), self.dtype),
        )

    @property
    def state_components(self) -> tuple[Component, ...]:
        return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class MLALayer:
    """Multi-head latent attention: one fused ``[1, kv_lora_rank + qk_rope_head_dim]``."""

    kind: ClassVar[str] = "mla"
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require_positive(
            "MLALayer", kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )
        _lookup_dtype(self.dtype)

    @property
    def token_components(self) -> tuple[Component, ...]:
        return (Component("kv", (1, self.kv_lora_rank + self.qk_rope_head_dim), self.dtype),)

    @property
    def state_components(self) -> tuple[Component, ...]:
        return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class StateLayer:
    """Linear attention / Mamba / KDA: a fixed per-request state, no per-token KV.

    ``conv_state_shape`` is e.g. ``(conv_kernel - 1, proj_size // tp)`` and
    ``temporal_state_shape`` ``(num_heads // tp, head_dim, head_dim)`` (SGLang's KDA pools).
    """

    kind: ClassVar[str] = "state"
    conv_state_shape: tuple[int, ...]
    temporal_state_shape: tuple[int, ...]
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("conv_state_shape", "temporal_state_shape"):
            shape = tuple(getattr(self, name))
            if not shape:
                raise InvalidArgument(f"StateLayer.{name} must not be empty")
            _require_positive("StateLayer", **{f"{name}[{i}]": d for i, d in enumerate(shape)})
            object.__setattr__(self, name, shape)
        _lookup_dtype(self.conv_dtype)
        _lookup_dtype(self.temporal_dtype)

    @property
    def token_components(self) -> tuple[Component, ...]:
        return ()

    @property
    def state_components(self) -> tuple[Component, ...]:
        return (
            Component("conv", self.conv_state_shape, self.conv_dtype),
            Component("temporal", self.temporal_state_shape, self.temporal_dtype),
        )


Layer = Union[MHALayer, MLALayer, StateLayer]
LAYER_KINDS: dict[str, type] = {cls.kind: cls for cls in (MHALayer, MLALayer, StateLayer)}


@dataclass(frozen=True, slots=True)
class Segment:
    """Where one layer component of one page lies inside a host page."""

    rank: int
    layer: int
    component: str
    offset: int
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class KVSpec:
    """The KV geometry of one model shard layout; see the module docstring."""

    page_size: int
    layers: tuple[Layer, ...]
    model: str = ""  # weights identity, e.g. "org/name@revision"; part of the fingerprint
    tp_size: int = 1
    # The engine's own block layout, for a pool in a foreign layout (e.g. vLLM's CPU
    # backend, "vllm/cpu/LBHNC/amx"): its pages are opaque bytes per layer, never
    # interchangeable with another layout's. "" is hicache's own layout.
    layout: str = ""
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_positive("KVSpec", page_size=self.page_size, tp_size=self.tp_size)
        layers = tuple(self.layers)
        if not layers:
            raise InvalidArgument("KVSpec.layers must not be empty")
        for i, layer in enumerate(layers):
            if not isinstance(layer, (MHALayer, MLALayer, StateLayer)):
                raise InvalidArgument(f"KVSpec.layers[{i}] is not a layer: {layer!r}")
        if not any(layer.token_components for layer in layers):
            raise InvalidArgument("KVSpec needs at least one layer with per-token KV")
        if not isinstance(self.model, str):
            raise InvalidArgument(f"KVSpec.model must be a str, got {self.model!r}")
        if not isinstance(self.layout, str) or len(self.layout) > 256:
            raise InvalidArgument(f"KVSpec.layout must be a str of at most 256 characters, got {self.layout!r}")
        object.__setattr__(self, "layers", layers)
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(
            canonical.encode(), digest_size=FINGERPRINT_BYTES, person=b"hicache.spec"
        ).digest()
        object.__setattr__(self, "fingerprint", digest)

    @classmethod
    def mha(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: str = "float16",
        model: str = "",
        tp_size: int = 1,
        layout: str = "",
    ) -> "KVSpec":
        _require_positive("KVSpec.mha", num_layers=num_layers)
        layer = MHALayer(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        return cls(page_size=page_size, layers=(layer,) * num_layers, model=model, tp_size=tp_size, layout=layout)

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        page_size: int,
        dtype: str = "bfloat16",
        model: str = "",
        tp_size: int = 1,
    ) -> "KVSpec":
        _require_positive("KVSpec.mla", num_layers=num_layers)
        layer = MLALayer(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, dtype=dtype)
        return cls(page_size=page_size, layers=(layer,) * num_layers, model=model, tp_size=tp_size)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    def token_bytes(self, layer: int) -> int:
        """Bytes of one token's KV in ``layer`` on one rank (0 for state layers)."""
        return sum(c.nbytes for c in self.layers[layer].token_components)

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer`` on one rank (0 for state layers)."""
        return self.page_size * self.token_bytes(layer)

    @property
    def rank_page_bytes(self) -> int:
        """Bytes of one page, all layers, one rank."""
        return sum(self.page_bytes(i) for i in range(self.num_layers))

    @property
    def host_page_bytes(self) -> int:
        """Bytes of one host page (= one disk record payload): all layers, all ranks."""
        return self.tp_size * self.rank_page_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state, all state layers, one rank."""
        return sum(c.nbytes for layer in self.layers for c in layer.state_components)

    def is_swa(self, layer: int) -> bool:
        """Is ``layer`` a sliding-window attention layer?"""
        return bool(getattr(self.layers[layer], "sliding_window", 0))

    @property
    def swa_window(self) -> int:
        """The widest sliding window of the spec's SWA layers, in tokens (0: none)."""
        return max((getattr(layer, "sliding_window", 0) for layer in self.layers), default=0)

    @property
    def window_pages(self) -> int:
        """Pages of SWA layers a hit needs before its end: the token after a prefix of
        ``n`` pages attends back to position ``n * page_size - window + 1``."""
        window = self.swa_window
        return -(-(window - 1) // self.page_size) if window > 1 else 0

    @property
    def kept_page_bytes(self) -> int:
        """Bytes of a host page without its SWA layers' segments: they come first (see
        :meth:`host_page_layout`), so a page whose SWA part is dropped is this prefix."""
        return self.tp_size * sum(self.page_bytes(i) for i in range(self.num_layers) if not self.is_swa(i))

    def host_page_layout(self) -> tuple[Segment, ...]:
        """Every (rank, layer, component) segment of a host page, in address order:
        rank after rank, layer after layer — every rank's full-attention layers first,
        then (a spec with SWA layers) every rank's SWA layers, so that a page without
        its SWA part is a prefix of the page (:attr:`kept_page_bytes`)."""
        segments = []
        offset = 0
        for swa in (False, True):
            for rank in range(self.tp_size):
                for index, layer in enumerate(self.layers):
                    if self.is_swa(index) != swa:
                        continue
                    for comp in layer.token_components:
                        nbytes = self.page_size * comp.nbytes
                        segments.append(Segment(rank, index, comp.name, offset, nbytes))
                        offset += nbytes
        return tuple(segments)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able form; :meth:`from_dict` inverts it. (``layout`` only when
        set: the fingerprints of specs in hicache's own layout stay what they were.)"""
        out = {
            "format": SPEC_FORMAT_VERSION,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "model": self.model,
            "layers": [_layer_to_dict(layer) for layer in self.layers],
        }
        if self.layout:
            out["layout"] = self.layout
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVSpec":
        if not isinstance(data, dict):
            raise InvalidArgument(f"spec must be a mapping, got {type(data).__name__}")
        if data.get("format") != SPEC_FORMAT_VERSION:
            raise InvalidArgument(
                f"spec format {data.get('format')!r} is not supported "
                f"(this build reads format {SPEC_FORMAT_VERSION})"
            )
        unknown = set(data) - {"format", "page_size", "tp_size", "model", "layers", "layout"}
        if unknown:
            raise InvalidArgument(f"unknown spec fields: {sorted(unknown)}")
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise InvalidArgument("spec.layers must be a list")
        if len(layers) > MAX_LAYERS:  # (building each costs the daemon's loop time)
            raise InvalidArgument(f"a spec has at most {MAX_LAYERS} layers, got {len(layers)}")
        return cls(
            page_size=data.get("page_size"),
            tp_size=data.get("tp_size", 1),
            model=data.get("model", ""),
            layout=data.get("layout", ""),
            layers=tuple(_layer_from_dict(item) for item in layers),
        )


def _layer_to_dict(layer: Layer) -> dict[str, Any]:
    omitted = getattr(layer, "omitted_at_default", ())
    fields = {name: getattr(layer, name) for name, f in layer.__dataclass_fields__.items()
              if name != "omitted_at_default" and not (name in omitted and getattr(layer, name) == f.default)}
    return {"kind": layer.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def _layer_from_dict(data: Any) -> Layer:
    if not isinstance(data, dict):
        raise InvalidArgument(f"layer must be a mapping, got {type(data).__name__}")
    kind = data.get("kind")
    cls = LAYER_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidArgument(f"unknown layer kind {kind!r}; known: {sorted(LAYER_KINDS)}")
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "kind"}
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidArgument(f"bad {kind} layer: {exc}") from None
