#!/usr/bin/env python3
"""Three real kvblendd daemons sharing one chunk space through a static cluster_peers
list (docs/cluster.md), driven with the kvblend CLI over each daemon's IPC socket;
the daemons talk to each other over TCP on loopback.

Checks: a chunk PUT on A is readable on C byte for byte; with R = 2, SIGKILL of the
node that took the PUTs leaves every chunk readable from the other two; a node that
was down while chunks were written receives them when it returns (pushes owed are
kept and retried); a SIGSTOPped peer delays a request by no more than the timeout;
a fuse opened on B over chunks stored elsewhere gives the bytes a fuse on A gives;
a bad member list is refused at start with a message naming it.

usage: python3 -m pytest tests/integration/test_cluster.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import signal
import subprocess
import tempfile
import time

import numpy as np

import cluster_common as cc
import kvbtest


def test_cluster(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-cluster-")
    check = kvbtest.Checks()
    L, H, D = cc.L, cc.H, cc.D
    TIMEOUT_MS = 500

    NODES = {n: kvbtest.free_port() for n in "abc"}
    PEERS = ",".join(f"{n}=tcp://127.0.0.1:{p}" for n, p in NODES.items())
    procs = {}

    def ep(n):
        return f"ipc://{TMP}/{n}.sock"

    def cli(n, *args, ok=True):
        return kvbtest.cli(kvblend, ep(n), *args, timeout_ms=20000, ok=ok, label=f"kvblend@{n}")

    def start(n, peers=PEERS, wait=True, extra=()):
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "1G", "--node-id", n,
                           "--cluster-peers", peers, "--cluster-replicas", "2",
                           "--cluster-timeout-ms", TIMEOUT_MS, "--log-level", "debug", *extra,
                           name=n,
                           listen=f"{ep(n)},tcp://127.0.0.1:{NODES[n]}")
        procs[n] = d
        d.start(wait)
        return d

    def stats(n):
        return json.loads(cli(n, "stats", "--json").stdout)

    def wait_owed(n, seconds=30):
        end = time.time() + seconds
        while time.time() < end:
            if stats(n)["cluster_pushes_owed"] == 0:
                return True
            time.sleep(0.1)
        return False

    try:
        # A bad member list is refused with a message that names it.
        r = subprocess.run([kvblendd, "--data-dir", f"{TMP}/x", "--listen", f"ipc://{TMP}/x.sock",
                            "--node-id", "x", "--cluster-peers", "y=udp://nowhere"],
                           capture_output=True, text=True, timeout=20)
        check("a bad cluster_peers entry is refused at start",
              r.returncode != 0 and "cluster_peers" in r.stderr and "tcp://" in r.stderr, r.stderr)

        for n in NODES:
            start(n)
        for n in NODES:
            cc.add_model(cli, n)
        rng = np.random.default_rng(3)
        chunks = cc.put_chunks(cli, TMP, "a", 0, 12, rng)

        # Read-through: C reads everything A took, byte for byte.
        bad = cc.readable(cli, TMP, "c", chunks)
        check("a chunk PUT on A is readable on C, byte for byte", not bad, str(bad))
        st = stats("c")
        check("C fetched what it does not own", st["cluster_remote_hits"] > 0 and
              st["cluster_fetched_bytes"] > 0, str(st.get("cluster_remote_hits")))
        # (a HELLO slower than cluster_hedge_ms leaves that one call in frames: not all)
        check("C's fetches came on bulk connections (cluster_bulk, the default)",
              0 < st["cluster_bulk_fetches"] <= st["cluster_remote_hits"],
              f'{st["cluster_bulk_fetches"]} of {st["cluster_remote_hits"]}')
        check("A pushed every chunk to its owners", wait_owed("a"), str(stats("a")))
        pushes = stats("a")["cluster_pushes_done"]
        check("A pushed one or two copies per chunk (to owners other than itself)",
              12 <= pushes <= 24, f"pushes {pushes}")
        bulk = stats("a")["cluster_bulk_pushes"]
        received = sum(stats(n)["bulk_bytes_received"] for n in "bc")
        check("A's pushes went on bulk connections, B and C read them there",
              0 < bulk <= pushes and received > 0, f"{bulk} of {pushes}; {received} bytes received")

        # R = 2: the node that took the PUTs dies; every chunk is still readable elsewhere.
        procs["a"].send_signal(signal.SIGKILL)
        procs["a"].wait()
        bad = cc.readable(cli, TMP, "b", chunks) + cc.readable(cli, TMP, "c", chunks)
        check("SIGKILL of A: every chunk readable from B and C", not bad, str(bad))

        # B is down while A takes more chunks; it receives them when it returns.
        start("a")
        b_before = stats("b")["chunks"]
        procs["b"].send_signal(signal.SIGKILL)
        procs["b"].wait()
        more = cc.put_chunks(cli, TMP, "a", 100, 12, rng)
        time.sleep(0.5)
        owed = stats("a")["cluster_pushes_owed"]
        check("pushes to a dead member are owed", owed > 0, f"owed {owed}")
        cs = json.loads(cli("a", "cluster", "status", "--json").stdout)
        mem = {m["id"]: m for m in cs["members"]}
        check("cluster status: B suspect with pushes owed, C alive with none",
              mem["b"]["state"] == "suspect" and mem["b"]["pushes_owed"] > 0 and
              mem["c"]["state"] == "alive" and mem["c"]["pushes_owed"] == 0 and
              cs["cluster_members"] == 3, str(cs))
        # A restarts too: what it owes survives in its store.
        procs["a"].send_signal(signal.SIGTERM)
        procs["a"].wait()
        start("a")
        check("owed pushes survive a restart of the pushing daemon",
              stats("a")["cluster_pushes_owed"] > 0, str(stats("a")["cluster_pushes_owed"]))
        done_before = stats("a")["cluster_pushes_done"]
        start("b")
        check("B catches up when it returns", wait_owed("a"), str(stats("a")))
        sent = stats("a")["cluster_pushes_done"] - done_before
        b_after = stats("b")["chunks"]
        check("B received exactly what it was owed", sent > 0 and b_after - b_before == sent,
              f"sent {sent}, B grew by {b_after - b_before}")
        procs["a"].send_signal(signal.SIGKILL)
        procs["a"].wait()
        bad = cc.readable(cli, TMP, "b", more) + cc.readable(cli, TMP, "c", more)
        check("with A gone, B and C serve the chunks written while B was down", not bad, str(bad))
        start("a")

        # A stopped peer never holds a request past the timeout.
        procs["c"].send_signal(signal.SIGSTOP)
        try:
            for attempt in range(2):
                t0 = time.time()
                r = cli("b", "get", "--model", "cm", "--hash", "ab" * 32, "--out", f"{TMP}/x.npy",
                        ok=False)
                dt = time.time() - t0
                check(f"a miss with C stopped is answered within the timeout ({attempt + 1})",
                      r.returncode != 0 and "not found" in r.stderr.lower() and
                      dt < TIMEOUT_MS / 1000 * 2 + 1.0, f"{dt:.2f} s: {r.stderr.strip()}")
            # heartbeats (every second to a member not heard from) find the stopped member
            end = time.time() + 1.0 + 2 * TIMEOUT_MS / 1000 + 1.0
            while time.time() < end and stats("b").get("member:c") != 0:
                time.sleep(0.1)
            st = stats("b")
            check("C is marked suspect by B's heartbeats", st.get("member:c") == 0 and
                  st["cluster_suspect"] >= 1 and st["seen_ms:c"] > TIMEOUT_MS,
                  str({k: v for k, v in st.items() if ":" in k}))
            # (states depend on timing here: a suspicion lasts 2 s from the last missed call)
            out = cli("b", "cluster", "status").stdout
            rows = {ln.split()[0]: ln.split()[1:3] for ln in out.splitlines()[1:] if ln.strip() and
                    not ln.startswith("cluster_")}
            check("cluster status (text) lists the other members with endpoint and state",
                  all(rows.get(n, [None, None])[0] == f"tcp://127.0.0.1:{NODES[n]}" and
                      rows[n][1] in ("alive", "suspect") for n in "ac") and
                  "cluster_remote_misses" in out, out)
        finally:
            procs["c"].send_signal(signal.SIGCONT)

        # Frames where bulk connections are off: C does not ask for them (cluster_bulk
        # false), B offers none (tcp_bulk false); chunks still move, byte for byte.
        for n, flag in (("c", "--cluster-bulk"), ("b", "--tcp-bulk")):
            procs[n].send_signal(signal.SIGTERM)
            procs[n].wait()
            start(n, extra=(flag, "false"))
        third = cc.put_chunks(cli, TMP, "a", 200, 8, rng)
        check("A's pushes settle with B offering no bulk connection", wait_owed("a"),
              str(stats("a")))
        bad = cc.readable(cli, TMP, "c", third) + cc.readable(cli, TMP, "b", third)
        st = stats("c")
        check("without bulk connections, chunks move in frames, byte for byte",
              not bad and st["cluster_remote_hits"] > 0 and st["cluster_bulk_fetches"] == 0 and
              "bulk_bytes_received" not in stats("b"),
              f'{bad}; C: {st["cluster_remote_hits"]} fetched, {st["cluster_bulk_fetches"]} on '
              'bulk connections')

        # A fuse on B over chunks stored on A (and C): the same fused bytes as on A.
        check("a fuse on B over chunks held elsewhere equals the fuse on A",
              cc.fuse_equal(cli, TMP, "ab", chunks[:3], rng))
    finally:
        cc.stop_all(procs, check, log_tail=2500)
        kvbtest.remove(TMP)
    check.done()
