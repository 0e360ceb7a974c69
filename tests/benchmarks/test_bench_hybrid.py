"""bench_hybrid's output contract (not its figures): a small real run ends with one JSON
object whose figures agree with each other — and, the trace settled after every
request, the window-cut cache hits exactly what the full one does."""

import math

from bench_util import bench_figures


def test_a_small_run_prints_its_figures_as_json_last():
    f = bench_figures("bench_hybrid.py", "--conversations", "6", "--turns", "2", "--window", "32",
                      "--device-pages", "256", "--host-pages", "192", timeout_s=600)
    assert f["window_pages"] == 2 and f["kept_page_bytes"] * 2 == f["page_bytes"]
    assert 0 < f["swa_bytes_written"] < f["full_bytes_written"]
    assert 0 < f["swa_bytes_backed_up"] < f["full_bytes_backed_up"]
    assert math.isclose(f["swa_saving"], 1 - f["swa_bytes_written"] / f["full_bytes_written"], abs_tol=1e-4)
    assert math.isclose(f["backup_saving"], 1 - f["swa_bytes_backed_up"] / f["full_bytes_backed_up"], abs_tol=1e-4)
    # Every page written whole (full) is a host page; SWA-cut ones are at least the kept part.
    assert f["full_disk_bytes"] % f["page_bytes"] == 0
    assert f["hit_tokens_full"] > 0 and f["hit_tokens_swa"] == f["hit_tokens_full"] and f["hits_lost_tokens"] == 0
    # Without the engine's ends, a branch found once its pages left the device loses its
    # window (these pools are small enough that it happens): no more bytes, fewer hits.
    assert f["hits_lost_tokens_without_ends"] > 0
    assert f["swa_bytes_written_without_ends"] <= f["swa_bytes_written"]
