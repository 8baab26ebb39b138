"""Fixtures: a real kvblendd on a temporary data directory and IPC socket."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import kvblend

ROOT = Path(__file__).resolve().parents[3]


def _daemon_path() -> str:
    p = os.environ.get("KVBLENDD") or str(ROOT / "build" / "bin" / "kvblendd")
    if not os.access(p, os.X_OK):
        pytest.exit(f"kvblendd not found at {p}; set KVBLENDD", returncode=2)
    return p


def _daemon_env() -> dict[str, str]:
    """The daemon's environment: not the Python process's ASan preload (run_tests.sh)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if "KVBLEND_DAEMON_ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] = env["KVBLEND_DAEMON_ASAN_OPTIONS"]
    return env


class Daemon:
    def __init__(self, tmp: str) -> None:
        self.dir = tmp
        self.endpoint = f"ipc://{tmp}/kvblend.sock"
        self.log = f"{tmp}/kvblendd.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    _daemon_path(),
                    "--data-dir",
                    f"{tmp}/data",
                    "--listen",
                    self.endpoint,
                    "--map-size",
                    "1G",
                    "--log-level",
                    "debug",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_daemon_env(),
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                with kvblend.Client(self.endpoint, timeout_ms=200):
                    return
            except kvblend.Unavailable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"kvblendd did not start:\n{self.tail()}") from None
                time.sleep(0.05)

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9


@pytest.fixture(scope="session")
def daemon():
    with tempfile.TemporaryDirectory(prefix="kvb-py-") as tmp:
        d = Daemon(tmp)
        yield d
        rc = d.stop()
        assert rc == 0, f"kvblendd exited with {rc} on SIGTERM:\n{d.tail()}"


@pytest.fixture
def client(daemon):
    with kvblend.Client(daemon.endpoint, timeout_ms=10000) as c:
        yield c


@pytest.fixture
def frames_client(daemon):
    """A client that never uses shared memory: every byte in ZeroMQ frames."""
    with kvblend.Client(daemon.endpoint, timeout_ms=10000, no_shm=True) as c:
        yield c


_ids = itertools.count()


@pytest.fixture
def model(client):
    """A small f16 model of its own for each test."""
    m = kvblend.Model(f"m{next(_ids)}", num_layers=3, num_kv_heads=2, head_dim=16, dtype="f16")
    client.model_register(m)
    return m
