import subprocess
import sys
from pathlib import Path

import pytest

from hicache import __version__
from hicache.daemon.cli import main


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "hicache"
    assert exe.exists(), "make test installs the package, console script included"
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"hicache {__version__}"


def test_serve_says_the_daemon_is_not_built_yet(capsys):
    assert main(["serve"]) == 0
    assert "daemon not built yet" in capsys.readouterr().err


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
