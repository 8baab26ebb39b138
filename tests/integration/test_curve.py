#!/usr/bin/env python3
"""CURVE on TCP through the real daemon and CLI: an authorized client key works, another
key and a client without the server key are refused, IPC needs no keys, a non-loopback
TCP endpoint without CURVE is refused at start, and a bad key file names the problem.

usage: test_curve.py KVBLENDD KVBLEND
"""
import os
import socket
import subprocess
import sys
import tempfile
import time

KVBLENDD, KVBLEND = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="kvb-curve-")
passed = failed = 0


def check(name, cond, detail=""):
    global passed, failed
    passed += bool(cond)
    failed += not cond
    print(f"{'ok' if cond else 'not ok'} - {name}" + ("" if cond else f" {detail}"))


def keygen():
    out = subprocess.run([KVBLEND, "keygen"], capture_output=True, text=True, check=True).stdout
    d = dict(line.split(" ", 1) for line in out.splitlines())
    return d["public"], d["secret"]


def cli(ep, *args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}
    e.update(env or {})
    try:
        return subprocess.run([KVBLEND, "--endpoint", ep, "--timeout", "1500", *args],
                              capture_output=True, text=True, env=e, timeout=60)
    except subprocess.TimeoutExpired as x:  # a hung CLI fails its check, not the whole test
        return subprocess.CompletedProcess(x.cmd, -9, "", f"kvblend hung: {x}")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


srv_pub, srv_sec = keygen()
cli_pub, cli_sec = keygen()
other_pub, other_sec = keygen()
open(f"{tmp}/server.key", "w").write(f"# kvblendd CURVE secret key\n{srv_sec}\n")
open(f"{tmp}/clients", "w").write(f"# serving nodes\n{cli_pub}   node-1\n")
port = free_port()
tcp, ipc = f"tcp://127.0.0.1:{port}", f"ipc://{tmp}/kvblend.sock"
d = subprocess.Popen([KVBLENDD, "--data-dir", f"{tmp}/data", "--listen", ipc, "--listen", tcp,
                      "--curve-secret-key-file", f"{tmp}/server.key",
                      "--curve-authorized-keys", f"{tmp}/clients", "--map-size", "256M"],
                     stderr=open(f"{tmp}/log", "w"))
try:
    for _ in range(100):
        if cli(ipc, "ping").returncode == 0:
            break
        time.sleep(0.1)
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
    check("malformed key is a one-line error", r.returncode == 1 and "Z85" in r.stderr, r.stderr)
    check("IPC needs no keys", cli(ipc, "ping").returncode == 0)
    check("refusals logged", "refused" in open(f"{tmp}/log").read())
finally:
    d.terminate()
    check("daemon exits 0", d.wait(30) == 0)

r = subprocess.run([KVBLENDD, "--data-dir", f"{tmp}/d2", "--listen",
                    f"tcp://0.0.0.0:{free_port()}"], capture_output=True, text=True, timeout=30)
check("off-loopback TCP without CURVE refused at start",
      r.returncode != 0 and "unencrypted" in r.stderr, r.stderr)
open(f"{tmp}/bad.key", "w").write("not a key\n")
r = subprocess.run([KVBLENDD, "--data-dir", f"{tmp}/d3", "--listen", ipc, "--listen", tcp,
                    "--curve-secret-key-file", f"{tmp}/bad.key"], capture_output=True,
                   text=True, timeout=30)
check("bad key file named", r.returncode != 0 and "bad.key" in r.stderr and "Z85" in r.stderr,
      r.stderr)
subprocess.run(["rm", "-rf", tmp])
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
