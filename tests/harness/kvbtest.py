"""The Python tests' harness (tests/harness/), the one module the tests under tests/ share:

* daemons: a real kvblendd on a temporary data directory and IPC socket (eval/harness.py's
  Daemon, pinged with the kvblend CLI) and the CLI pointed at it; Etcd, free_port (never
  the same port twice in a test run, across ctest's parallel processes) and wait_for from
  eval/harness.py;
* a tally of checks printed one line each and asserted at the end (Checks).

The daemon harness lives in eval/harness.py, so that eval/ and bench/ share it without
importing a test file; tests import eval/, never the reverse, and no test file imports
another: what two tests share lives here. Only the standard library is imported here: the
integration tests run on Debian's python3.

The tests run under pytest (ctest: python3 -m pytest ... FILE --kvblendd ...;
tests/conftest.py has the options and fixtures; tests/pytest.ini puts this folder and eval/
on Python's path, the one place that does).
"""

import os
import shutil
import subprocess
import sys

import harness
from harness import Etcd, free_port, wait_for  # noqa: F401  (the tests' names for them)


class Checks:
    """A test's named checks, called as check(name, cond, detail): each printed as it is
    made (`ok - NAME`, or `not ok - NAME: DETAIL` when cond is false), and the test goes
    on. done() prints the totals and fails the test (AssertionError, the failed checks
    named) if any failed."""

    def __init__(self):
        self.passed = 0
        self.failures = []

    @property
    def failed(self):
        return len(self.failures)

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print(f"ok - {name}", flush=True)
        else:
            self.failures.append(name)
            print(f"not ok - {name}" + (f": {detail}" if detail else ""), flush=True)

    def done(self):
        print(f"{self.passed} passed, {self.failed} failed")
        assert not self.failures, f"{self.failed} checks failed: {'; '.join(self.failures)}"


def remove(tmp):
    """Remove a test's scratch directory, unless KVB_KEEP_TMP is set (as the C harness)."""
    if not os.environ.get("KVB_KEEP_TMP"):
        shutil.rmtree(tmp, ignore_errors=True)


def cli(kvblend, endpoint, *args, timeout_ms=None, ok=False, env=None, hang_s=None,
        label="kvblend"):
    """Run `KVBLEND --endpoint ENDPOINT [--timeout MS] ARGS...`, output captured as text.

    Returns the CompletedProcess. env None inherits this environment; a dict replaces
    every KVBLEND_* variable of it with its own. ok: raise RuntimeError (LABEL, the
    arguments and stderr) if the CLI fails. hang_s: a CLI still running after that many
    seconds is killed and returned as failed (-9), so that its check fails, not the test.
    """
    argv = [kvblend, "--endpoint", endpoint]
    if timeout_ms is not None:
        argv += ["--timeout", str(timeout_ms)]
    argv += [str(a) for a in args]
    if env is not None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}, **env}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=hang_s)
    except subprocess.TimeoutExpired as x:
        return subprocess.CompletedProcess(x.cmd, -9, "", f"kvblend hung: {x}")
    if ok and r.returncode != 0:
        raise RuntimeError(f"{label} {' '.join(map(str, args))}: {r.stderr}")
    return r


class Daemon(harness.Daemon):
    """One kvblendd (eval/harness.py's Daemon, started by start(), not at once):
    `KVBLENDD [FIRST...] --data-dir DATA --listen LISTEN FLAGS...`, pinged with the CLI.

    By default DATA is TMP/data, the endpoint ipc://TMP/kvblend.sock and the log (its
    stderr and stdout, appended) TMP/kvblendd.log; with name N they are TMP/N-data,
    ipc://TMP/N.sock and TMP/N.log. log=False discards its output. listen defaults to
    the endpoint (the CLI's); environ is its environment (None: this one's, less
    LD_PRELOAD). cli_opts are cli()'s keyword arguments for every call of self.cli(),
    its ping included. TMP stays: the test removes it (remove()).
    """

    def __init__(self, kvblendd, kvblend, tmp, *flags, name=None, data=None, listen=None,
                 log=None, environ=None, first=(), **cli_opts):
        super().__init__(*flags, kvblendd=kvblendd, dir=tmp, name=name, data=data,
                         listen=listen, log=log, environ=environ, first=first, workers=None,
                         start=False)
        self.ep = self.endpoint
        self.kvblend, self.cli_opts = kvblend, cli_opts

    def cli(self, *args, **opts):
        """The kvblend CLI on this daemon's endpoint; see cli()."""
        return cli(self.kvblend, self.ep, *args, **{**self.cli_opts, **opts})

    def ready(self):
        return self.cli("ping", ok=False, timeout_ms=200).returncode == 0

    def start(self, wait=True, seconds=30):
        """Start it; with wait, ping it with the CLI (0.1 s apart, for up to seconds)
        until it answers. Returns whether it answered (True without wait)."""
        return super().start(wait, seconds)


def python_env(kvblend):
    """The environment of a Python of its own that imports the kvblend package of this
    tree over the libkvblend built beside the kvblend CLI (with libasan preloaded when
    that library is built with ASan)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    lib = os.path.join(os.path.dirname(os.path.abspath(kvblend)), "..", "lib", "libkvblend.so")
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    asan = next((ln.split()[2] for ln in ldd.splitlines() if "libasan" in ln), "")
    env = {**os.environ, "KVBLEND_LIB": lib, "LD_PRELOAD": asan,
           "PYTHONPATH": os.path.join(root, "client", "python", "src")}
    if asan:  # (Python itself leaks by LeakSanitizer's count)
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
    return env


def python_client(kvblend, code, timeout=60):
    """Run code in such a Python (python_env); its CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=python_env(kvblend), timeout=timeout)

