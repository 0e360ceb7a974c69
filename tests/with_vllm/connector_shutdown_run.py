"""A worker and a scheduler connector against a daemon that is not there (argv[2] names
its socket), shut down after argv[1] seconds — whatever their threads are doing then.
Prints "clean exit"; a hang is cut short after 15 s with every thread's traceback."""

import faulthandler
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from connector_harness import Engine  # noqa: E402

engine = Engine(f"ipc://{sys.argv[2]}")
time.sleep(float(sys.argv[1]))
faulthandler.dump_traceback_later(15, exit=True)
engine.worker.shutdown()
engine.scheduler.shutdown()
print("clean exit")
