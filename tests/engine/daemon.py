"""Start and stop a real kvblendd for the engine tests: eval/engine_setup.py's Daemon.

The harness lives in eval/ so that eval/run_vllm.py and bench/bench_vllm.py share it
without importing a test file (tests import eval/, never the reverse).
"""

import sys
from pathlib import Path

_EVAL = str(Path(__file__).resolve().parents[2] / "eval")
if _EVAL not in sys.path:
    sys.path.append(_EVAL)

from engine_setup import Daemon, install_package, kvblendd_path, wait_for_daemon  # noqa: E402

__all__ = ["Daemon", "install_package", "kvblendd_path", "wait_for_daemon"]
