"""The one Python harness that starts kvblend's real processes: kvblendd, etcd, and any
other child in a process group (vLLM's server).

* :class:`Daemon`: one kvblendd on a data directory and IPC socket of its own (a
  temporary folder, or a scratch folder the caller owns), waited for with a ping,
  stopped with SIGTERM (SIGKILL after a timeout) and its exit status returned.
* :func:`cluster`: several daemons on one static member list.
* :class:`Etcd`: a real etcd (Debian's etcd-server) on free loopback ports, plain or TLS.
* :class:`Group`: any child in a process group of its own, stopped as a group.
* :func:`free_port` (never the same port twice, across the processes of a test run),
  :func:`wait_for`, :func:`wait_for_daemon`.

Used by the Python tests (their harness, tests/harness/kvbtest.py, and the engine tests),
eval/ and bench/. Tests import eval/, never the reverse.
Only the standard library is imported here: the integration tests run on Debian's
python3 without numpy, so a daemon is pinged through the Python client only where
that imports (:meth:`Daemon.ready`; kvbtest pings with the CLI instead).
"""

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

_ports_given = set()


def _ports_registry():
    """The file where free_port records the ports it hands out, shared by every process of
    this user (ctest runs tests in parallel): $KVBLEND_PORTS_FILE, else a file under the
    temporary folder. None where it cannot be opened (each process then keeps its own)."""
    path = os.environ.get("KVBLEND_PORTS_FILE") or os.path.join(
        tempfile.gettempdir(), f"kvblend-ports-{os.getuid()}")
    try:
        return open(path, "a+")
    except OSError:
        return None


# How long a port free_port handed out stays out of its hands, in any process: longer than
# any test or CI run keeps one.
_PORT_HOLD_S = 4 * 3600


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now, never one handed out before in
    this process or, within hours, in another (the ports go through a file of this user's,
    locked; see _ports_registry), and below the kernel's ephemeral range where that leaves
    room: a port the kernel picks for bind(0) is an ephemeral one, which any outgoing
    connection may take before the daemon binds it, and the kernel may hand the same one
    out twice."""
    import fcntl

    reg = _ports_registry()
    try:
        taken, now = {}, time.time()
        if reg is not None:
            fcntl.flock(reg, fcntl.LOCK_EX)
            reg.seek(0)
            for line in reg.read().split("\n"):
                try:
                    port, when = line.split()
                    if now - float(when) < _PORT_HOLD_S:
                        taken[int(port)] = float(when)
                except ValueError:
                    pass
        port = _pick_port(taken)
        if reg is not None:
            taken[port] = now
            reg.seek(0)
            reg.truncate()
            reg.write("".join(f"{p} {w:.0f}\n" for p, w in taken.items()))
            reg.flush()
        return port
    finally:
        if reg is not None:
            reg.close()  # (and the lock with it)


def _pick_port(taken):
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(4000):
        want = rng.randrange(10000, low) if low > 12000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", want))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _ports_given and port not in taken:
            _ports_given.add(port)
            return port
    raise RuntimeError("free_port: no free port found in 4000 tries")


def wait_for(fn, seconds, step=0.1):
    """Call fn until it returns something true or seconds pass; its last value."""
    end = time.time() + seconds
    while True:
        v = fn()
        if v or time.time() > end:
            return v
        time.sleep(step)


def kvblendd_path():
    """kvblendd next to the libkvblend the Python client loads, or $KVBLENDD."""
    if os.environ.get("KVBLENDD"):
        return os.environ["KVBLENDD"]
    import kvblend

    lib = Path(kvblend.library_path).resolve()
    return str(lib.parent.parent / "bin" / "kvblendd")


def ping(endpoint, timeout_ms=500):
    """Whether a kvblendd answers a ping on endpoint (through the Python client)."""
    import kvblend

    try:
        with kvblend.Client(endpoint, timeout_ms=timeout_ms) as c:
            c.ping()
        return True
    except kvblend.KvblendError:
        return False


def wait_for_daemon(endpoint, alive, seconds=30.0):
    """Wait until a kvblendd answers a ping on ``endpoint``; ``alive()`` says whether its
    process still runs. Raises RuntimeError when it died or did not answer in time."""
    deadline = time.monotonic() + seconds
    while not ping(endpoint):
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"kvblendd did not start on {endpoint}")
        time.sleep(0.1)


def daemon_environ():
    """This environment for a daemon: without LD_PRELOAD (an ASan preload is for a Python
    that loads an ASan libkvblend; kvblendd links ASan itself), and with ASAN_OPTIONS from
    KVBLEND_DAEMON_ASAN_OPTIONS where that is set."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if "KVBLEND_DAEMON_ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] = env["KVBLEND_DAEMON_ASAN_OPTIONS"]
    return env


class Daemon:
    """One kvblendd: ``KVBLENDD [FIRST...] [--config CONF] --data-dir DATA --listen LISTEN
    [--workers W] FLAGS...``.

    dir: the folder for its data, socket and log; None makes a temporary one, which stop()
    removes after a clean exit (kept after a crash or a kill, with ``keep``, or when
    KVBLEND_KEEP_DAEMON_DIRS is set: its log is the evidence). By default DATA is
    DIR/data, the endpoint ipc://DIR/kvblend.sock and the log (stdout and stderr,
    appended) DIR/kvblendd.log; with name N: DIR/N-data, ipc://DIR/N.sock, DIR/N.log.
    log=False discards its output. listen: what it listens on (default the endpoint;
    ``tcp`` adds a tcp:// address for other members). config: settings
    (docs/configuration.md) written to DIR/kvblendd.conf and passed with --config;
    the flags override them. workers: --workers (2, the test machines' cores; None: the
    daemon's default). environ: its environment (None: :func:`daemon_environ`).
    kvblend_cli: the kvblend CLI, which ready() pings with (default: the Python client).
    start: start it now and raise RuntimeError (the log's tail in the message) when it
    does not answer; False: the caller calls start().
    """

    def __init__(self, *flags, kvblendd=None, dir=None, name=None, data=None, listen=None,
                 tcp=None, config=None, log=None, environ=None, first=(), workers=2,
                 kvblend_cli=None, start=True):
        self.own_dir = dir is None
        self.dir = str(dir) if dir is not None else tempfile.mkdtemp(prefix="kvblend-daemon.")
        stem = f"{self.dir}/{name}" if name else None
        self.data = str(data or (f"{stem}-data" if name else f"{self.dir}/data"))
        self.endpoint = f"ipc://{stem}.sock" if name else f"ipc://{self.dir}/kvblend.sock"
        self.tcp = tcp
        default_log = f"{stem}.log" if name else f"{self.dir}/kvblendd.log"
        self.log = None if log is False else str(log or default_log)
        listen = listen or (f"{self.endpoint},{tcp}" if tcp else self.endpoint)
        conf = []
        if config:
            self.config = Path(self.dir) / f"{name or 'kvblendd'}.conf"
            self.config.write_text("".join(f"{k} = {v}\n" for k, v in config.items()))
            conf = ["--config", str(self.config)]
        self.argv = [str(a) for a in (kvblendd or kvblendd_path(), *first, *conf,
                                      "--data-dir", self.data, "--listen", listen,
                                      *(["--workers", workers] if workers else []), *flags)]
        self.environ, self.kvblend_cli = environ, kvblend_cli
        self.proc = None
        self.problems = []
        if start and not self.start():
            tail = self.tail()
            self.kill()
            raise RuntimeError(f"kvblendd did not start on {self.endpoint}; log in "
                               f"{self.log}:\n{tail}")

    def ready(self):
        """Whether it answers a ping now (200 ms), through kvblend_cli or the Python client."""
        if self.kvblend_cli:
            return subprocess.run([self.kvblend_cli, "--endpoint", self.endpoint, "--timeout",
                                   "200", "ping"], capture_output=True).returncode == 0
        return ping(self.endpoint, timeout_ms=200)

    def start(self, wait=True, seconds=20):
        """Start it; with wait, ping it (ready(), 0.1 s apart, for up to seconds) until it
        answers. Returns whether it answered (True without wait): False when it exited or
        did not answer in time (it may still be starting: the caller checks)."""
        out = open(self.log, "a") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out,
                                     env=daemon_environ() if self.environ is None
                                     else self.environ)
        if out is not subprocess.DEVNULL:
            out.close()
        if not wait:
            return True
        deadline = time.monotonic() + seconds
        while True:
            if self.ready():
                return True
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    # poll, wait and send_signal: as subprocess.Popen's, on the process started last.
    def poll(self):
        return self.proc.poll()

    def wait(self, timeout=None):
        return self.proc.wait(timeout)

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def kill(self):
        """SIGKILL and reap it (nothing if it has exited)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()

    def stop(self, timeout=30, keep=False):
        """SIGCONT (for a stopped one) and SIGTERM, then wait up to timeout seconds (then
        SIGKILL). Keeps the log's warning and error lines in self.problems; removes a
        temporary dir as the class says. Returns its exit status; None if it was killed."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self.problems = [line for line in self.log_text().splitlines()
                         if any(w in line.lower() for w in ("warn", "error", "fail"))]
        if self.own_dir:
            if keep or rc != 0 or os.environ.get("KVBLEND_KEEP_DAEMON_DIRS"):
                if rc != 0:
                    print(f"kvblendd exited with {rc}; its log: {self.log}")
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
        return rc

    def log_text(self):
        """What its log holds ('' without one)."""
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, errors="replace") as f:  # (a log may quote hostile bytes)
            return f.read()

    def tail(self, chars=4000):
        return self.log_text()[-chars:]

    def client(self, timeout_ms=120000):
        """A Python client on its endpoint."""
        import kvblend

        return kvblend.Client(self.endpoint, timeout_ms=timeout_ms)

    def stats(self):
        with self.client(timeout_ms=2000) as c:
            return c.stats()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def cluster(ids, *args, **opts):
    """One :class:`Daemon` per id of ``ids``, members of one static cluster.

    Each has its own folder and IPC socket (for its engine) and a free port on loopback
    (for the others: plain TCP, which kvblendd allows on loopback), and all are given the
    same ``--cluster-peers`` list (docs/cluster.md); ``args`` are extra flags and ``opts``
    Daemon's options for every member. Returns the daemons in the order of ``ids``; on a
    failed start the ones started are stopped and the RuntimeError raised.
    """
    tcp = {i: f"tcp://127.0.0.1:{free_port()}" for i in ids}
    peers = ",".join(f"{i}={tcp[i]}" for i in ids)
    started = []
    try:
        for i in ids:
            started.append(Daemon("--node-id", i, "--cluster-peers", peers, *args, tcp=tcp[i],
                                  **opts))
    except BaseException:
        for d in started:
            d.stop()
        raise
    return started


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


class Group:
    """A child in a process group of its own, logging to log_path; stop() ends the group.

    vLLM's server forks engine processes: ending only the leader would leave them
    running, so stop() signals the whole group (SIGTERM, then SIGKILL).
    """

    def __init__(self, argv, log_path, env):
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open while the child runs)
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def tail(self, n=40):
        """The log's last n lines."""
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self):
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children of the group may outlive the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
