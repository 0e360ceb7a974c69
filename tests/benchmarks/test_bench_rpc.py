"""bench_rpc's output contract (not its figures): a real run, cut short, ends with one
JSON object holding every figure the README and the issue quote, each consistent with
the others."""

import math

from bench_util import bench_figures


def test_a_short_run_prints_its_figures_as_json_last():
    figures = bench_figures("bench_rpc.py", "--seconds", "0.2")
    for key in ("echo_p50_us", "router_echo_p50_us", "tuned_echo_p50_us", "match_p50_us", "match_p99_us",
                "single_client_ops", "four_client_ops", "batched_match_ops"):
        assert figures[key] > 0 and math.isfinite(figures[key]), key
    assert figures["match_p99_us"] >= figures["match_p50_us"]
    assert math.isclose(figures["p50_ratio"], figures["match_p50_us"] / figures["echo_p50_us"])
    assert math.isclose(figures["p50_ratio_vs_tuned_echo"], figures["match_p50_us"] / figures["tuned_echo_p50_us"])
    assert math.isclose(figures["scaling"], figures["four_client_ops"] / figures["single_client_ops"])
