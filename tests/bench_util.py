"""Running a benchmark script the way its output-contract tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_figures(script: str, *args: str, timeout_s: float = 300) -> dict:
    """Run ``benchmarks/<script>`` with ``args`` and ``--json``: the JSON object its last
    line holds (the run must exit 0)."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json"],
                         capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
