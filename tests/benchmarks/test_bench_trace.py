"""bench_trace's output contract without the ``bench`` extra: a small run with ``--json``
needs no matplotlib and ends with its figures as consistent JSON; asking for the plot
without matplotlib is refused before anything runs, naming the extra."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trace.py"

# Runs the benchmark as __main__ in an interpreter where ``import matplotlib`` fails
# (and importlib finds no spec for it), whether or not it is installed.
WITHOUT_MATPLOTLIB = (
    "import runpy, sys\n"
    "sys.modules['matplotlib'] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_without_matplotlib(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, str(BENCH), *args],
                          capture_output=True, text=True, timeout=300)


def test_json_run_needs_no_matplotlib():
    plot = BENCH.parents[1] / "docs" / "trace.png"
    plot_before = plot.stat().st_mtime_ns if plot.exists() else None
    out = run_without_matplotlib("--json", "--conversations", "3")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for prefix in ("", "shared_"):
        f = {key[len(prefix):]: value for key, value in figures.items() if key.startswith(prefix)}
        assert f["requests"] == 30  # 3 conversations of 10 turns
        assert f["saved_tokens"] == f["saved_device_tokens"] + f["saved_host_tokens"] + f["saved_disk_tokens"]
        assert f["saved_tokens"] + f["computed_tokens"] == f["prompt_tokens"]
        assert 0 < f["saved_tokens"] <= f["oracle_saved_tokens"]
        assert 0 < f["baseline_saved_tokens"] <= f["oracle_saved_tokens"]
        assert f["saved_vs_oracle"] == f["saved_tokens"] / f["oracle_saved_tokens"]
    assert "plot:" not in out.stdout
    assert (plot.stat().st_mtime_ns if plot.exists() else None) == plot_before  # the README's plot is untouched


def test_plot_request_without_matplotlib_names_the_bench_extra(tmp_path):
    out = run_without_matplotlib("--json", "--plot", str(tmp_path / "trace.png"))
    assert out.returncode == 2
    assert "matplotlib" in out.stderr and "pip install -e '.[bench]'" in out.stderr
    assert out.stdout == ""  # refused before the run
    assert not (tmp_path / "trace.png").exists()
