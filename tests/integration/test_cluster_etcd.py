"""A kvblendd cluster whose membership lives in a real etcd (Debian's etcd-server),
started and stopped by this test, with four real daemons on loopback, each with its
own data directory, TCP port and CURVE key, and only the members' keys authorized.

usage: python3 -m pytest tests/integration/test_cluster_etcd.py
       --kvblendd KVBLENDD --kvblend KVBLEND --place-tool PLACE_TOOL

Checks (issue 10): a PUT on A is readable on C byte for byte; every chunk sits on
exactly the owners rendezvous hashing names; with R = 2 SIGKILL of any one node
leaves every chunk readable; a member whose lease expires is dropped from placement
within the TTL and requests do not wait on it; a node that was down while chunks
were written receives the chunks it owns when it returns; a new member receives the
chunks it now owns; a SIGSTOPped peer delays no request past the timeout; etcd
stopped mid-run leaves the cluster serving; a peer or client with an unknown key is
refused and counted; a fuse on B over chunks held elsewhere equals the fuse on A;
at the end nothing is lost and every copy verifies. cluster_grace is 0 here: a member
that leaves is re-placed at once (the grace itself: test_cluster_ops.py grace). The
same cluster with the static member list: test_cluster.py.
"""

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import numpy as np

import cluster_common as cc
import kvbtest


def test_cluster_etcd(kvblendd, kvblend, place_tool):
    TMP = tempfile.mkdtemp(prefix="kvb-etcd-")
    check = kvbtest.Checks()
    L, H, D = cc.L, cc.H, cc.D
    TIMEOUT_MS = 500
    TTL = 3
    R = 2

    def keygen():
        out = subprocess.run([kvblend, "keygen"], capture_output=True, text=True, check=True).stdout
        d = dict(line.split(" ", 1) for line in out.splitlines())
        return d["public"], d["secret"]

    NODES = {n: kvbtest.free_port() for n in "abcd"}
    KEYS = {n: keygen() for n in list(NODES) + ["rogue", "client", "stranger"]}
    # every member authorizes every member and the serving node's client key
    with open(f"{TMP}/authorized", "w") as f:
        for n in list(NODES) + ["client"]:
            f.write(f"{KEYS[n][0]} {n}\n")
    for n in list(NODES) + ["rogue"]:
        with open(f"{TMP}/{n}.key", "w") as f:
            f.write(KEYS[n][1] + "\n")
    ETCD = kvbtest.Etcd(TMP)
    ETCD_URL = ETCD.url
    METRICS_PORT = kvbtest.free_port()  # A's Prometheus endpoint
    procs = {}

    def ep(n):
        return f"ipc://{TMP}/{n}.sock"

    def cli(n, *args, ok=True, endpoint=None, env=None):
        return kvbtest.cli(kvblend, endpoint or ep(n), *args, timeout_ms=20000, ok=ok,
                           env=env or {}, label=f"kvblend@{n}")

    def start(n, wait=True):
        args = ["--map-size", "1G", "--node-id", n, "--cluster-etcd", ETCD_URL, "--cluster-name",
                "t", "--cluster-lease-ttl", TTL, "--cluster-replicas", R, "--cluster-timeout-ms",
                TIMEOUT_MS, "--cluster-grace", 0, "--curve-secret-key-file", f"{TMP}/{n}.key",
                "--curve-authorized-keys", f"{TMP}/authorized", "--log-level", "debug"]
        if n == "a":
            args += ["--metrics-port", METRICS_PORT]
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, *args, name=n,
                           listen=f"{ep(n)},tcp://127.0.0.1:{NODES[n]}", env={})
        procs[n] = d
        d.start(wait)
        return d

    def kill(n, sig=signal.SIGKILL):
        procs[n].send_signal(sig)
        if sig == signal.SIGKILL:
            procs[n].wait()

    def stats(n):
        return json.loads(cli(n, "stats", "--json").stdout)

    wait_for = kvbtest.wait_for

    def view(n):
        """Member states as n sees them: {id: 1 alive, 0 suspect, -1 gone}."""
        return {k[7:]: v for k, v in stats(n).items() if k.startswith("member:")}

    def alive_set(n):
        return {m for m, v in view(n).items() if v >= 0} | {n}

    place = cc.Placement(cli, place_tool, R)
    held, missing_at_owners = place.held, place.missing

    def settled(nodes):
        return all(stats(n)["cluster_pushes_owed"] == 0 for n in nodes)

    try:
        check("etcd starts", ETCD.start(), ETCD.log_text()[-2000:])
        r = subprocess.run([kvblendd, "--data-dir", f"{TMP}/x", "--listen", f"ipc://{TMP}/x.sock",
                            "--node-id", "x", "--cluster-etcd", "ftp://nowhere"],
                           capture_output=True, text=True, timeout=20)
        check("a bad cluster_etcd is refused at start, named",
              r.returncode != 0 and "cluster_etcd" in r.stderr and "http://" in r.stderr, r.stderr)
        r = subprocess.run([kvblendd, "--data-dir", f"{TMP}/x", "--listen", f"ipc://{TMP}/x.sock",
                            "--node-id", "x", "--cluster-etcd", ETCD_URL],
                           capture_output=True, text=True, timeout=20)
        check("cluster_etcd without a TCP endpoint is refused at start",
              r.returncode != 0 and "tcp://" in r.stderr, r.stderr)

        for n in "abc":
            start(n)
        ok = wait_for(lambda: all(alive_set(n) == set("abc") for n in "abc"), 10)
        check("three daemons find each other through etcd", ok, str({n: view(n) for n in "abc"}))

        # The model is registered on A only: the others learn it from the chunks pushed to them.
        cc.add_model(cli, "a")
        rng = np.random.default_rng(5)
        chunks = cc.put_chunks(cli, TMP, "a", 0, 16, rng)
        check("A's pushes settle", wait_for(lambda: settled("a"), 30), str(stats("a")))
        opened = sum(stats(n)["bulk_records_opened"] for n in "bc")
        check("A's pushes went on bulk connections, sealed (CURVE between members)",
              0 < stats("a")["cluster_bulk_pushes"] <= stats("a")["cluster_pushes_done"] and
              opened > 0, f'{stats("a")["cluster_bulk_pushes"]} of '
              f'{stats("a")["cluster_pushes_done"]}; {opened} records opened')
        check("B and C learnt the model from the pushed chunks",
              all("cm" in cli(n, "model", "ls").stdout for n in "bc"))
        bad = missing_at_owners(chunks, "abc")
        check("every chunk sits on the R owners rendezvous hashing names", not bad, str(bad))
        hits0 = stats("c")
        sealed0 = sum(stats(n)["bulk_records_sealed"] for n in "ab")
        bad = cc.readable(cli, TMP, "c", chunks)
        check("a chunk PUT on A is readable on C, byte for byte", not bad, str(bad))
        hits = {k: stats("c")[k] - hits0[k] for k in ("cluster_remote_hits",
                                                      "cluster_bulk_fetches")}
        hits["sealed by A and B"] = sum(stats(n)["bulk_records_sealed"] for n in "ab") - sealed0
        check("C's fetches came on bulk connections, sealed (CURVE between members)",
              hits["cluster_remote_hits"] > 0 and hits["sealed by A and B"] > 0 and
              0 < hits["cluster_bulk_fetches"] <= hits["cluster_remote_hits"], str(hits))

        # R = 2: any one node SIGKILLed, every chunk is readable from the other two.
        for victim in "abc":
            kill(victim)
            others = [n for n in "abc" if n != victim]
            bad = sum((cc.readable(cli, TMP, n, chunks) for n in others), [])
            check(f"SIGKILL of {victim.upper()}: every chunk readable from the others", not bad,
                  str(bad))
            start(victim)
            wait_for(lambda: all(alive_set(n) == set("abc") for n in "abc"), 3 * TTL)

        # A member whose lease expires leaves placement within the TTL.
        kill("b")
        t0 = time.time()
        gone = wait_for(lambda: view("a").get("b") == -1 and view("c").get("b") == -1, TTL + 5)
        dt = time.time() - t0
        check(f"SIGKILLed B leaves placement within the TTL ({dt:.1f} s, TTL {TTL} s)",
              gone and dt <= TTL + 1.5, str(view("a")))
        t0 = time.time()
        r = cli("a", "get", "--model", "cm", "--hash", "cd" * 32, "--out", f"{TMP}/x.npy", ok=False)
        dt = time.time() - t0
        check(f"a request after B left does not wait on it ({dt * 1000:.0f} ms)",
              r.returncode != 0 and "not found" in r.stderr and dt < TIMEOUT_MS / 1000, r.stderr)

        # B is down while A takes more chunks; placed on A and C meanwhile; B gets its own back.
        more = cc.put_chunks(cli, TMP, "a", 100, 16, rng)
        wait_for(lambda: settled("a"), 30)
        bad = missing_at_owners(more, "ac")
        check("while B is away, chunks go to the owners among A and C", not bad, str(bad))
        start("b")
        ok = wait_for(lambda: not missing_at_owners(chunks + more, "abc"), 30)
        check("B, back, receives the chunks it owns (written while it was away too)", ok,
              str(missing_at_owners(chunks + more, "abc")))
        st = stats("a")["cluster_rebalance_pushes"] + stats("c")["cluster_rebalance_pushes"]
        check("those came as rebalance pushes", st > 0, str(st))

        # A new member joins and receives the chunks it now owns.
        start("d")
        ok = wait_for(lambda: all(alive_set(n) == set("abcd") for n in "abcd"), 10)
        check("D joins: every member sees four", ok, str({n: view(n) for n in "abcd"}))
        ok = wait_for(lambda: not missing_at_owners(chunks + more, "abcd"), 30)
        check("D receives the chunks it now owns", ok,
              str(missing_at_owners(chunks + more, "abcd")))
        n_d = len(held("d"))
        check(f"D holds about R/N of the chunks ({n_d} of {len(chunks + more)})",
              0 < n_d < len(chunks + more), str(n_d))
        sk = stats("a")["cluster_rebalance_skipped"] + stats("b")["cluster_rebalance_skipped"]
        print(f"# rebalance pushes skipped because the owner had the chunk: {sk}")

        # A stopped peer delays no request past the timeout; its lease then runs out.
        kill("c", signal.SIGSTOP)
        try:
            worst = 0.0
            for h, _ in chunks[:6] + [("ef" * 32, None)]:
                t0 = time.time()
                cli("b", "get", "--model", "cm", "--hash", h, "--out", f"{TMP}/x.npy", ok=False)
                worst = max(worst, time.time() - t0)
            check(f"with C stopped, B's requests are answered within the timeout (worst "
                  f"{worst * 1000:.0f} ms)", worst < 2 * TIMEOUT_MS / 1000 + 1.0)
            gone = wait_for(lambda: view("a").get("c") == -1, TTL + 5)
            check("stopped C leaves placement when its lease runs out", gone, str(view("a")))
        finally:
            procs["c"].send_signal(signal.SIGCONT)
        ok = wait_for(lambda: all(alive_set(n) == set("abcd") for n in "abcd"), 3 * TTL + 5)
        check("C, continued, registers again", ok, str({n: view(n) for n in "abcd"}))

        # etcd stopped mid-run: the cluster keeps serving with the membership it knew.
        ETCD.stop()
        ok = wait_for(lambda: stats("a").get("cluster_etcd_ok") == 0, 3 * TTL + 5)
        check("etcd down: stats says so", ok, str(stats("a").get("cluster_etcd_ok")))
        late = cc.put_chunks(cli, TMP, "a", 200, 6, rng)
        bad = cc.readable(cli, TMP, "b", late) + cc.readable(cli, TMP, "d", chunks[:4])
        check("etcd down: PUT on A, read-through on B and D keep working", not bad, str(bad))
        check("etcd down: the membership stays as it was",
              all(alive_set(n) == set("abcd") for n in "abcd"), str({n: view(n) for n in "abcd"}))
        check("etcd restarts", ETCD.start())
        ok = wait_for(lambda: all(stats(n).get("cluster_etcd_ok") == 1 for n in "abcd"),
                      3 * TTL + 10)
        check("etcd back: every member says so", ok)
        ok = wait_for(lambda: all(alive_set(n) == set("abcd") for n in "abcd"), 3 * TTL + 10)
        check("etcd back: four members", ok, str({n: view(n) for n in "abcd"}))

        # Unknown keys: a rogue daemon (static peer list naming A, its key unlisted) and a
        # client with an unlisted key are refused by A, and A counts them.
        before = stats("a")["curve_keys_refused"]
        rogue_port = kvbtest.free_port()
        rogue = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "256M", "--node-id", "rogue",
                               "--cluster-peers", f"a=tcp://127.0.0.1:{NODES['a']}={KEYS['a'][0]}",
                               "--cluster-timeout-ms", TIMEOUT_MS, "--curve-secret-key-file",
                               f"{TMP}/rogue.key", "--log-level", "debug", name="rogue",
                               listen=f"{ep('rogue')},tcp://127.0.0.1:{rogue_port}", env={})
        rogue.start()
        try:
            rep = rogue.ep
            cli("rogue", "model", "add", "cm", "--layers", L, "--kv-heads", H, "--head-dim", D,
                "--dtype", "f16", "--rope-theta", 10000, endpoint=rep)
            r = cli("rogue", "get", "--model", "cm", "--hash", chunks[0][0], "--out",
                    f"{TMP}/x.npy", ok=False, endpoint=rep)
            check("a peer with an unknown key gets nothing", r.returncode != 0, r.stdout)
        finally:
            rogue.stop()
        r = cli("a", "--timeout", "1500", "ping", ok=False,
                endpoint=f"tcp://127.0.0.1:{NODES['a']}",
                env={"KVBLEND_SERVER_KEY": KEYS["a"][0], "KVBLEND_CLIENT_KEY": KEYS["stranger"][1]})
        check("a client with an unknown key is refused", r.returncode != 0, r.stderr)
        r = cli("a", "--timeout", "1500", "ping", ok=False,
                endpoint=f"tcp://127.0.0.1:{NODES['a']}",
                env={"KVBLEND_SERVER_KEY": KEYS["a"][0], "KVBLEND_CLIENT_KEY": KEYS["client"][1]})
        check("the serving node's listed key is admitted", r.returncode == 0, r.stderr)
        after = stats("a")["curve_keys_refused"]
        check(f"A counted the refusals ({after - before})", after - before >= 2,
              f"{before} {after}")

        # A fuse on B over chunks held on A and C: the same fused bytes as on A.
        check("a fuse on B over chunks held elsewhere equals the fuse on A",
              cc.fuse_equal(cli, TMP, "ab", chunks[:3], rng))

        # Nothing lost: every chunk ever written is on its owners and reads back byte for byte
        # everywhere; every copy any store holds verifies (a GET checks every checksum).
        everything = chunks + more + late
        ok = wait_for(lambda: settled("abcd") and not missing_at_owners(everything, "abcd"), 30)
        check("at the end every chunk is on its owners", ok,
              str(missing_at_owners(everything, "abcd")))
        bad = sum((cc.readable(cli, TMP, n, everything) for n in "abcd"), [])
        check("at the end every chunk reads back byte for byte on every member", not bad, str(bad))
        st = {n: stats(n) for n in "abcd"}
        check("no corrupt copy anywhere", all(s["corrupt_removed"] == 0 for s in st.values()),
              str({n: s["corrupt_removed"] for n, s in st.items()}))
        out = json.loads(cli("a", "cluster", "status", "--json").stdout)
        mem = {m["id"]: m for m in out["members"]}
        check("cluster status: members, endpoints, states, heartbeats and what each holds",
              set(mem) >= set("bcd") and all(mem[n]["state"] == "alive" for n in "bcd") and
              all(mem[n]["endpoint"] == f"tcp://127.0.0.1:{NODES[n]}" for n in "bcd") and
              all(0 <= mem[n]["last_reply_ms"] < 5000 and mem[n]["chunks"] > 0 for n in "bcd") and
              out["cluster_etcd_ok"] == 1, json.dumps(out))
        table = cli("a", "cluster", "status").stdout
        check("cluster status table: a row per member with its endpoint",
              all(any(ln.split()[:3] == [n, f"tcp://127.0.0.1:{NODES[n]}", "alive"]
                      for ln in table.splitlines()) for n in "bcd"), table)
        text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics",
                                      timeout=5).read().decode()
        metric = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                  if ln.startswith("kvblend_cluster_")}
        st = stats("a")
        check("Prometheus metrics: members, pushes, remote hits and bytes, etcd up",
              metric.get("kvblend_cluster_members") == 4 and
              metric.get("kvblend_cluster_etcd_up") == 1 and
              metric.get("kvblend_cluster_pushes_total", 0) > 0 and
              metric.get("kvblend_cluster_remote_hits_total") == st["cluster_remote_hits"] and
              metric.get("kvblend_cluster_fetched_bytes_total") == st["cluster_fetched_bytes"],
              str(metric))
        # Per member, labelled with its id and the endpoint it registered in etcd.
        per = {}
        for m in re.finditer(r'^(kvblend_cluster_member_\w+)'
                             r'\{member="([^"]*)",endpoint="([^"]*)"\} (\S+)$', text, re.M):
            per.setdefault(m.group(2), {})[m.group(1)] = float(m.group(4))
            per[m.group(2)]["endpoint"] = m.group(3)
        check("Prometheus per-member series: state, owed pushes, reply age, what each holds",
              set(per) >= set("bcd") and
              all(per[n]["kvblend_cluster_member_state"] == 1 and
                  per[n]["endpoint"] == f"tcp://127.0.0.1:{NODES[n]}" and
                  0 <= per[n]["kvblend_cluster_member_last_reply_age_seconds"] < 5 and
                  per[n]["kvblend_cluster_member_chunks"] > 0 and
                  per[n]["kvblend_cluster_member_bytes"] > 0 and
                  per[n]["kvblend_cluster_member_pushes_owed"] >= 0 for n in "bcd"), str(per))
    finally:
        cc.stop_all(procs, check)
        ETCD.stop()
        if check.failed:
            for n in list(NODES) + ["rogue"]:
                if os.path.exists(f"{TMP}/{n}.log"):
                    print(f"--- {n}.log (tail)")
                    print(open(f"{TMP}/{n}.log").read()[-3000:])
        kvbtest.remove(TMP)
    check.done()
