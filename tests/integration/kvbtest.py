"""What the Python integration tests share: a real kvblendd on a temporary data
directory and IPC socket (started, waited for with a ping, stopped with SIGTERM and
its exit status returned), the kvblend CLI pointed at it, a tally of checks printed
one line each, free TCP ports on loopback, and the scratch directory's removal.

The tests run as scripts (ctest: python3 tests/integration/test_x.py ...), so Python
finds this module next to them; a script elsewhere puts this directory on sys.path.
Nothing here asserts: each test decides what to check and with which message.
"""

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request


class Checks:
    """A tally of checks, called as check(name, cond, detail): prints `ok - NAME`, or
    `not ok - NAME DETAIL` when cond is false; exit() prints the totals and exits 1 if
    any failed, else 0."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print(f"ok - {name}", flush=True)
        else:
            self.failed += 1
            print(f"not ok - {name} {detail}", flush=True)

    def exit(self):
        print(f"{self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)


_ports_given = set()


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice), never one
    this process was given before: the kernel may hand the same free port out twice, and two
    daemons (or a daemon and etcd) told the same port make one of them fail to start."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_given:
            _ports_given.add(port)
            return port
    raise RuntimeError("free_port: the kernel keeps handing out ports given before")


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


class Daemon:
    """One kvblendd: `KVBLENDD [FIRST...] --data-dir DATA --listen LISTEN FLAGS...`.

    By default DATA is TMP/data, the endpoint ipc://TMP/kvblend.sock and the log (its
    stderr and stdout, appended) TMP/kvblendd.log; with name N they are TMP/N-data,
    ipc://TMP/N.sock and TMP/N.log. log=False discards its output. listen defaults to
    the endpoint (the CLI's); environ is its environment (None: this one's). cli_opts
    are cli()'s keyword arguments for every call of self.cli(), its ping included.
    """

    def __init__(self, kvblendd, kvblend, tmp, *flags, name=None, data=None, listen=None,
                 log=None, environ=None, first=(), **cli_opts):
        stem = f"{tmp}/{name}"
        self.data = data or (f"{stem}-data" if name else f"{tmp}/data")
        self.ep = f"ipc://{stem}.sock" if name else f"ipc://{tmp}/kvblend.sock"
        default_log = f"{stem}.log" if name else f"{tmp}/kvblendd.log"
        self.log = None if log is False else log or default_log
        self.argv = [str(a) for a in (kvblendd, *first, "--data-dir", self.data, "--listen",
                                      listen or self.ep, *flags)]
        self.kvblend, self.environ, self.cli_opts = kvblend, environ, cli_opts
        self.proc = None

    def cli(self, *args, **opts):
        """The kvblend CLI on this daemon's endpoint; see cli()."""
        return cli(self.kvblend, self.ep, *args, **{**self.cli_opts, **opts})

    def start(self, wait=True):
        """Start it; with wait, ping it (200 ms, 100 tries 0.1 s apart) until it answers.

        Returns whether it answered (True without wait). It may still be starting, or
        have exited: the caller checks what matters to it.
        """
        out = open(self.log, "a") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out, env=self.environ)
        if out is not subprocess.DEVNULL:
            out.close()
        if not wait:
            return True
        for _ in range(100):
            if self.cli("ping", ok=False, timeout_ms=200).returncode == 0:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    # poll, wait and send_signal: as subprocess.Popen's, on the daemon started last.
    def poll(self):
        return self.proc.poll()

    def wait(self, timeout=None):
        return self.proc.wait(timeout)

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, timeout=30):
        """SIGCONT (for a stopped one) and SIGTERM, then wait up to timeout seconds.

        Returns its exit status; None if it was still running (then SIGKILLed).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def log_text(self):
        """What its log holds ('' without one)."""
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, errors="replace") as f:  # (a log may quote hostile bytes)
            return f.read()


def python_env(kvblend):
    """The environment of a Python of its own that imports the kvblend package of this
    tree over the libkvblend built beside the kvblend CLI (with libasan preloaded when
    that library is built with ASan)."""
    here = os.path.dirname(os.path.abspath(__file__))
    lib = os.path.join(os.path.dirname(os.path.abspath(kvblend)), "..", "lib", "libkvblend.so")
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    asan = next((ln.split()[2] for ln in ldd.splitlines() if "libasan" in ln), "")
    env = {**os.environ, "KVBLEND_LIB": lib, "LD_PRELOAD": asan,
           "PYTHONPATH": os.path.join(here, "..", "..", "client", "python", "src")}
    if asan:  # (Python itself leaks by LeakSanitizer's count)
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
    return env


def python_client(kvblend, code, timeout=60):
    """Run code in such a Python (python_env); its CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=python_env(kvblend), timeout=timeout)


def wait_for(fn, seconds, step=0.1):
    """Call fn until it returns something true or seconds pass; its last value."""
    end = time.time() + seconds
    while True:
        v = fn()
        if v or time.time() > end:
            return v
        time.sleep(step)

class Etcd:
    """A real etcd (Debian's etcd-server) on free loopback ports, its data in TMP/etcd and
    its log in TMP/etcd.log. url is its client URL; start() may follow a stop (same data).

    tls: None, or a dict of PEM paths: cert and key (the server's), ca (the CA it trusts
    client certificates from: --client-cert-auth) and client_cert, client_key (what
    start() shows it when it asks for the version). extra: more etcd flags."""

    def __init__(self, tmp, name="kvbtest", tls=None, extra=()):
        self.tmp, self.name, self.tls, self.extra = tmp, name, tls, list(extra)
        self.binary = shutil.which("etcd") or "/usr/bin/etcd"
        self.port, self.peer = free_port(), free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.proc = None

    def ssl_context(self):
        """The client side of tls (None without): trusts ca, shows the client certificate."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls["ca"])
        ctx.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        return ctx

    def start(self):
        """Start it and wait (20 s at most) until it answers; returns whether it does."""
        peer = f"http://127.0.0.1:{self.peer}"
        tls = []
        if self.tls:
            tls = ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"],
                   "--trusted-ca-file", self.tls["ca"], "--client-cert-auth"]
        with open(f"{self.tmp}/etcd.log", "a") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--name", self.name, "--data-dir", f"{self.tmp}/etcd",
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"{self.name}={peer}", *tls, *self.extra],
                stdout=log, stderr=subprocess.STDOUT)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{self.url}/version", timeout=1,
                                       context=self.ssl_context()).read()
                return True
            except OSError:
                if self.proc.poll() is not None:
                    return False
                time.sleep(0.1)
        return False

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def log_text(self):
        with open(f"{self.tmp}/etcd.log", errors="replace") as f:
            return f.read()
