"""bench_stall's output contract (not its figures): a small run ends with one JSON object
whose counts agree with its setup."""

from bench_util import bench_figures


def test_a_small_run_prints_its_figures_as_json_last():
    f = bench_figures("bench_stall.py", "--host-slots", "16", "--checkpoints", "32", "--rounds", "2",
                      "--page-size", "4", timeout_s=600)
    assert (f["host_slots"], f["checkpoints_per_insert"], f["page_size"]) == (16, 32, 4)
    # 16 host slots: each offer of 32 takes 16 (then every slot is one of its own, not ready).
    assert [r["taken"] for r in f["checkpoints"]] == [16, 16]
    assert all(r["insert_ms"] >= 0 and r["offer_ms"] >= 0 and r["done_ms"] >= 0 for r in f["checkpoints"])
    assert f["swa_topped_up"] == 31  # (every end but the last, whose window had its bytes)
    assert f["swa_top_up_max_poll_ms"] >= 0 and f["ends_insert_ms"] >= 0 and f["no_ends_insert_ms"] >= 0
