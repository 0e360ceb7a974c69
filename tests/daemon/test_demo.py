"""``hicache demo`` end to end (:mod:`hicache.daemon.demo`): a daemon started in a temp dir,
the reference engine chatting through it."""

import subprocess

from daemon_util import HICACHE


def test_hicache_demo_runs_end_to_end():
    done = subprocess.run([HICACHE, "--log-level", "WARNING", "demo", "--conversations", "2", "--turns", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "6 requests" in done.stdout and "tokens saved:" in done.stdout
    assert "0 errors" in done.stdout
    saved = done.stdout.split("tokens saved: ")[1].split(" ")[0]
    assert int(saved) > 0
