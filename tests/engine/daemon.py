"""Start and stop a real kvblendd for the engine tests: eval/engine_setup.py's Daemon
(and cluster, several on one static member list).

The harness lives in eval/ so that eval/run_vllm.py and bench/bench_vllm.py share it
without importing a test file (tests import eval/, never the reverse).
"""

import sys
from pathlib import Path

_EVAL = str(Path(__file__).resolve().parents[2] / "eval")
if _EVAL not in sys.path:
    sys.path.append(_EVAL)

from engine_setup import (  # noqa: E402
    Daemon,
    Group,
    cluster,
    free_port,
    install_package,
    kvblendd_path,
    wait_for_daemon,
)

__all__ = ["Daemon", "Group", "cluster", "free_port", "install_package", "kvblendd_path",
           "wait_for_daemon"]
