"""Disk-tier benchmark: LmdbBackend against the device's limit and against one file per
page (SGLang's file backend pattern).

For each page size (64 KiB, 1 MiB and 2 MiB by default) it writes ``--mib`` MiB of pages
into a fresh store, reads them straight back (page cache warm: ``get``), reads them
again after dropping the store's file pages from the page cache (``cold_get``:
``posix_fadvise(DONTNEED)``; LMDB is closed and reopened around it, since pages mapped
into a process stay cached), then writes as many new pages into the now full store
(``steady_put``: LMDB evicts its least recently used records, the file pattern deletes
the oldest page's file for each new one, the raw file overwrites the oldest slots — a
disk tier in service runs full), through

* ``lmdb``: :class:`hicache.storage.lmdb_backend.LmdbBackend`, its real API: ``put_batch``
  of ``--batch`` records per call (as the daemon's disk writer puts host pool rows), all futures awaited (``flush``), then ``get`` of
  ``--batch`` keys per call into preallocated numpy page buffers (checksums verified);
* ``file``: one file per page in a flat directory — write a temp file, ``os.replace``
  it into place; read = ``open`` + ``readinto`` a preallocated buffer;
* ``raw``: the yardstick — one preallocated file, ``pwrite`` / ``preadv`` of the same
  bytes at page offsets: what the disk and the page cache give with no store around
  them. (Whether file creates are cheap on a VM varies several-fold between runs; the
  raw file does not depend on it.)

Both write the same bytes to a fresh temporary directory on disk (``--dir``; not a
tmpfs), with no fsync (LMDB ``sync=False``; a process kill loses neither). Before each
timed write phase the dirty pages of earlier phases are written back
(``os.sync``), so background writeback of one variant does not land on the other. Each
figure is the best of ``--rounds`` rounds (the variants alternate within a round); MB/s
are 10^6 bytes per second.

    python benchmarks/bench_storage.py [--mib 256] [--rounds 3] [--writemap] [--json]

With ``--json`` the last line is one JSON object with, per size (``64k``, ``1m``,
``2m``) and op (``put``, ``get``, ``cold_get``, ``steady_put``), ``{lmdb,file,raw}_<op>_<size>_mbps``,
``<op>_<size>_ratio`` (lmdb / file), and the ratios to the raw file:
``put_vs_raw_<size>``, ``steady_put_vs_raw_<size>``, ``warm_get_vs_raw_<size>``,
``cold_get_vs_raw_<size>`` (targets: each >= 0.8).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from hicache.storage.base import PageBatch
from hicache.storage.lmdb_backend import LmdbBackend

SIZES = {"64k": 64 << 10, "1m": 1 << 20, "2m": 2 << 20}
# put into a fresh store, warm get, cold get, put into a store at capacity (each put evicts)
OPS = ("put", "get", "cold_get", "steady_put")
VARIANTS = ("lmdb", "file", "raw")
FINGERPRINT = hashlib.blake2b(b"bench-spec", digest_size=16).digest()
NAMESPACE = hashlib.blake2b(b"bench-namespace", digest_size=16).digest()
NUM_SOURCE_PAGES = 64
TOKENS_PER_PAGE = 64


def page_keys(num_pages: int, salt: str) -> list[bytes]:
    return [hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).digest() for i in range(num_pages)]


def filesystem_of(path: str) -> str:
    """The filesystem type that holds ``path`` (longest matching mount point)."""
    best, fstype = "", "?"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1]
                if os.path.realpath(path).startswith(mount_point.rstrip("/") + "/") and len(mount_point) > len(best):
                    best, fstype = mount_point, fields[2]
    except OSError:
        pass
    return fstype


def fresh_dir(root: str, name: str, prefault_mib: int) -> str:
    """A new directory for one timed run, and a machine in the same state for every run.

    Earlier runs' files stay until the end (deleting them makes the filesystem discard
    blocks under the next run); their dirty pages are written back first, so that the
    next run does not pay for them. Then ``prefault_mib`` of anonymous memory is touched
    and freed: on a VM whose balloon reports free pages to the host, the first touch of
    a page after that costs a host fault, which would otherwise charge whichever run
    happens to get the returned pages (several-fold swings in write MB/s here).
    """
    path = tempfile.mkdtemp(prefix=name + "-", dir=root)
    os.sync()
    if prefault_mib:
        np.ones(prefault_mib << 20, dtype=np.uint8)
    return path


def drop_cached(paths: list[str]) -> None:
    """Write back, then drop these files' pages from the page cache."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_lmdb(root: str, keys: list[bytes], more_keys: list[bytes], sources: list[np.ndarray], batch: int,
               args) -> tuple[float, float, float]:
    page_bytes = sources[0].nbytes
    total = len(keys) * page_bytes
    path = fresh_dir(root, "lmdb", args.prefault_mib)
    tokens = bytes(4 * TOKENS_PER_PAGE)

    source = np.stack(sources)  # (the daemon's disk writer puts rows of its host pool)

    def batches_of(page_keys: list[bytes]) -> list[PageBatch]:
        """``page_keys`` as the daemon's disk writer puts them, ``batch`` records a put."""
        out = []
        for start in range(0, len(page_keys), batch):
            chunk = page_keys[start : start + batch]
            out.append(PageBatch(b"".join(chunk), NAMESPACE * len(chunk), bytes(16) * len(chunk),
                                 tokens * len(chunk), source,
                                 np.arange(start, start + len(chunk), dtype=np.int64) % len(sources)))
        return out

    def put_all(batches: list[PageBatch]) -> tuple[float, int]:
        start = time.perf_counter()
        futures = [store.put_batch(b, fingerprint=FINGERPRINT) for b in batches]
        store.flush()
        seconds = time.perf_counter() - start
        results = [f.result() for f in futures]
        assert sum(r.written for r in results) == sum(b.num_records for b in batches)
        return seconds, sum(len(r.evicted) for r in results)

    records, more_records = batches_of(keys), batches_of(more_keys)
    batch_bounds = {}
    if args.max_batch_mib is not None:
        batch_bounds["max_batch_bytes"] = args.max_batch_mib << 20
    if args.max_batch_records is not None:
        batch_bounds["max_batch_records"] = args.max_batch_records
    # Exactly the first phase's payload: full after it, then every put evicts.
    def open_store() -> LmdbBackend:
        return LmdbBackend(path, capacity_bytes=total, writemap=args.writemap, sync=args.sync, **batch_bounds)

    buffers = [np.empty(page_bytes, dtype=np.uint8) for _ in range(batch)]

    def get_all() -> float:
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            found = store.get(chunk, buffers[: len(chunk)], fingerprint=FINGERPRINT)
            if not all(found):
                raise RuntimeError("lmdb: a page written was not read back")
        seconds = time.perf_counter() - start
        if not np.array_equal(buffers[(len(keys) - 1) % batch], sources[(len(keys) - 1) % len(sources)]):
            raise RuntimeError("lmdb: wrong bytes read back")
        return seconds

    store = open_store()
    try:
        put_s, num_evicted = put_all(records)
        assert num_evicted == 0
        get_s = get_all()
        store.close()
        drop_cached([os.path.join(path, name) for name in os.listdir(path) if name.endswith(".mdb")])
        store = open_store()
        cold_s = get_all()

        os.sync()
        steady_s, num_evicted = put_all(more_records)
        oldest_gone = store.get(keys[:1], buffers[:1], fingerprint=FINGERPRINT) == [False]
        newest_kept = store.get(more_keys[-1:], buffers[:1], fingerprint=FINGERPRINT) == [True]
        if num_evicted != len(keys) or not oldest_gone or not newest_kept:
            raise RuntimeError(f"lmdb: the full store evicted {num_evicted} records, not the {len(keys)} oldest")
    finally:
        store.close()
    return total / put_s / 1e6, total / get_s / 1e6, total / cold_s / 1e6, total / steady_s / 1e6


def bench_files(root: str, keys: list[bytes], more_keys: list[bytes], sources: list[np.ndarray], batch: int,
                args) -> tuple[float, float, float]:
    page_bytes = sources[0].nbytes
    total = len(keys) * page_bytes
    path = fresh_dir(root, "files", args.prefault_mib)

    def put_all(page_keys: list[bytes], evicting: list[str] | None = None) -> tuple[list[str], float]:
        """One file per page; with ``evicting``, each put also deletes the oldest page's."""
        names = [os.path.join(path, key.hex() + ".bin") for key in page_keys]
        start = time.perf_counter()
        for i, name in enumerate(names):
            temp = name + ".tmp"
            with open(temp, "wb") as f:
                f.write(memoryview(sources[i % len(sources)]))
            os.replace(temp, name)
            if evicting is not None:
                os.unlink(evicting[i])
        return names, time.perf_counter() - start

    names, put_s = put_all(keys)

    buffers = [np.empty(page_bytes, dtype=np.uint8) for _ in range(batch)]
    views = [memoryview(b) for b in buffers]

    def get_all() -> float:
        start = time.perf_counter()
        for i, name in enumerate(names):
            with open(name, "rb", buffering=0) as f:
                if f.readinto(views[i % batch]) != page_bytes:
                    raise RuntimeError(f"file: short read of {name}")
        seconds = time.perf_counter() - start
        if not np.array_equal(buffers[(len(keys) - 1) % batch], sources[(len(keys) - 1) % len(sources)]):
            raise RuntimeError("file: wrong bytes read back")
        return seconds

    get_s = get_all()
    drop_cached(names)
    cold_s = get_all()

    # At capacity: each new page's file replaces the least recently used one's.
    os.sync()
    more_names, steady_s = put_all(more_keys, evicting=names)
    if len(os.listdir(path)) != len(more_names):
        raise RuntimeError("file: the full directory did not stay at capacity")
    return total / put_s / 1e6, total / get_s / 1e6, total / cold_s / 1e6, total / steady_s / 1e6


def bench_raw(root: str, keys: list[bytes], more_keys: list[bytes], sources: list[np.ndarray], batch: int,
              args) -> tuple[float, float, float, float]:
    """The device's limit: one preallocated file, each page ``pwrite`` at its offset and
    read back with ``preadv``; the steady phase overwrites the pages in the same order."""
    page_bytes = sources[0].nbytes
    total = len(keys) * page_bytes
    path = fresh_dir(root, "raw", args.prefault_mib)
    name = os.path.join(path, "pages.bin")
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)

        def put_all() -> float:
            start = time.perf_counter()
            for i in range(len(keys)):
                if os.pwrite(fd, memoryview(sources[i % len(sources)]), i * page_bytes) != page_bytes:
                    raise RuntimeError("raw: short write")
            return time.perf_counter() - start

        buffers = [np.empty(page_bytes, dtype=np.uint8) for _ in range(batch)]
        views = [memoryview(b) for b in buffers]

        def get_all() -> float:
            start = time.perf_counter()
            for i in range(len(keys)):
                if os.preadv(fd, [views[i % batch]], i * page_bytes) != page_bytes:
                    raise RuntimeError("raw: short read")
            seconds = time.perf_counter() - start
            if not np.array_equal(buffers[(len(keys) - 1) % batch], sources[(len(keys) - 1) % len(sources)]):
                raise RuntimeError("raw: wrong bytes read back")
            return seconds

        put_s = put_all()
        get_s = get_all()
        drop_cached([name])
        cold_s = get_all()
        os.sync()
        steady_s = put_all()
    finally:
        os.close(fd)
    return total / put_s / 1e6, total / get_s / 1e6, total / cold_s / 1e6, total / steady_s / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB written per page size and variant")
    parser.add_argument("--sizes", default="64k,1m,2m", help=f"page sizes, from {sorted(SIZES)}")
    parser.add_argument("--batch", type=int, default=32, help="records per put / get call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir(),
                        help="where the temporary directory goes (a disk, not a tmpfs)")
    parser.add_argument("--writemap", action=argparse.BooleanOptionalAction, default=False,
                        help="open LMDB with a writable map (LmdbBackend's default: off)")
    parser.add_argument("--sync", action="store_true", help="LMDB fsync per commit")
    parser.add_argument("--max-batch-records", type=int, default=None,
                        help="LmdbBackend writer batch bound (default: the backend's)")
    parser.add_argument("--max-batch-mib", type=int, default=None,
                        help="LmdbBackend writer batch bound (default: the backend's)")
    parser.add_argument("--prefault-mib", type=int, default=None,
                        help="anonymous memory touched and freed before each timed write (default 2 x --mib; 0: off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.prefault_mib is None:
        args.prefault_mib = 2 * args.mib
    sizes = [s.strip() for s in args.sizes.split(",")]
    if any(s not in SIZES for s in sizes):
        parser.error(f"--sizes must be among {sorted(SIZES)}")

    root = tempfile.mkdtemp(prefix="hicache-bench-storage-", dir=args.dir)
    fstype = filesystem_of(root)
    if fstype in ("tmpfs", "ramfs"):
        print(f"warning: {root} is on {fstype}, not a disk", file=sys.stderr)
    rng = np.random.default_rng(0)
    best: dict[str, float] = {}
    try:
        for size in sizes:
            page_bytes = SIZES[size]
            num_pages = (args.mib << 20) // page_bytes
            sources = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(NUM_SOURCE_PAGES)]
            for round_index in range(args.rounds):
                keys = page_keys(num_pages, f"{size}:{round_index}")
                more_keys = page_keys(num_pages, f"{size}:{round_index}:steady")
                results = {
                    "lmdb": bench_lmdb(root, keys, more_keys, sources, args.batch, args),
                    "file": bench_files(root, keys, more_keys, sources, args.batch, args),
                    "raw": bench_raw(root, keys, more_keys, sources, args.batch, args),
                }
                for variant, figures_of_round in results.items():
                    for op, mbps in zip(OPS, figures_of_round, strict=True):
                        name = f"{variant}_{op}_{size}_mbps"
                        best[name] = max(best.get(name, 0.0), mbps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    figures: dict[str, float | int | str | bool] = {}
    print(f"{args.mib} MiB per page size and variant, best of {args.rounds} rounds, batch {args.batch}, "
          f"{root} ({fstype}), writemap={args.writemap}, sync={args.sync}")
    print(f"{'page':>6} {'op':>10} {'lmdb MB/s':>10} {'file MB/s':>10} {'raw MB/s':>10} {'lmdb/file':>10} "
          f"{'lmdb/raw':>9}")
    vs_raw = {"put": "put_vs_raw", "steady_put": "steady_put_vs_raw", "get": "warm_get_vs_raw",
              "cold_get": "cold_get_vs_raw"}
    for size in sizes:
        for op in OPS:
            lmdb_mbps, file_mbps, raw_mbps = (best[f"{v}_{op}_{size}_mbps"] for v in VARIANTS)
            ratio = lmdb_mbps / file_mbps
            print(f"{size:>6} {op:>10} {lmdb_mbps:>10.0f} {file_mbps:>10.0f} {raw_mbps:>10.0f} {ratio:>10.2f} "
                  f"{lmdb_mbps / raw_mbps:>9.2f}")
            for variant, mbps in zip(VARIANTS, (lmdb_mbps, file_mbps, raw_mbps), strict=True):
                figures[f"{variant}_{op}_{size}_mbps"] = round(mbps, 1)
            figures[f"{op}_{size}_ratio"] = round(ratio, 3)
            figures[f"{vs_raw[op]}_{size}"] = round(lmdb_mbps / raw_mbps, 3)
    if args.json:
        figures.update(mib=args.mib, rounds=args.rounds, batch=args.batch, writemap=args.writemap,
                       sync=args.sync, filesystem=fstype)
        print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
