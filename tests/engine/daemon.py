"""Start and stop a real kvblendd on a temporary data directory and IPC socket (tests only)."""

import os
import subprocess
import tempfile
import time
from pathlib import Path

import kvblend


def kvblendd_path():
    """kvblendd next to the libkvblend the tests load ($KVBLEND_LIB), or $KVBLENDD."""
    if os.environ.get("KVBLENDD"):
        return os.environ["KVBLENDD"]
    lib = Path(kvblend.library_path).resolve()
    return str(lib.parent.parent / "bin" / "kvblendd")


class Daemon:
    """A kvblendd child process; ``endpoint`` is its IPC socket."""

    def __init__(self, *args):
        """Start kvblendd; ``args`` are extra command-line options."""
        self.dir = tempfile.mkdtemp(prefix="kvblend-engine.")
        self.endpoint = f"ipc://{self.dir}/kvblend.sock"
        self.log = open(f"{self.dir}/kvblendd.log", "w")
        self.proc = subprocess.Popen(
            [kvblendd_path(), "--data-dir", f"{self.dir}/data", "--listen", self.endpoint,
             "--workers", "2", *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with kvblend.Client(self.endpoint, timeout_ms=500) as c:
                    c.ping()
                return
            except kvblend.KvblendError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvblendd did not start; log in {self.dir}") from None
                time.sleep(0.1)

    def stats(self):
        with kvblend.Client(self.endpoint, timeout_ms=2000) as c:
            return c.stats()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
