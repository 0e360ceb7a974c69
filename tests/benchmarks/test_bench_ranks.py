"""bench_ranks' output contract (not its figures): a real run, cut short, ends with one
JSON object holding every figure the README quotes, each consistent with the others."""

import math

from bench_util import bench_figures


def test_a_short_run_prints_its_figures_as_json_last():
    figures = bench_figures("bench_ranks.py", "--rounds", "2")
    assert figures["rounds"] == 2 and figures["pages"] * 16 <= figures["tokens"]
    for tp in (1, 2, 4, 8):
        for what in ("match", "hit"):
            seq, each = figures[f"tp{tp}_{what}_seq_us"], figures[f"tp{tp}_{what}_each_us"]
            assert seq > 0 and each > 0 and math.isfinite(seq) and math.isfinite(each), (tp, what)
            assert math.isclose(figures[f"tp{tp}_{what}_speedup"], seq / each)
        # A hit is its match and then its load's start.
        assert figures[f"tp{tp}_hit_seq_us"] > figures[f"tp{tp}_match_seq_us"]
        assert figures[f"tp{tp}_hit_each_us"] > figures[f"tp{tp}_match_each_us"]
