"""bench_scale's output contract on a small trace, and its flat-LRU yardstick."""

import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scale.py"
sys.path.insert(0, str(BENCH.parent))

import bench_scale  # noqa: E402
from bench_util import bench_figures  # noqa: E402

KEYS = ("saved_vs_flat_lru_total", "saved_vs_flat_lru_disk", "short_pages", "lost_backups", "max_trivial_op_ms",
        "p99_match_ms", "bytes_per_page", "requests_per_s")


def test_a_small_run_ends_with_consistent_figures():
    f = bench_figures("bench_scale.py", "--unique-pages", "4000", timeout_s=600)
    for key in KEYS:
        assert key in f, key
    assert f["unique_pages"] >= 4000
    assert 0 < f["flat_lru_disk_saved"] <= f["flat_lru_total_saved"] <= f["infinite_saved"]
    assert 0 < f["saved_tokens"] <= f["infinite_saved"]
    assert f["saved_vs_flat_lru_total"] == f["saved_tokens"] / f["flat_lru_total_saved"]
    assert f["lost_backups"] == 0  # write-through to host and disk: nothing leaves but from disk
    # The daemon's count of what loads did not deliver is the engine's own.
    assert f["short_pages"] == f["hicache"]["client_short_pages"]
    ops = f["hicache"]["ops"]
    assert ops["match"]["count"] == f["requests"]
    assert f["max_trivial_op_ms"] == max(ops[op]["max_ms"] for op in ("lock", "unlock", "health"))


def test_the_flat_lru_counts_leading_pages_and_never_the_last_token():
    ps = bench_scale.PAGE_SIZE
    system = [2 * ps]  # one system prompt of two pages
    first = bench_scale.Request(system=0, conversation=0, prompt=ps + 5, reply=ps - 5)
    again = bench_scale.Request(system=0, conversation=0, prompt=3 * ps + 1, reply=0)  # the next turn
    other = bench_scale.Request(system=0, conversation=1, prompt=ps, reply=0)
    trace = bench_scale.Trace(system_lengths=np.array(system), conversation_base=[1, 10_000],
                              requests=[first, again, other], unique_pages=6)
    # first: nothing cached; again: the 4 pages first cached (2 system + 2 own; its last
    # token is computed, so it may use (5 * ps + 1 - 1) // ps = 5 pages of which 4 exist);
    # other: the system prompt's 2 pages (of its (3 * ps - 1) // ps = 2 usable).
    assert bench_scale.flat_lru(trace, 100) == (4 + 2) * ps
    # Room for two pages: leaves go first, so the system prompt's two outlive the
    # conversation's pages; "again" and "other" each hit those two.
    assert bench_scale.flat_lru(trace, 2) == (2 + 2) * ps
