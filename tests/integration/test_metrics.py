#!/usr/bin/env python3
"""The Prometheus endpoint and `kvblend stats` through the real daemon: counters move with
the requests made, histograms are well formed, other paths get 404, the endpoint is off
unless configured, and stats --json shows the same figures. Slow or silent clients hold
neither the endpoint nor the daemon's shutdown.

usage: python3 -m pytest tests/integration/test_metrics.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import kvbtest


def test_metrics(kvblendd, kvblend):
    tmp = tempfile.mkdtemp(prefix="kvb-metrics-")
    check = kvbtest.Checks()

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

    port = kvbtest.free_port()
    d = kvbtest.Daemon(kvblendd, kvblend, tmp, "--map-size", "1G", "--metrics-port", port,
                       log=False)
    cli = d.cli
    d.start()
    try:
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
        for name in ["kvblend_evictions_total", "kvblend_fuse_sessions",
                     "kvblend_compression_ratio",
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

        # Slow clients (issue 7): one that connects and sends nothing, one that sends half a
        # request line, and one that trickles a byte now and then must not hold the endpoint.
        idle = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET /met")
        stop_trickle = threading.Event()
        trickle_err = []

        def trickle():
            t = socket.create_connection(("127.0.0.1", port))
            try:
                for _ in range(50):  # 15 s at most
                    if stop_trickle.wait(0.3):
                        break
                    t.sendall(b"x")
            except OSError as e:  # the daemon dropped it: what it should do
                trickle_err.append(e)
            t.close()

        tt = threading.Thread(target=trickle, daemon=True)
        tt.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        try:
            status, _, text = scrape(port)
        except OSError as e:
            status, text = str(e), ""
        took = time.monotonic() - t0
        check("/metrics served while slow clients hold connections",
              status == 200 and "kvblend_chunks" in text and took < 1.0, f"took {took:.2f} s")
        big = socket.create_connection(("127.0.0.1", port))
        big.settimeout(5)
        big.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n")
        try:
            got = big.recv(64)
        except OSError as e:
            got = str(e).encode()
        check("an oversized request head gets 431", got.startswith(b"HTTP/1.1 431"), got)
        big.close()
        # Both get dropped after the per-connection timeout (2 s), not held forever.
        for name, sock in (("idle", idle), ("half-request", half)):
            sock.settimeout(6)
            t0 = time.monotonic()
            try:
                got = sock.recv(100)
            except OSError:
                got = b""
            check(f"{name} connection dropped after the timeout",
                  got == b"" and time.monotonic() - t0 < 4, f"got {got!r}")
            sock.close()
        tt.join(6)
        check("trickling connection dropped", bool(trickle_err), "still open")
        stop_trickle.set()
        tt.join()

        # SIGTERM while clients hold connections open (and one trickles): the daemon stops at
        # once, without waiting for them (it waited 21 s in issue 7).
        stop_trickle.clear()
        tt = threading.Thread(target=trickle, daemon=True)
        tt.start()
        time.sleep(0.3)
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        slow[1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.7)
        t0 = time.monotonic()
        d.proc.terminate()
        try:
            rc = d.proc.wait(10)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        print(f"# SIGTERM to exit with slow metrics clients: {took:.2f} s")
        # Shorter than the 2 s per-connection timeout: stop waits on no client.
        check("SIGTERM with slow metrics clients: exits 0 at once", rc == 0 and took < 1.8,
              f"status {rc} after {took:.2f} s")
        stop_trickle.set()
        tt.join()
        for sock in slow:
            sock.close()
    finally:
        if d.poll() is None:
            rc = d.stop()
            check("daemon exits 0", rc == 0,
                  "still running 30 s after SIGTERM" if rc is None else f"status {rc}")
    # off unless configured: nothing listens on a fresh port
    port2 = kvbtest.free_port()
    d = kvbtest.Daemon(kvblendd, kvblend, tmp, log=False)
    d.start()
    try:
        s = socket.socket()
        check("off by default", s.connect_ex(("127.0.0.1", port2)) != 0)
        s.close()
    finally:
        d.stop()
    kvbtest.remove(tmp)
    check.done()
