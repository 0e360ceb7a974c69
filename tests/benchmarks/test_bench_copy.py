"""bench_copy's output contract (not its figures): a small run ends with one JSON object
that has the bandwidth figures and the layer-wise load's time to first layer, each
consistent with the others."""

import math

from bench_util import bench_figures


def test_a_small_run_prints_its_figures_as_json_last():
    f = bench_figures("bench_copy.py", "--pages", "8", "--pool-pages", "16", "--repeat", "2", timeout_s=600)
    assert f["pages"] == 8 and f["bytes"] == 8 * f["page_bytes"]
    for name in ("gather", "scatter", "layerwise_scatter", "gather_contiguous", "scatter_contiguous",
                 "foreign_layerwise_scatter", "foreign_gather"):
        assert f[f"{name}_gbps"] > 0 and f[f"{name}_ratio"] > 0, name
    assert f["copy_gbps"] > 0
    # The first layer lands no later than the last; both figures are of the same loads.
    assert 0 < f["first_layer_ms"] <= f["all_layers_ms"]
    assert 0 < f["enqueue_ms"]
    assert f["whole_copy_ms"] > 0
    assert math.isclose(f["first_layer_ratio"], f["first_layer_ms"] / f["whole_copy_ms"], rel_tol=1e-9)
    assert math.isclose(f["all_layers_ratio"], f["all_layers_ms"] / f["whole_copy_ms"], rel_tol=1e-9)
