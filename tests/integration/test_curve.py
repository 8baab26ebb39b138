#!/usr/bin/env python3
"""CURVE on TCP through the real daemon and CLI: an authorized client key works, another
key and a client without the server key are refused, IPC needs no keys, a non-loopback
TCP endpoint without CURVE is refused at start, and a bad key file names the problem.

usage: python3 -m pytest tests/integration/test_curve.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import subprocess
import tempfile

import kvbtest


def test_curve(kvblendd, kvblend):
    tmp = tempfile.mkdtemp(prefix="kvb-curve-")
    check = kvbtest.Checks()

    def keygen():
        out = subprocess.run([kvblend, "keygen"], capture_output=True, text=True, check=True).stdout
        d = dict(line.split(" ", 1) for line in out.splitlines())
        return d["public"], d["secret"]

    def cli(ep, *args, env=None):
        return kvbtest.cli(kvblend, ep, *args, timeout_ms=1500, env=env or {}, hang_s=60)

    srv_pub, srv_sec = keygen()
    cli_pub, cli_sec = keygen()
    other_pub, other_sec = keygen()
    open(f"{tmp}/server.key", "w").write(f"# kvblendd CURVE secret key\n{srv_sec}\n")
    open(f"{tmp}/clients", "w").write(f"# serving nodes\n{cli_pub}   node-1\n")
    port = kvbtest.free_port()
    tcp = f"tcp://127.0.0.1:{port}"
    d = kvbtest.Daemon(kvblendd, kvblend, tmp, "--listen", tcp, "--curve-secret-key-file",
                       f"{tmp}/server.key", "--curve-authorized-keys", f"{tmp}/clients",
                       "--map-size", "256M", timeout_ms=1500, env={}, hang_s=60)
    ipc = d.ep
    d.start()
    try:
        keys = {"KVBLEND_SERVER_KEY": srv_pub, "KVBLEND_CLIENT_KEY": cli_sec}
        r = cli(tcp, "ping", env=keys)
        check("authorized client over CURVE", r.returncode == 0, r.stderr)
        r = cli(tcp, "demo", env=keys)
        check("demo over CURVE TCP (frames path)", r.returncode == 0 and "demo done" in r.stdout,
              r.stderr)
        r = cli(tcp, "ping", env={"KVBLEND_SERVER_KEY": srv_pub, "KVBLEND_CLIENT_KEY": other_sec})
        check("unlisted client key refused", r.returncode == 1 and r.stderr.count("\n") == 1,
              r.stderr)
        r = cli(tcp, "ping", env={"KVBLEND_SERVER_KEY": srv_pub})
        check("ephemeral client key refused", r.returncode == 1, r.stderr)
        r = cli(tcp, "ping")
        check("plain client refused on the CURVE endpoint", r.returncode == 1, r.stderr)
        r = cli(tcp, "ping", env={"KVBLEND_SERVER_KEY": "short"})
        check("malformed key is a one-line error", r.returncode == 1 and "Z85" in r.stderr,
              r.stderr)
        check("IPC needs no keys", cli(ipc, "ping").returncode == 0)
        check("refusals logged", "refused" in d.log_text())
    finally:
        check("daemon exits 0", d.stop() == 0)

    r = subprocess.run([kvblendd, "--data-dir", f"{tmp}/d2", "--listen",
                        f"tcp://0.0.0.0:{kvbtest.free_port()}"], capture_output=True, text=True,
                       timeout=30)
    check("off-loopback TCP without CURVE refused at start",
          r.returncode != 0 and "unencrypted" in r.stderr, r.stderr)
    open(f"{tmp}/bad.key", "w").write("not a key\n")
    r = subprocess.run([kvblendd, "--data-dir", f"{tmp}/d3", "--listen", ipc, "--listen", tcp,
                        "--curve-secret-key-file", f"{tmp}/bad.key"], capture_output=True,
                       text=True, timeout=30)
    check("bad key file named", r.returncode != 0 and "bad.key" in r.stderr and "Z85" in r.stderr,
          r.stderr)
    kvbtest.remove(tmp)
    check.done()
