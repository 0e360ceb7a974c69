"""scripts/gpu_check.sh's own behaviour, with a stand-in for the GPU machine's Python.

The script runs once per GPU lease (ten minutes at most a command): a step that fails
or hangs must not keep the others from running, and the benchmark's figures must be
printed whatever the tests did. The stand-in answers every call the script makes of
its venv's Python: pip and the import check succeed, the benchmark prints its JSON line
(or fails), and pytest hangs (or passes); each call is logged, in order.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"

STUB = """#!/usr/bin/env bash
echo "$*" >> {log}
case "$1" in
    -m) case "$2" in
            pip) exit 0 ;;
            pytest) echo "pytest started"; {pytest} ;;
        esac ;;
    -) cat >/dev/null; echo "python 3.12, torch stub, device stub"; exit 0 ;;
    -c) [ "$2" = "import pytest_timeout" ] && exit 1; exec {python} "$@" ;;
    benchmarks/bench_copy.py) {bench} ;;
esac
echo "unexpected call: $*" >&2
exit 99
"""


def _run(tmp_path, *, pytest: str, bench: str, **env_vars: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(STUB.format(log=log, python=sys.executable, pytest=pytest, bench=bench))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, GPU_CHECK_VENV=str(venv), TESTS_TIMEOUT_S="1", KERNELS_TIMEOUT_S="1", BENCH_TIMEOUT_S="20",
               **env_vars)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return result, log.read_text().splitlines()


def test_a_hanging_test_run_is_stopped_and_the_figures_still_summed_up(tmp_path):
    result, calls = _run(tmp_path, pytest="exec sleep 15",
                         bench="echo '{\"copy_h2d_gbps\": 51.234, \"pages\": 512}'; exit 0")
    assert result.returncode != 0, result.stdout
    out = result.stdout
    assert "pytest -m gpu tests/gpu: TIMED OUT" in out, out
    assert "kernel tests, compiled: TIMED OUT" in out, out
    assert "bench_copy --device cuda: ok" in out, out
    summary = out[out.index("== summary"):]
    assert "copy_h2d_gbps = 51.23" in summary and "pages = 512" in summary, out
    # The benchmark ran before the tests: a hang there cannot cost its figures; the
    # kernel tests ran after the GPU tests hung.
    assert _steps(calls) == ["bench", "gpu tests", "kernel tests"], calls


def _steps(calls: list[str]) -> list[str]:
    return ["bench" if c.startswith("benchmarks/") else "kernel tests" if "tests/kernels" in c else "gpu tests"
            for c in calls if c.startswith("benchmarks/") or c.startswith("-m pytest")]


def test_only_the_steps_asked_for_run(tmp_path):
    result, calls = _run(tmp_path, pytest="exit 0", bench="echo '{\"pages\": 8}'; exit 0",
                         GPU_CHECK_STEPS="kernels bench")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _steps(calls) == ["bench", "kernel tests"], calls
    summary = result.stdout[result.stdout.index("== summary"):]
    assert "pytest -m gpu tests/gpu: not asked for (GPU_CHECK_STEPS)" in summary
    assert "kernel tests, compiled: ok" in summary and "pages = 8" in summary, summary


def test_a_failed_benchmark_does_not_keep_the_tests_from_running(tmp_path):
    result, calls = _run(tmp_path, pytest="exit 0", bench="echo 'CUDA error: illegal address' >&2; exit 3")
    assert result.returncode != 0
    out = result.stdout
    assert "pytest started" in out
    summary = out[out.index("== summary"):]
    assert "bench_copy --device cuda: FAILED (exit 3)" in summary, out
    assert "pytest -m gpu tests/gpu: ok" in summary, out
    assert "(no benchmark figures)" in summary, out
