#!/usr/bin/env python3
"""Members moving chunks on bulk connections (cluster_bulk, docs/cluster.md), under CURVE,
through a proxy that can alter one block of bytes on the way.

Two real kvblendd members, a and b, with CURVE keys and R = 2 (both own every chunk),
without hedging (a new socket's HELLO is then waited for its whole deadline, so every
transfer goes on the bulk connection and the counts below are exact).
a reaches b at 127.0.0.2, where a TCP proxy forwards b's ZeroMQ port and its bulk port
to 127.0.0.1. Checks: a's pushes go to b on the bulk connection, sealed, and read back
byte for byte on b; a push whose record is altered on the way is refused by b (nothing
stored of it) and sent again in frames, and b then holds it byte for byte; a fetch
(a GET on a of a chunk a deleted) comes from b on the bulk connection, byte for byte;
a fetch whose record is altered on the way is refused by a, which stores nothing of it.

usage: python3 -m pytest tests/integration/test_cluster_bulk.py
       --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import subprocess
import tempfile

import numpy as np

import cluster_common as cc
import kvbtest
from tcpproxy import Proxy


def test_cluster_bulk(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-cbulk-")
    check = kvbtest.Checks()
    PORTS = {n: kvbtest.free_port() for n in "ab"}
    BULK_B = kvbtest.free_port()
    # one alteration each way when armed: the first block of 200 bytes or more that passes
    ARMED = {"up": False, "down": False}

    def keygen():
        out = subprocess.run([kvblend, "keygen"], capture_output=True, text=True, check=True).stdout
        d = dict(line.split(" ", 1) for line in out.splitlines())
        return d["public"], d["secret"]

    def armed(way):
        """A proxy's mutate: when ARMED[way], flip one bit of the first block of 200 bytes or
        more that passes, and disarm."""
        def mutate(off, b):
            if ARMED[way] and len(b) >= 200:
                ARMED[way] = False
                return b[:100] + bytes([b[100] ^ 1]) + b[101:]
            return b
        return mutate

    KEYS = {n: keygen() for n in "ab"}
    with open(f"{TMP}/authorized", "w") as f:
        for n in "ab":
            f.write(f"{KEYS[n][0]} {n}\n")
    for n in "ab":
        with open(f"{TMP}/{n}.key", "w") as f:
            f.write(KEYS[n][1] + "\n")
    procs = {}

    def ep(n):
        return f"ipc://{TMP}/{n}.sock"

    def cli(n, *args, ok=True):
        return kvbtest.cli(kvblend, ep(n), *args, timeout_ms=20000, ok=ok, label=f"kvblend@{n}")

    def stats(n):
        return json.loads(cli(n, "stats", "--json").stdout)

    def start(n):
        peers = (f"b=tcp://127.0.0.2:{PORTS['b']}={KEYS['b'][0]}" if n == "a"
                 else f"a=tcp://127.0.0.1:{PORTS['a']}={KEYS['a'][0]}")
        extra = ["--tcp-bulk-port", BULK_B] if n == "b" else []
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "1G", "--node-id", n,
                           "--cluster-peers", peers, "--cluster-replicas", 2,
                           "--cluster-timeout-ms", 2000, "--cluster-hedge-ms", 0,
                           "--curve-secret-key-file",
                           f"{TMP}/{n}.key", "--curve-authorized-keys", f"{TMP}/authorized",
                           "--log-level", "debug", *extra, name=n,
                           listen=f"{ep(n)},tcp://127.0.0.1:{PORTS[n]}")
        procs[n] = d
        d.start()

    def owed_zero(n):
        return kvbtest.wait_for(lambda: stats(n)["cluster_pushes_owed"] == 0, 30)

    proxies = [Proxy(PORTS["b"]), Proxy(BULK_B, armed("down"), armed("up"))]
    try:
        for n in "ab":
            start(n)
        cc.add_model(cli, "a")
        rng = np.random.default_rng(5)

        chunks = cc.put_chunks(cli, TMP, "a", 0, 6, rng)
        check("a's pushes to b settle", owed_zero("a"), str(stats("a")))
        sa, sb = stats("a"), stats("b")
        check("a's pushes went on the bulk connection, sealed; b opened their records",
              sa["cluster_bulk_pushes"] == sa["cluster_pushes_done"] == 6 and
              sb["bulk_records_opened"] >= 6, f'{sa["cluster_bulk_pushes"]} of '
              f'{sa["cluster_pushes_done"]}; b opened {sb["bulk_records_opened"]}')
        bad = cc.readable(cli, TMP, "b", chunks)
        check("b holds them byte for byte", not bad, str(bad))

        ARMED["up"] = True
        altered = cc.put_chunks(cli, TMP, "a", 10, 1, rng)
        check("a's push of the next chunk settles", owed_zero("a"), str(stats("a")))
        check("the proxy altered a record of it", not ARMED["up"])
        bad = cc.readable(cli, TMP, "b", altered)
        check("a push altered on the way: refused by b, sent again in frames, stored whole",
              not bad and "failed its" in procs["b"].log_text() and
              "sent again in frames" in procs["a"].log_text(), str(bad))
        check("... and counted as a push in frames",
              stats("a")["cluster_bulk_pushes"] == 6 and stats("a")["cluster_pushes_done"] == 7,
              str(stats("a")))
        check("no corrupt copy on b", stats("b")["corrupt_removed"] == 0)

        # fetches: a deletes its copies, then reads them through b
        for h, _ in chunks[:3]:
            cli("a", "rm", "--model", "cm", "--hash", h)
        f0 = stats("a")
        bad = cc.readable(cli, TMP, "a", chunks[:2])
        sa = stats("a")
        check("a fetches what it deleted from b, on the bulk connection, byte for byte",
              not bad and sa["cluster_bulk_fetches"] - f0["cluster_bulk_fetches"] == 2 and
              sa["cluster_remote_hits"] - f0["cluster_remote_hits"] == 2,
              f'{bad}; {sa["cluster_bulk_fetches"] - f0["cluster_bulk_fetches"]} on bulk, '
              f'{sa["cluster_remote_hits"] - f0["cluster_remote_hits"]} fetched; '
              f'{sa["cluster_fetch_failures"] - f0["cluster_fetch_failures"]} failed')
        ARMED["down"] = True
        h, kv = chunks[2]
        r = cli("a", "get", "--model", "cm", "--hash", h, "--out", f"{TMP}/g.npy", ok=False)
        check("the proxy altered a record of the next fetch", not ARMED["down"])
        check("a fetch altered on the way: refused by a, nothing stored",
              r.returncode != 0 and "bulk connection" in procs["a"].log_text() and
              stats("a")["cluster_fetch_failures"] > f0["cluster_fetch_failures"], r.stderr)
        held = cli("a", "ls", "--model", "cm").stdout
        check("... and a holds no copy of it", h not in held and chunks[0][0] in held, held)
    finally:
        cc.stop_all(procs, check, log_tail=3000)
        for p in proxies:
            p.close()
        kvbtest.remove(TMP)
    check.done()
