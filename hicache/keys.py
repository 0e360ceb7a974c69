"""Namespaces, token packing and page keys.

Algorithms (format version 1; test vectors in ``tests/unit/test_keys.py`` pin them):

*Namespace id* — 16 bytes::

    blake2b(digest_size=16, person=b"hicache.ns.v1",
            data = u32le(len(fp)) || fp || u32le(len(extra)) || extra)

where ``fp`` is the model fingerprint (:attr:`hicache.spec.KVSpec.fingerprint`) and
``extra`` the request's extra key as bytes (UTF-8 for text; empty when there is none).
Length prefixes keep ``(fp, extra)`` pairs from colliding by concatenation.

*Page key* — 16 bytes, chained from the namespace root::

    key[i] = blake2b(digest_size=16, person=b"hicache.page.v1",
                     data = namespace_id || key[i-1] || tokens_i)

with ``key[-1] = 16 zero bytes`` and ``tokens_i`` the page's ``page_size`` token ids as
little-endian int32. A page key therefore names the page *and its whole prefix* in its
namespace: equal keys mean equal KV on every machine, in every process, after every
restart. Python's ``hash`` is never involved.

Tokens travel packed: ``bytes`` of little-endian int32, 4 bytes per token. The tree
compares whole edges of that buffer at memcmp speed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import NewType, Union

import numpy as np
from numpy.typing import NDArray

from hicache.errors import InvalidArgument

PAGE_KEY_BYTES = 16
TOKEN_BYTES = 4
TOKEN_DTYPE = np.dtype("<i4")

NamespaceId = NewType("NamespaceId", bytes)
PageKey = NewType("PageKey", bytes)

# The parent of a namespace's first page.
ROOT_PARENT_KEY = PageKey(bytes(PAGE_KEY_BYTES))

_NS_PERSON = b"hicache.ns.v1"
_TENANT_NS_PERSON = b"hicache.ns.t1"  # a named tenant's: never equal to a namespace of the default tenant
_PAGE_PERSON = b"hicache.page.v1"

Tokens = Union[bytes, bytearray, memoryview, NDArray[np.integer], "list[int]", "tuple[int, ...]", array]


def namespace_id(model_fingerprint: bytes, extra_key: bytes | str | None = None, tenant: str = "") -> NamespaceId:
    """The namespace of a model, a tenant and a request's extra key (LoRA id, salt, ...).
    The default tenant (``""`` or ``"default"``) keeps the namespaces of hicache before
    tenants: a cache written then is still hit."""
    if not isinstance(model_fingerprint, (bytes, bytearray)) or not model_fingerprint:
        raise InvalidArgument("model_fingerprint must be non-empty bytes")
    if extra_key is None:
        extra = b""
    elif isinstance(extra_key, str):
        extra = extra_key.encode("utf-8")
    elif isinstance(extra_key, (bytes, bytearray)):
        extra = bytes(extra_key)
    else:
        raise InvalidArgument(f"extra_key must be str, bytes or None, got {type(extra_key).__name__}")
    named = bool(tenant) and tenant != "default"
    h = hashlib.blake2b(digest_size=PAGE_KEY_BYTES, person=_TENANT_NS_PERSON if named else _NS_PERSON)
    if named:
        name = tenant.encode("utf-8")
        h.update(len(name).to_bytes(4, "little"))
        h.update(name)
    h.update(len(model_fingerprint).to_bytes(4, "little"))
    h.update(model_fingerprint)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return NamespaceId(h.digest())


def pack_tokens(tokens: Tokens) -> bytes:
    """Token ids as packed little-endian int32 ``bytes``.

    Accepts packed bytes-like objects as they are (their length must be a multiple of
    4), integer numpy arrays, ``array.array`` and sequences of ints. Ids must fit int32.
    """
    if isinstance(tokens, bytes):
        packed = tokens
    elif isinstance(tokens, (bytearray, memoryview)):
        packed = bytes(tokens)
    else:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            return b""
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.dtype != TOKEN_DTYPE:
            if arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max:
                raise InvalidArgument("token ids must fit in int32")
            arr = arr.astype(TOKEN_DTYPE)
        return arr.tobytes()
    if len(packed) % TOKEN_BYTES:
        raise InvalidArgument(
            f"packed tokens must be a multiple of {TOKEN_BYTES} bytes, got {len(packed)}"
        )
    return packed


def unpack_tokens(packed: bytes) -> NDArray[np.int32]:
    """The inverse of :func:`pack_tokens`, as a read-only int32 array."""
    return np.frombuffer(packed, dtype=TOKEN_DTYPE)


def chain_page_keys(
    namespace: NamespaceId, parent_key: bytes, packed_tokens: bytes, page_size: int
) -> bytes:
    """Page keys of consecutive whole pages, concatenated (16 bytes per page).

    ``parent_key`` is the key of the page just before ``packed_tokens`` (or
    :data:`ROOT_PARENT_KEY` at the start of a sequence); ``len(packed_tokens)`` must be a
    whole number of pages.
    """
    page_bytes = page_size * TOKEN_BYTES
    if page_size <= 0 or len(packed_tokens) % page_bytes:
        raise InvalidArgument(
            f"{len(packed_tokens) // TOKEN_BYTES} tokens is not a whole number of pages of {page_size}"
        )
    if len(parent_key) != PAGE_KEY_BYTES:
        raise InvalidArgument(f"parent key must be {PAGE_KEY_BYTES} bytes")
    base = _page_hash(namespace)
    keys = bytearray()
    parent = parent_key
    for start in range(0, len(packed_tokens), page_bytes):
        h = base.copy()
        h.update(parent)
        h.update(packed_tokens[start : start + page_bytes])
        parent = h.digest()
        keys += parent
    return bytes(keys)


def _page_hash(namespace: NamespaceId):
    """A page key's hash with ``namespace`` in it: copied, then fed the parent key and
    the page's tokens."""
    base = hashlib.blake2b(digest_size=PAGE_KEY_BYTES, person=_PAGE_PERSON)
    base.update(namespace)
    return base


def page_key_function(namespace: NamespaceId) -> Callable[[bytes, bytes], bytes]:
    """``key(parent_key, page_tokens)``: the key of one page in ``namespace``, as
    :func:`chain_page_keys` gives it, without its argument checks — for a caller that
    hashes many single pages of one namespace (the warm restart: ~1 us a page instead of
    ~3.5)."""
    base = _page_hash(namespace)

    def key(parent_key: bytes, page_tokens: bytes) -> bytes:
        h = base.copy()
        h.update(parent_key)
        h.update(page_tokens)
        return h.digest()

    return key


def page_keys(namespace: NamespaceId, tokens: Tokens, page_size: int) -> list[PageKey]:
    """Keys of every whole page of ``tokens`` from the start of a sequence."""
    packed = pack_tokens(tokens)
    whole = len(packed) - len(packed) % (page_size * TOKEN_BYTES)
    blob = chain_page_keys(namespace, ROOT_PARENT_KEY, packed[:whole], page_size)
    return split_page_keys(blob)


def split_page_keys(blob: bytes) -> list[PageKey]:
    """Split a concatenation of page keys into a list of 16-byte keys."""
    return [PageKey(blob[i : i + PAGE_KEY_BYTES]) for i in range(0, len(blob), PAGE_KEY_BYTES)]


def key_self_test(model_fingerprint: bytes, page_size: int) -> bytes:
    """Page keys of a fixed token sequence (1, 2, ..., 2 * page_size) in the model's
    default namespace. A client and a daemon that disagree on these bytes compute keys
    differently and could never share a page, so registration compares them."""
    tokens = list(range(1, 2 * page_size + 1))
    return b"".join(page_keys(namespace_id(model_fingerprint), tokens, page_size))
