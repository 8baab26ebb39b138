"""Fixtures: a real kvblendd on a temporary data directory and IPC socket (eval/harness.py's
Daemon, the one Python harness that starts one)."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from pathlib import Path

import pytest

import kvblend
from harness import Daemon  # eval/harness.py, on the path (pyproject.toml's pythonpath)

ROOT = Path(__file__).resolve().parents[3]


def _daemon_path() -> str:
    p = os.environ.get("KVBLENDD") or str(ROOT / "build" / "bin" / "kvblendd")
    if not os.access(p, os.X_OK):
        pytest.exit(f"kvblendd not found at {p}; set KVBLENDD", returncode=2)
    return p


@contextlib.contextmanager
def running_daemon(prefix, *flags):
    """A kvblendd (1 GiB map, flags added) on a temporary directory named prefix...; on
    leaving, SIGTERM, and it must exit 0 within 60 s."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        d = Daemon("--map-size", "1G", *flags, kvblendd=_daemon_path(), dir=tmp, workers=None)
        yield d
        rc = d.stop(timeout=60)
        assert rc == 0, f"kvblendd exited with {rc} on SIGTERM:\n{d.tail()}"


@pytest.fixture(scope="session")
def daemon():
    with running_daemon("kvb-py-", "--log-level", "debug") as d:
        yield d


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
