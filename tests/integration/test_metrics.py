#!/usr/bin/env python3
"""The Prometheus endpoint and `kvblend stats` through the real daemon: counters move with
the requests made, histograms are well formed, other paths get 404, the endpoint is off
unless configured, and stats --json shows the same figures.

usage: test_metrics.py KVBLENDD KVBLEND
"""
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

KVBLENDD, KVBLEND = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="kvb-metrics-")
ep = f"ipc://{tmp}/kvblend.sock"
passed = failed = 0


def check(name, cond, detail=""):
    global passed, failed
    passed += bool(cond)
    failed += not cond
    print(f"{'ok' if cond else 'not ok'} - {name}" + ("" if cond else f" {detail}"))


def cli(*args):
    return subprocess.run([KVBLEND, "--endpoint", ep, *map(str, args)], capture_output=True,
                          text=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def scrape(port, path="/metrics"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def samples(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


port = free_port()
d = subprocess.Popen([KVBLENDD, "--data-dir", f"{tmp}/data", "--listen", ep, "--map-size", "1G",
                      "--metrics-port", str(port)], stderr=subprocess.DEVNULL)
try:
    for _ in range(100):
        if cli("--timeout", "200", "ping").returncode == 0:
            break
        time.sleep(0.1)
    before = samples(scrape(port)[2])
    cli("demo")
    for _ in range(3):
        cli("lookup", "--model", "demo-tiny", "00" * 32)
    status, ctype, text = scrape(port)
    m = samples(text)
    check("200 and Prometheus text", status == 200 and ctype.startswith("text/plain"))
    check("puts counted", m['kvblend_requests_total{op="put"}'] - before.get(
        'kvblend_requests_total{op="put"}', 0) == 3)
    check("lookup misses counted", m["kvblend_lookup_misses_total"] >= 4)
    check("chunks and bytes", m["kvblend_chunks"] == 3 and m["kvblend_stored_bytes"] > 0
          and m["kvblend_raw_bytes"] == 3 * 262144)
    b = [k for k in m if k.startswith('kvblend_request_duration_seconds_bucket{op="get"')]
    counts = [m[k] for k in b]
    check("get latency histogram cumulative, ends at +Inf = count",
          len(b) == 14 and counts == sorted(counts) and 'le="+Inf"' in b[-1]
          and counts[-1] == m['kvblend_request_duration_seconds_count{op="get"}'] == 3)
    check("backend info", any(k.startswith("kvblend_backend_info{backend=\"cpu-") for k in m))
    for name in ["kvblend_evictions_total", "kvblend_fuse_sessions", "kvblend_compression_ratio",
                 "kvblend_received_bytes_total", "kvblend_sent_bytes_total",
                 'kvblend_errors_total{code="not_found"}', "kvblend_uptime_seconds"]:
        check(f"has {name}", name in m)
    try:
        scrape(port, "/other")
        check("404 elsewhere", False)
    except urllib.error.HTTPError as e:
        check("404 elsewhere", e.code == 404)
    st = json.loads(cli("stats", "--json").stdout)
    check("stats --json shows the same figures",
          st["chunks"] == m["kvblend_chunks"] and st["requests_put"] == 3
          and st["latency_ms_mean_get"] > 0 and st["latency_ms_p99_le_get"] > 0
          and any(k.startswith("backend_cpu-") for k in st) and "evictions" in st)
    human = cli("stats").stdout
    check("stats for humans", "latency_ms_mean_put" in human and "chunks" in human)
finally:
    d.terminate()
    check("daemon exits 0", d.wait(30) == 0)
# off unless configured: nothing listens on a fresh port
port2 = free_port()
d = subprocess.Popen([KVBLENDD, "--data-dir", f"{tmp}/data", "--listen", ep],
                     stderr=subprocess.DEVNULL)
try:
    for _ in range(100):
        if cli("--timeout", "200", "ping").returncode == 0:
            break
        time.sleep(0.1)
    s = socket.socket()
    check("off by default", s.connect_ex(("127.0.0.1", port2)) != 0)
    s.close()
finally:
    d.terminate()
    d.wait(30)
subprocess.run(["rm", "-rf", tmp])
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
