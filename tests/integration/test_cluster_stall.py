#!/usr/bin/env python3
"""A member that answers a FETCH and then stalls its payload (issue 55, item 2): the hedge
holds over the whole transfer (docs/cluster.md, Failure handling).

Three real kvblendd members a, b, c on a static list, keyless on loopback, R = 3 (each
holds every chunk), cluster_hedge_ms 200, cluster_timeout_ms 3000, two workers each. a
reaches b at 127.0.0.2, where a TCP proxy forwards b's ZeroMQ port and its bulk port to
127.0.0.1. a deletes its copies of chunks it asks b for before c (placement order), then:

- a read through b's bulk connection works (the control of the path);
- with the proxy holding every byte b sends on its bulk connection (b answers the FETCH
  at once, its payload never comes), a GET on a answers c's bytes within 4x the hedge
  delay; the same read while b is silent (SIGSTOP) is the control, both printed as
  `# stall: ...` (each GET timed in its client, around the GET alone, as the repro);
- the stall counts against b: `cluster_fetch_stalls` counts it, a shows b suspect after
  b answered a heartbeat since, and the next read asks c, not b;
- two such reads at once (as many as a's workers) keep no other client waiting: a HELLO
  sent meanwhile is answered within 4x the hedge delay.

The size bound on a FETCH reply (max_message) is tested by tests/unit/test_fetch_reply.c:
a member cannot be made to lie about sizes here, where b is a real daemon.

usage: python3 -m pytest tests/integration/test_cluster_stall.py
       --kvblendd KVBLENDD --kvblend KVBLEND --place-tool PLACE_TOOL
"""
import json
import signal
import subprocess
import tempfile
import time

import numpy as np

import cluster_common as cc
import kvbtest
from tcpproxy import Proxy


def test_cluster_stall(kvblendd, kvblend, place_tool):
    TMP = tempfile.mkdtemp(prefix="kvb-cstall-")
    check = kvbtest.Checks()
    PORTS = {}
    while len(set(PORTS.values())) < 4:  # four distinct ports (the kernel may repeat one)
        PORTS = {n: kvbtest.free_port() for n in ("a", "b", "c", "bulk_b")}
    HEDGE_MS, SLOW_MS = 200, 3000
    daemons = {}

    def ep(n):
        return f"ipc://{TMP}/{n}.sock"

    def cli(n, *args, ok=True):
        return kvbtest.cli(kvblend, ep(n), *args, timeout_ms=20000, ok=ok, env={},
                           label=f"kvblend@{n}")

    def stats(n):
        return json.loads(cli(n, "stats", "--json").stdout)

    def peer(m, via_proxy):
        return f"{m}=tcp://127.0.0.{2 if via_proxy else 1}:{PORTS[m]}"

    def start(n):
        peers = ",".join(peer(m, n == "a" and m == "b") for m in "abc" if m != n)
        extra = ["--tcp-bulk-port", PORTS["bulk_b"]] if n == "b" else []
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "256M", "--node-id", n,
                           "--workers", 2, "--cluster-peers", peers, "--cluster-replicas", 3,
                           "--cluster-timeout-ms", SLOW_MS, "--cluster-hedge-ms", HEDGE_MS,
                           *extra, name=n, listen=f"{ep(n)},tcp://127.0.0.1:{PORTS[n]}", env={})
        daemons[n] = d
        return d.start()

    def timed_reads(n, chunks, hello=False):
        """GETs of chunks through n, at once (one client each), each timed in its client
        around the GET alone (Client.get into an array of the chunk's size: no LOOKUP
        first); with hello, a HELLO (Client.ping) from another client 50 ms after they
        start, timed the same way. Returns [(seconds, whether it answered the chunk's
        bytes)] and the HELLO's seconds (None without)."""
        for i, (_, kv) in enumerate(chunks):
            np.save(f"{TMP}/want{i}.npy", kv)
        r = kvbtest.python_client(kvblend, f"""
import threading, time, numpy as np, kvblend
hashes, ep, tmp = {[h for h, _ in chunks]!r}, {ep(n)!r}, {TMP!r}
wants = [np.load(f"{{tmp}}/want{{i}}.npy") for i in range(len(hashes))]
clients = [kvblend.Client(ep, timeout_ms=20000) for _ in range(len(hashes) + 1)]
res = [(float("inf"), 0)] * len(hashes)

def read(i):
    out = np.empty_like(wants[i])
    t0 = time.monotonic()
    try:
        clients[i].get("cm", hashes[i], out=out)
        res[i] = (time.monotonic() - t0, int(np.array_equal(out, wants[i])))
    except Exception as x:
        print("#", x)

ts = [threading.Thread(target=read, args=(i,)) for i in range(len(hashes))]
for t in ts:
    t.start()
hello = -1.0
if {hello!r}:
    time.sleep(0.05)
    t0 = time.monotonic()
    clients[-1].ping()
    hello = time.monotonic() - t0
for t in ts:
    t.join()
print(hello, *[x for r in res for x in r])
""")
        try:
            v = r.stdout.split("\n")[-2].split()
            return [(float(v[1 + 2 * i]), v[2 + 2 * i] == "1") for i in range(len(chunks))], \
                (float(v[0]) if hello else None)
        except (ValueError, IndexError):
            return [(float("inf"), False)] * len(chunks), (float("inf") if hello else None)

    def timed_read(n, chunk):
        return timed_reads(n, [chunk])[0][0]

    def b_first(chunks):
        """The chunks a asks b for before c: b ahead of c in placement order."""
        r = subprocess.run([place_tool, "3", "a", "b", "c"], check=True, capture_output=True,
                           text=True, input="\n".join(h for h, _ in chunks) + "\n")
        order = {ln.split()[0]: [m for m in ln.split()[1:] if m != "a"]
                 for ln in r.stdout.splitlines()}
        return [(h, kv) for h, kv in chunks if order[h] == ["b", "c"]]

    proxies = {"zmq": Proxy(PORTS["b"]), "bulk": Proxy(PORTS["bulk_b"])}
    try:
        for n in "abc":
            check(f"{n} starts", start(n), daemons[n].log_text()[-2000:])
        ok = kvbtest.wait_for(lambda: all(stats("a").get(f"member:{m}") == 1 for m in "bc"), 20)
        check("a sees b (through the proxy) and c", ok)
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 24, np.random.default_rng(55))
        ok = kvbtest.wait_for(lambda: stats("a")["cluster_pushes_owed"] == 0, 30)
        check("a's pushes to b and c settle", ok, str(stats("a")))
        victims = b_first(chunks)
        check("some chunks a asks b for first", len(victims) >= 6, str(len(victims)))
        for h, _ in victims:
            cli("a", "rm", "--model", "cm", "--hash", h)

        s0 = stats("a")
        dt, good = timed_read("a", victims[0])
        s1 = stats("a")
        check(f"a fetches a chunk from b on its bulk connection ({dt * 1000:.0f} ms)",
              good and s1["cluster_bulk_fetches"] - s0["cluster_bulk_fetches"] == 1, str(s1))

        # b answers the FETCH at once; its payload never comes (a new bulk connection's
        # 1-byte answer to its hello still does)
        proxies["bulk"].stall("down", after=1)
        dt_stall, good = timed_read("a", victims[1])
        t_read = time.time()
        s2 = stats("a")
        check("a stalled payload: the read answers the bytes from c", good)
        check(f"... within 4x the hedge delay ({dt_stall * 1000:.0f} ms, hedge {HEDGE_MS} ms, "
              f"timeout {SLOW_MS} ms)", dt_stall < 4 * HEDGE_MS / 1000)
        check("... counted as a stall (cluster_fetch_stalls)",
              s2.get("cluster_fetch_stalls", 0) - s1.get("cluster_fetch_stalls", 0) == 1,
              str(s2.get("cluster_fetch_stalls")))
        # b answers its heartbeats all along (its ZeroMQ port is not stalled): once it has
        # answered one since the read (within about 1.25 s), a must still skip it (2 s)
        ok = kvbtest.wait_for(lambda: stats("a")["seen_ms:b"] < (time.time() - t_read) * 1000,
                              1.5, 0.05)
        s3 = stats("a")
        after = (time.time() - t_read) * 1000
        check(f"the stall counts against b: suspect on a after b answered a heartbeat "
              f"({after:.0f} ms after the read)", ok and s3["member:b"] == 0,
              f'seen_ms:b {s3["seen_ms:b"]}, member:b {s3["member:b"]}')
        served = {m: stats(m)["requests_fetch"] for m in "bc"}
        dt, good = timed_read("a", victims[2])
        served = {m: stats(m)["requests_fetch"] - served[m] for m in "bc"}
        check(f"... and the next read asks c, not b ({dt * 1000:.0f} ms)",
              good and served == {"b": 0, "c": 1}, f"FETCHes served: {served}")
        log = daemons["a"].log_text()
        check("a names the stall in its log", "payload stalled" in log, log[-1500:])

        # two stalled reads at once (as many as a's workers) hold them no longer than that
        ok = kvbtest.wait_for(lambda: stats("a")["member:b"] == 1, 10)
        check("b is alive again on a once the mark expired", ok)
        st0 = stats("a").get("cluster_fetch_stalls", 0)
        res, dt_hello = timed_reads("a", victims[3:5], hello=True)
        stalls = stats("a").get("cluster_fetch_stalls", 0) - st0
        check(f"two stalled reads at once answer c's bytes within 4x the hedge delay "
              f"({res[0][0] * 1000:.0f} and {res[1][0] * 1000:.0f} ms)",
              all(g for _, g in res) and max(dt for dt, _ in res) < 4 * HEDGE_MS / 1000, str(res))
        check(f"... both stalled on b ({stalls} stalls)", stalls == 2)
        check(f"... and another client's HELLO meanwhile is answered within 4x the hedge delay "
              f"({dt_hello * 1000:.0f} ms)", dt_hello < 4 * HEDGE_MS / 1000)

        # the control: b silent (stopped), once a counts it alive again
        proxies["bulk"].stall("down", False)
        ok = kvbtest.wait_for(lambda: stats("a")["member:b"] == 1, 10)
        check("b is alive again on a", ok)
        daemons["b"].send_signal(signal.SIGSTOP)
        try:
            dt_silent, good = timed_read("a", victims[5])
        finally:
            daemons["b"].send_signal(signal.SIGCONT)
        check(f"b silent: the read answers the bytes from c ({dt_silent * 1000:.0f} ms)", good)
        print(f"# stall: b's payload stalled {dt_stall * 1000:.0f} ms, b silent "
              f"{dt_silent * 1000:.0f} ms; two stalled reads {res[0][0] * 1000:.0f} and "
              f"{res[1][0] * 1000:.0f} ms, a HELLO meanwhile {dt_hello * 1000:.0f} ms "
              f"(hedge {HEDGE_MS} ms, timeout {SLOW_MS} ms)")
        check("a stalled payload costs within 2 hedge delays of a silent member",
              dt_stall < dt_silent + 2 * HEDGE_MS / 1000,
              f"{dt_stall * 1000:.0f} ms against {dt_silent * 1000:.0f} ms")
    finally:
        cc.stop_all(daemons, check, log_tail=3000)
        for p in proxies.values():
            p.close()
        kvbtest.remove(TMP)
    check.done()
