"""bench_check's output contract (not its figures): a small run ends with one JSON object
whose counts agree with its setup."""

from bench_util import bench_figures


def test_a_small_run_prints_its_figures_as_json_last():
    f = bench_figures("bench_check.py", "--pages", "2000", "--prompt-pages", "64", "--rounds", "2", timeout_s=600)
    # 16 prompts share their first 8 pages: 64 new pages for the first of a group, 56 for the rest.
    assert f["pages"] == 2000 and f["prompts"] == 36
    assert f["tree_pages"] == 64 * 3 + 56 * 33
    assert len(f["rounds"]) == 2
    for r in f["rounds"]:
        assert r["check_s"] > 0 and r["max_wait_during_check_s"] >= 0 and r["pings_during_check"] >= 0
    assert f["max_wait_during_check_s"] == max(r["max_wait_during_check_s"] for r in f["rounds"])
    assert f["wait_vs_check"] >= 0 and f["health_idle_ms"] > 0
