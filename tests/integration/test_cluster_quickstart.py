"""docs/cluster.md's quick start as written, on a real etcd (Debian's etcd-server):
three daemons, no CURVE keys, tcp://127.0.0.1 endpoints, --node-id, --cluster-etcd and
--capacity and nothing else (free ports instead of 7001-7003 and 2379).

usage: python3 -m pytest tests/integration/test_cluster_quickstart.py
       --kvblendd KVBLENDD --kvblend KVBLEND

Checks (issue 20):
1. keyless etcd membership works: no member publishes a key; a model registered on
   n1, a chunk PUT through n1 reads back byte for byte through n2 and n3; cluster
   status shows every other member alive with a reply under 5 s old, and this daemon
   itself; the pushes owed drain to 0.
2. a model registered on one member is known on all: with a fourth member (R = 2),
   chunks PUT on n1, a GET through a member that holds no copy and was never pushed a
   chunk of the model (it has no model) answers the bytes, and registers the model.
3. members that left are forgotten: n1 restarted with --cluster-forget-after 3 (and
   --cluster-grace 0: a member in its grace is still placed, never forgotten); n4
   stops; n1 shows it gone, then no longer lists it (status, stats, Prometheus).
"""

import json
import tempfile
import time
import urllib.request

import numpy as np

import cluster_common as cc
import kvbtest


def test_cluster_quickstart(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-qs-")
    cli = cc.MemberCli(kvblend, TMP)
    stats = cli.stats
    check = kvbtest.Checks()
    ETCD = kvbtest.Etcd(TMP)
    PORTS = {n: kvbtest.free_port() for n in ("n1", "n2", "n3", "n4")}
    METRICS_PORT = kvbtest.free_port()
    FORGET_S = 3
    daemons = {}

    def daemon(n, *extra):
        # the quick start's command line: data dir, ipc and tcp listen, node id, etcd, capacity
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--node-id", n, "--cluster-etcd", ETCD.url,
                           "--capacity", "8G", *extra, name=n, data=f"{TMP}/kvb-{n}",
                           listen=f"ipc://{TMP}/{n}.sock,tcp://127.0.0.1:{PORTS[n]}")
        daemons[n] = d
        return d.start()

    def status(n):
        return {m["id"]: m for m in json.loads(cli(n, "cluster", "status", "--json").stdout)
                ["members"]}

    wait_for = kvbtest.wait_for

    def etcd_records():
        """The member records in etcd (its v3 JSON gateway), by id."""
        import base64
        key = base64.b64encode(b"/kvblend/kvblend/members/").decode()
        end = base64.b64encode(b"/kvblend/kvblend/members0").decode()
        req = urllib.request.Request(f"{ETCD.url}/v3/kv/range",
                                     data=json.dumps({"key": key, "range_end": end}).encode())
        kvs = json.loads(urllib.request.urlopen(req, timeout=5).read()).get("kvs", [])
        out = {}
        for kv in kvs:
            rec = json.loads(base64.b64decode(kv["value"]))
            out[rec["id"]] = rec
        return out

    rng = np.random.default_rng(20)
    try:
        check("etcd starts", ETCD.start(), ETCD.log_text()[-2000:])
        for n in ("n1", "n2", "n3"):
            check(f"{n} starts as the quick start has it", daemon(n), daemons[n].log_text()[-2000:])
        three = {"n1", "n2", "n3"}
        ok = wait_for(lambda: all({k for k, m in status(n).items() if m["state"] == "alive"} ==
                                  three for n in three), 20)
        check("the three find each other through etcd, each listing itself", ok,
              str({n: status(n) for n in three}))
        recs = etcd_records()
        check("no member publishes a CURVE key", set(recs) == three and
              all(r["curve_public_key"] == "" for r in recs.values()), str(recs))

        # 1. register on n1, PUT through n1, GET through n2 and n3
        cc.add_model(cli, "n1")
        chunks = cc.put_chunks(cli, TMP, "n1", 0, 6, rng)
        bad = cc.readable(cli, TMP, "n2", chunks) + cc.readable(cli, TMP, "n3", chunks)
        check("a chunk PUT through n1 reads back byte for byte through n2 and n3", not bad,
              str(bad))
        ok = wait_for(lambda: all(stats(n)["cluster_pushes_owed"] == 0 for n in three), 20)
        check("the pushes owed drain to 0", ok,
              str({n: stats(n)["cluster_pushes_owed"] for n in three}))
        st = {n: stats(n) for n in three}
        check("pushes were made and none failed",
              sum(s["cluster_pushes_done"] for s in st.values()) > 0 and
              all(s["cluster_push_failures"] == 0 for s in st.values()),
              str({n: (s["cluster_pushes_done"], s["cluster_push_failures"]) for n,
                   s in st.items()}))
        time.sleep(1.5)  # a heartbeat round
        mem = status("n1")
        check("cluster status on n1: every member alive with a reply under 5 s old, n1 itself "
              "included with its endpoint",
              set(mem) == three and all(m["state"] == "alive" for m in mem.values()) and
              all(0 <= mem[n]["last_reply_ms"] < 5000 for n in three) and
              mem["n1"]["endpoint"] == f"tcp://127.0.0.1:{PORTS['n1']}", str(mem))

        # 2. a fourth member: a model registered on one member is readable through any
        check("n4 starts", daemon("n4"), daemons["n4"].log_text()[-2000:])
        four = three | {"n4"}
        ok = wait_for(lambda: all({k for k, m in status(n).items() if m["state"] == "alive"} ==
                                  four for n in four), 20)
        check("every member sees four", ok, str({n: status(n) for n in four}))
        cli("n1", "model", "add", "m2", "--layers", cc.L, "--kv-heads", cc.H, "--head-dim", cc.D,
            "--dtype", "f16", "--rope-theta", 10000)
        kv = rng.standard_normal((cc.L, 2, 8, cc.H, cc.D)).astype(np.float16)
        np.save(f"{TMP}/m2.npy", kv)
        np.save(f"{TMP}/m2ids.npy", np.arange(8))
        h = cli("n1", "put", "--model", "m2", "--kv", f"{TMP}/m2.npy", "--tokens",
                f"{TMP}/m2ids.npy", "--pos", 0).stdout.split()[0]
        wait_for(lambda: all(stats(n)["cluster_pushes_owed"] == 0 for n in four), 20)
        models = {n: cli(n, "model", "ls").stdout for n in four}
        without = [n for n in sorted(four - {"n1"}) if "m2" not in models[n]]
        check("a member never pushed a chunk of m2 does not know it", len(without) >= 1,
              str(models))
        if without:
            n = without[0]
            r = cli(n, "get", "--model", "m2", "--hash", h, "--out", f"{TMP}/m2g.npy", ok=False)
            check(f"GET of m2 through {n} (no copy, model never pushed) answers the bytes",
                  r.returncode == 0 and np.array_equal(np.load(f"{TMP}/m2g.npy"), kv),
                  r.stderr)
            check(f"{n} registered m2 from the members' description",
                  "m2" in cli(n, "model", "ls").stdout and
                  "registered from another member's description" in daemons[n].log_text(),
                  cli(n, "model", "ls").stdout)
        r = cli("n1", "get", "--model", "nosuch", "--hash", h, "--out", f"{TMP}/x.npy", ok=False)
        check("a model no member has is still unknown_model",
              r.returncode != 0 and "unknown" in r.stderr, r.stderr)

        # 3. members that left are forgotten
        check("n1 stops", daemons["n1"].stop() == 0)
        check("n1 restarts with --cluster-forget-after 3",
              daemon("n1", "--cluster-forget-after", FORGET_S, "--cluster-grace", 0,
                     "--metrics-port",
                     METRICS_PORT), daemons["n1"].log_text()[-2000:])
        ok = wait_for(lambda: {k for k, m in status("n1").items() if m["state"] == "alive"} == four,
                      20)
        check("n1 sees four again", ok, str(status("n1")))
        check("n4 stops", daemons["n4"].stop() == 0)
        gone = wait_for(lambda: status("n1").get("n4", {}).get("state") == "gone", 10)
        check("n1 shows n4 gone once it leaves", gone, str(status("n1")))
        t0 = time.time()
        forgot = wait_for(lambda: "n4" not in status("n1"), FORGET_S + 10)
        dt = time.time() - t0
        check(f"n1 forgets n4 after about {FORGET_S} s (owed nothing)",
              forgot and dt <= FORGET_S + 3, f"{dt:.1f} s {status('n1')}")
        st = stats("n1")
        text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics",
                                      timeout=5).read().decode()
        check("n4 is gone from stats and Prometheus too",
              not any(k.endswith(":n4") for k in st) and 'member="n4"' not in text and
              'member="n2"' in text, str({k: v for k, v in st.items() if ":" in k}))
        check("n2 (default forget time) still lists n4 as gone",
              status("n2").get("n4", {}).get("state") == "gone", str(status("n2")))
        check("n1 logged forgetting it", "member 'n4' forgotten" in daemons["n1"].log_text())
        # n4 returns: known again
        check("n4 restarts", daemon("n4"))
        ok = wait_for(lambda: status("n1").get("n4", {}).get("state") == "alive", 20)
        check("n4 back: n1 lists it alive again", ok, str(status("n1")))
    finally:
        cc.stop_all(daemons, check, log_tail=3000)
        ETCD.stop()
        kvbtest.remove(TMP)
    check.done()
