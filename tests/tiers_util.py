"""Test helpers for the tier manager: an engine that fills pages with bytes derived from
their page key, and reads them back in host-page layout to compare."""

from __future__ import annotations

import numpy as np

from hicache import fdpass
from hicache import protocol as p
from hicache.counters import LayerWaiter
from hicache.engine.kv_pool import export_kv_pool
from hicache.keys import namespace_id, page_keys
from hicache.spec import KVSpec, MHALayer, MLALayer
from hicache.tree import Tier

SPEC = KVSpec(
    page_size=4,
    layers=(MHALayer(num_kv_heads=2, head_dim=8), MLALayer(kv_lora_rank=12, qk_rope_head_dim=4, dtype="float16"),
            MHALayer(num_kv_heads=1, head_dim=8, dtype="float8_e4m3fn")),
    model="tiers-test",
)

# The tier manager state machines' prompts: two tenants' trees, and up to six whole
# pages drawn from three page contents (prompts share prefixes and branch), then a part
# of a page.
NAMESPACES = [namespace_id(SPEC.fingerprint), namespace_id(SPEC.fingerprint, "tenant-2")]
BLOCKS = [[b] * SPEC.page_size for b in range(3)]


def token_sequences():
    """The hypothesis strategy of those prompts."""
    from hypothesis import strategies as st

    return st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.integers(0, SPEC.page_size - 1)).map(
        lambda t: [tok for b in t[0] for tok in BLOCKS[b]] + [7] * t[1])


def expected_page(key: bytes, spec: KVSpec = SPEC) -> bytes:
    """The KV bytes of the page with this page key (a host page, rank 0)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, spec.rank_page_bytes, dtype=np.uint8).tobytes()


def offered(daemon, exported) -> dict:
    """An exported pool's handle for a Register to a daemon without sockets: its memfd
    offered on the daemon's descriptor exchange, as the client library does."""
    token = fdpass.offer(daemon.fds.path, exported.handle.fd)
    return exported.handle.to_dict() | {"token": token}


def wired(daemon, request, peer: bytes = b""):
    """``daemon.handle(request)`` as the server does it: the request encoded and decoded
    first (a Register built from plain ``to_dict()`` mappings arrives typed, and one
    that does not decode is answered with the decoder's error)."""
    payload = p.encode(request)
    try:
        decoded = p.decode_request(payload)
    except p.ProtocolError as exc:
        return daemon.undecodable(payload, exc)
    return daemon.handle(decoded, peer)


class Engine:
    """One engine rank with a shared-memory (memfd) KV pool."""

    def __init__(self, num_pages: int, spec: KVSpec = SPEC) -> None:
        self.spec = spec
        self.exported = export_kv_pool(spec, num_pages)
        self.pool = self.exported.pool
        self.waiters: dict[int, tuple[object, LayerWaiter]] = {}  # id(counters) -> (counters, its waiter)
        self._regions = self.pool.layout.token_regions

    def write(self, page: int, key: bytes) -> None:
        data = np.frombuffer(expected_page(key, self.spec), dtype=np.uint8)
        offset = 0
        buf = self.pool.buffer.numpy()
        for region in self._regions:
            start = region.offset + page * region.unit_bytes
            buf[start : start + region.unit_bytes] = data[offset : offset + region.unit_bytes]
            offset += region.unit_bytes

    def read(self, page: int) -> bytes:
        buf = self.pool.buffer.numpy()
        return b"".join(
            buf[r.offset + page * r.unit_bytes : r.offset + (page + 1) * r.unit_bytes].tobytes() for r in self._regions
        )

    def compute(self, namespace: bytes, tokens: list[int], pages) -> None:
        """'Prefill': write the KV of every whole page of ``tokens`` into ``pages``."""
        for key, page in zip(page_keys(namespace, tokens, self.spec.page_size), pages):
            self.write(int(page), key)

    def check(self, namespace: bytes, tokens: list[int], pages) -> None:
        keys = page_keys(namespace, tokens, self.spec.page_size)
        assert len(pages) <= len(keys)
        for i, page in enumerate(pages):
            assert self.read(int(page)) == expected_page(keys[i], self.spec), f"page {i} (id {page}) holds other bytes"

    def offered(self, daemon) -> dict:
        return offered(daemon, self.exported)

    def waiter(self, counters) -> LayerWaiter:
        """A waiter on a pool's ring (the tier manager's LayerCounters, in this process)."""
        # The entry keeps the counters alive: a restarted manager's new counters could
        # otherwise get the id of the old ones and be read through the old ring.
        if id(counters) not in self.waiters:
            self.waiters[id(counters)] = (counters, counters.waiter())
        return self.waiters[id(counters)][1]

    def wait(self, counters, tickets) -> None:
        waiter = self.waiter(counters)
        for ticket in tickets:
            for layer in range(self.spec.num_layers):
                waiter.wait_layer(ticket, layer, timeout_s=30)

    def close(self) -> None:
        for _, waiter in self.waiters.values():
            waiter.close()
        self.exported.close()


class Driver:
    """An engine driving a tier manager the way the daemon's clients will: every page it
    gets back is checked against the bytes derived from its key.

    ``seen``, ``locks`` and ``private`` grow with every call whatever its outcome (a
    prompt that could not be cached, a match with nothing to lock, an allocation that
    failed leave ``None`` or are still recorded): how many entries they hold depends on
    the calls made, never on the tiers' thread timing, so that a caller choosing among
    them (hypothesis draws) makes the same choices when an example is replayed."""

    def __init__(self, tm, engine: Engine, handle, pool: int = 0) -> None:
        self.tm = tm
        self.engine = engine
        self.handle = handle
        self.pool = pool
        self.locks: list = []
        self.private: list = []
        self.seen: list[tuple[bytes, list[int]]] = []

    def check_hit(self, ns, tokens, hit) -> None:
        self.engine.wait(self.handle, hit.wait)
        self.engine.check(ns, tokens, hit.match.device_pages)

    def prefill(self, ns, tokens) -> None:
        ps = self.engine.spec.page_size
        hit = self.tm.match(ns, tokens, self.pool)
        self.check_hit(ns, tokens, hit)
        node = hit.match.node
        if len(tokens) >= ps:
            self.seen.append((ns, tokens))
        # Lock what we reuse before allocating: an allocation may evict unlocked pages.
        self.tm.lock(node, self.pool)
        try:
            new = self.tm.alloc(self.pool, len(tokens) // ps - hit.match.num_device_pages)
            if new is None:
                return
            pages = np.concatenate((hit.match.device_pages, new))
            self.engine.compute(ns, tokens, pages)
            result = self.tm.insert(ns, tokens, self.pool, pages)
        finally:
            self.tm.unlock(node, self.pool)
        assert len(result.device_pages) == len(tokens) // ps
        # The canonical pages hold the request's KV (a duplicate's twin holds the same).
        self.engine.wait(self.handle, self.tm.match(ns, tokens, self.pool).wait)
        self.engine.check(ns, tokens, result.device_pages)

    def match_and_load(self, ns, tokens, keep_lock: bool) -> None:
        hit = self.tm.match(ns, tokens, self.pool)
        self.check_hit(ns, tokens, hit)
        node = hit.match.node
        if node.is_root:
            if keep_lock:
                self.locks.append(None)
            return
        self.tm.lock(node, self.pool)
        loaded = self.tm.wait(self.tm.load(node, self.pool))
        assert loaded.device_pages[: hit.match.num_device_pages].tolist() == hit.match.device_pages.tolist()
        self.engine.wait(self.handle, loaded.wait)
        self.engine.check(ns, tokens, loaded.device_pages)
        if keep_lock:
            self.locks.append(node)
        else:
            self.tm.unlock(node, self.pool)

    def unlock(self, index: int) -> None:
        node = self.locks.pop(index)
        if node is not None:
            self.tm.unlock(node, self.pool)

    def hold_private(self, num_pages: int) -> None:
        self.private.append(self.tm.alloc(self.pool, num_pages))

    def release_private(self) -> None:
        pages = self.private.pop()
        if pages is not None:
            self.tm.release(self.pool, pages)

    def release_everything(self) -> None:
        while self.locks:
            self.unlock(0)
        while self.private:
            self.release_private()

    def check_every_tier(self) -> None:
        """After a flush: every page in every tier holds its key's bytes."""
        tm = self.tm
        tm.flush()
        tm.check_invariants()
        buffer = np.empty(tm.spec.host_page_bytes, dtype=np.uint8)
        for node in tm.tree.nodes():
            device = node.device_pages(self.pool)
            host = node.host_pages
            for i, key in enumerate(node.page_key_list()):
                want = expected_page(key, tm.spec)
                if device is not None:
                    assert self.engine.read(int(device[i])) == want
                if host is not None:
                    assert tm.host_pool.page(int(host[i])).numpy().tobytes() == want
                if node.on_disk:
                    assert tm.storage.get([key], [buffer], fingerprint=tm.spec.fingerprint) == [True]
                    assert buffer.tobytes() == want
        if tm.storage is not None and tm.disk.enabled:  # and no record the tree does not know
            assert tm.storage.stats().records == tm.tree.sizes(Tier.DISK).cached, (
                tm.storage.stats().records, tm.tree.sizes(Tier.DISK).cached)


class ManualWorkers:
    """:class:`hicache.jobs.Workers` whose jobs wait in queues until a test runs them."""

    def __init__(self, completions, *, io_threads: int = 2) -> None:
        self.completions = completions
        self.queues = {"copy": [], "io": [], "write": []}

    def copy(self, work, done) -> None:
        self.queues["copy"].append((work, done))

    def io(self, work, done) -> None:
        self.queues["io"].append((work, done))

    def write(self, submit, done) -> None:
        self.queues["write"].append((submit, done))

    @property
    def jobs(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def run(self, name: str, index: int = 0, *, fail: bool = False, movers=()) -> None:
        """Run a job; a failing one: its storage call raises, or the page copies of
        ``movers`` (a pool's) do."""
        queue = self.queues[name]
        work, done = queue.pop(index if name == "io" else 0)  # (copies and writes run in order)
        result = error = None
        def broken(*args, **kwargs):
            raise RuntimeError("injected copy failure")

        if fail:
            for mover in movers:
                mover.load = mover.load_layer = mover.backup = broken
        try:
            if fail and name != "copy":
                raise OSError("injected storage failure")
            result = work()
            if name == "write":
                result = result.result()
        except BaseException as exc:  # noqa: BLE001 - reported through done, as Workers does
            error = exc
        finally:
            if fail:
                for mover in movers:
                    del mover.load, mover.load_layer, mover.backup
        self.completions.post(lambda: done(result, error))

    def close(self) -> None:
        pass


def watched_copyto(guard, active: list[int], before):
    """``np.copyto`` for a test that watches the copy threads: under ``guard`` (a lock or
    condition) ``before(dst, src)`` runs first — it may wait, or raise (then nothing is
    copied) — and ``active[0]`` counts the copies under way."""
    copyto = np.copyto

    def watched(dst, src):
        with guard:
            before(dst, src)
            active[0] += 1
        try:
            copyto(dst, src)
        finally:
            with guard:
                active[0] -= 1

    return watched
