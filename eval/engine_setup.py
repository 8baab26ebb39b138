"""What running kvblend inside vLLM needs: the package installed, and a kvblendd.

:func:`install_package` pip-installs client/python into a folder, so that vLLM's
processes find kvblend's ``vllm.general_plugins`` entry point (the blend pass needs the
model it hands over); :class:`Daemon` starts and stops a real kvblendd on a temporary
data directory and IPC socket, :func:`cluster` several on one static member list;
:class:`Group` runs any other child (vLLM's server, a shell block) in a process group of
its own, and :func:`free_port` finds a port for it. Used
by eval/run_vllm.py, bench/bench_vllm.py and the engine tests (tests/engine/fixtures.py):
tests import eval/, never the reverse. kvblend is imported when a daemon starts, not
before: a caller that installs the package first and then drops kvblend from
sys.modules gets the installed copy here too.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "client" / "python"
#: The entry point the installed package must carry.
ENTRY_POINT = "kvblend.vllm.plugin:register"


def install_package(target):
    """Pip install client/python into the folder target; return its entry_points.txt text.

    As client/python/test_install.sh does: pip of a venv over Debian's python3 (its
    setuptools and wheel), offline, without build isolation; KVBLEND_BUNDLE=0 (no
    library build: $KVBLEND_LIB names the build's).

    Raises
    ------
    RuntimeError
        pip failed, or the installed package lacks the ``vllm.general_plugins`` entry
        point :data:`ENTRY_POINT`.
    """
    env = dict(os.environ, KVBLEND_BUNDLE="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="kvblend-src.") as tmp:
        src, venv = Path(tmp) / "src", Path(tmp) / "venv"
        src.mkdir()
        # A copy of the package without build/ (a bundled build there is not wanted here).
        subprocess.run(["cp", "-r", str(PACKAGE / "pyproject.toml"), str(PACKAGE / "setup.py"),
                        str(PACKAGE / "README.md"), str(PACKAGE / "src"), str(src)], check=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                            "--no-deps", "--no-index", "--no-build-isolation", "--target",
                            str(target), str(src)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install failed:\n{r.stdout}\n{r.stderr}")
    eps = list(Path(target).glob("kvblend-*.dist-info/entry_points.txt"))
    if not eps:
        raise RuntimeError("the installed package has no entry_points.txt")
    text = eps[0].read_text()
    if "[vllm.general_plugins]" not in text or ENTRY_POINT not in text:
        raise RuntimeError(f"entry point missing:\n{text}")
    return text


def kvblendd_path():
    """kvblendd next to the libkvblend the tests load ($KVBLEND_LIB), or $KVBLENDD."""
    if os.environ.get("KVBLENDD"):
        return os.environ["KVBLENDD"]
    import kvblend

    lib = Path(kvblend.library_path).resolve()
    return str(lib.parent.parent / "bin" / "kvblendd")


def wait_for_daemon(endpoint, alive, seconds=30.0):
    """Wait until a kvblendd answers a ping on ``endpoint``.

    ``alive()`` says whether its process still runs. Raises RuntimeError when it died or
    did not answer within ``seconds``.
    """
    import kvblend

    deadline = time.monotonic() + seconds
    while True:
        try:
            with kvblend.Client(endpoint, timeout_ms=500) as c:
                c.ping()
            return
        except kvblend.KvblendError:
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"kvblendd did not start on {endpoint}") from None
            time.sleep(0.1)


class Daemon:
    """A kvblendd child process; ``endpoint`` is its IPC socket, its log ``dir``/kvblendd.log."""

    def __init__(self, *args, tcp=None, kvblendd=None, workers=2):
        """Start kvblendd; ``args`` are extra command-line options, ``tcp`` a
        ``tcp://HOST:PORT`` it listens on besides the IPC socket (for other members).
        ``kvblendd``: the binary (default :func:`kvblendd_path`); ``workers``: its
        ``--workers`` (None: the daemon's default)."""
        self.dir = tempfile.mkdtemp(prefix="kvblend-engine.")
        self.endpoint = f"ipc://{self.dir}/kvblend.sock"
        self.tcp = tcp
        listen = f"{self.endpoint},{tcp}" if tcp else self.endpoint
        self.log = open(f"{self.dir}/kvblendd.log", "w")
        opts = [] if workers is None else ["--workers", str(workers)]
        self.proc = subprocess.Popen(
            [kvblendd or kvblendd_path(), "--data-dir", f"{self.dir}/data", "--listen", listen,
             *opts, *args], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for_daemon(self.endpoint, lambda: self.proc.poll() is None)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; log in {self.dir}") from None

    def stats(self):
        import kvblend

        with kvblend.Client(self.endpoint, timeout_ms=2000) as c:
            return c.stats()

    def stop(self, keep=False):
        """Stop kvblendd (SIGTERM, then SIGKILL after 10 s) and remove its directory.

        The directory (data and log) stays when ``keep`` is true, when the daemon
        did not exit cleanly (a crash, a kill: the log is the evidence; its path is
        printed), or when ``KVBLEND_KEEP_DAEMON_DIRS`` is set in the environment.
        """
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        clean = self.proc.returncode == 0
        if keep or not clean or os.environ.get("KVBLEND_KEEP_DAEMON_DIRS"):
            if not clean:
                print(f"kvblendd exited with {self.proc.returncode}; its log: "
                      f"{self.dir}/kvblendd.log")
            return
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster(ids, *args):
    """Start one :class:`Daemon` per id of ``ids``, members of one static cluster.

    Each has its own data directory and IPC socket (for its engine) and a free port on
    loopback (for the others: plain TCP, which kvblendd allows on loopback), and all are
    given the same ``--cluster-peers`` list (docs/cluster.md); ``args`` are extra options
    for every member. Returns the daemons in the order of ``ids``; on a failed start the
    ones started are stopped and the RuntimeError raised.
    """
    socks = [socket.socket() for _ in ids]
    try:
        for s in socks:  # all bound at once: no port handed out twice
            s.bind(("127.0.0.1", 0))
        tcp = {i: f"tcp://127.0.0.1:{s.getsockname()[1]}" for i, s in zip(ids, socks)}
    finally:
        for s in socks:
            s.close()
    peers = ",".join(f"{i}={tcp[i]}" for i in ids)
    started = []
    try:
        for i in ids:
            started.append(Daemon("--node-id", i, "--cluster-peers", peers, *args, tcp=tcp[i]))
    except BaseException:
        for d in started:
            d.stop()
        raise
    return started


def free_port():
    """A TCP port on 127.0.0.1 that is free now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
