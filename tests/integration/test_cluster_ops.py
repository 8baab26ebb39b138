"""A cluster an operator runs (issue 20), on a real etcd (Debian's etcd-server) with real
daemons on loopback, keyless as docs/cluster.md's quick start, R = 2. One part per run:

usage: python3 -m pytest tests/integration/test_cluster_ops.py
       --kvblendd KVBLENDD --kvblend KVBLEND --place-tool PLACE_TOOL --part PART
  join   a fourth member joins: each chunk that moves is sent once, by one holder
         (transfers per chunk moved, printed as `# join: ...`, at most 1.25)
  hedge  the first read after an owner is SIGKILLed asks the next owner after
         cluster_hedge_ms, not after the whole cluster_timeout_ms (printed, checked
         under 2x the hedge delay)
  grace  a member paused (SIGSTOP) past its lease but within cluster_grace causes no
         copies; one gone for longer is re-replicated after the grace, not before
  drain  a SIGTERM drains: right after the member exits every chunk has R copies on
         the others (with a grace long enough that they copied nothing themselves);
         the same stop with cluster_drain_timeout 0 (no drain) leaves chunks short
  copies with cluster_cache_pct 0, the writer's copies and read-through copies are
         reclaimed once the owners hold the chunks: exactly R copies settle (printed
         as `# copies: ...`); with a budget, cache copies settle within it
  check  `kvblend cluster check`: per member the chunks held, owned and beyond R equal
         what the members hold and placement says; copies deleted on an owner are
         reported under-replicated (by the other owner, once each), exit status 1;
         the stats gauge follows; a SIGKILLed member is reported as not answering
"""

import json
import os
import signal
import subprocess
import tempfile
import time

import numpy as np

import cluster_common as cc
import kvbtest


def test_cluster_ops(kvblendd, kvblend, place_tool, part):
    TMP = tempfile.mkdtemp(prefix=f"kvb-ops-{part}-")
    cli = cc.MemberCli(kvblend, TMP)
    stats = cli.stats
    check = kvbtest.Checks()
    ETCD = kvbtest.Etcd(TMP)
    R, TTL = 2, 3
    PORTS = {}
    while len(set(PORTS.values())) < 5:  # five distinct ports (the kernel may repeat one)
        PORTS = {n: kvbtest.free_port() for n in "abcde"}
    daemons = {}
    wait_for = kvbtest.wait_for

    def start(n, *extra, ttl=TTL):
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "256M", "--node-id", n,
                           "--cluster-etcd", ETCD.url, "--cluster-lease-ttl", ttl,
                           "--cluster-replicas", R, *[str(x) for x in extra], name=n,
                           listen=f"ipc://{TMP}/{n}.sock,tcp://127.0.0.1:{PORTS[n]}", env={})
        daemons[n] = d
        return d.start()

    def alive(n):
        return {k[7:] for k, v in stats(n).items() if k.startswith("member:") and v == 1} | {n}

    place = cc.Placement(cli, place_tool, R)
    held, owners, short = place.held, place.owners, place.missing

    def settled(nodes):
        return all(stats(n)["cluster_pushes_owed"] == 0 for n in nodes)

    def total(nodes, key):
        return sum(stats(n)[key] for n in nodes)

    def up(nodes, *extra, ttl=TTL):
        for n in nodes:
            check(f"{n} starts", start(n, *extra, ttl=ttl), daemons[n].log_text()[-2000:])
        ok = wait_for(lambda: all(alive(n) == set(nodes) for n in nodes), 20)
        check(f"{', '.join(nodes)} see each other", ok, str({n: alive(n) for n in nodes}))

    def part_join():
        up("abc")
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 60, np.random.default_rng(3))
        ok = wait_for(lambda: settled("abc") and not short(chunks, "abc"), 30)
        check("60 chunks on their owners among a, b, c", ok, str(short(chunks, "abc")))
        time.sleep(3)  # chunks stored well before the join (stored seconds are whole)
        before = total("abc", "cluster_rebalance_pushes")
        check("d starts", start("d"), daemons["d"].log_text()[-2000:])
        ok = wait_for(lambda: all(alive(n) == set("abcd") for n in "abcd"), 20)
        check("d joins: every member sees four", ok)
        ok = wait_for(lambda: not short(chunks, "abcd"), 30)
        check("d receives every chunk it now owns", ok, str(short(chunks, "abcd")))
        wait_for(lambda: settled("abcd"), 20)
        time.sleep(1)  # a late duplicate would show here
        moved = sum("d" in o for o in owners([h for h, _ in chunks], "abcd").values())
        sent = total("abc", "cluster_rebalance_pushes") - before
        ratio = sent / moved if moved else float("inf")
        print(f"# join: {sent} transfers for {moved} chunks moved ({ratio:.2f} per chunk)")
        check(f"a join sends each chunk that moves once ({sent} transfers, {moved} chunks)",
              moved > 0 and moved <= sent and ratio <= 1.25, f"{ratio:.2f}")

    HEDGE_MS, SLOW_MS = 250, 3000

    def first_read(n, chunk):
        """Seconds a GET of chunk through n takes; whether it answered the bytes."""
        h, kv = chunk
        t0 = time.time()
        r = cli(n, "get", "--model", "cm", "--hash", h, "--out", f"{TMP}/g.npy", ok=False)
        dt = time.time() - t0
        return dt, r.returncode == 0 and np.array_equal(np.load(f"{TMP}/g.npy"), kv)

    def part_hedge():
        # a lease long enough that dead c stays in placement for the whole part
        flags = ("--cluster-timeout-ms", SLOW_MS)
        up("abc", *flags, "--cluster-hedge-ms", HEDGE_MS, ttl=30)
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 40, np.random.default_rng(4))
        ok = wait_for(lambda: settled("abc") and not short(chunks, "abc"), 30)
        check("40 chunks on their owners", ok)
        # chunks b asks c for first: c their first owner, b not an owner
        own = owners([h for h, _ in chunks], "abc")
        victims = [(h, kv) for h, kv in chunks if own[h][0] == "c" and "b" not in own[h]]
        check("some chunks are owned by c first and not by b", len(victims) >= 2, str(own))
        daemons["c"].send_signal(signal.SIGKILL)
        daemons["c"].wait()
        dt, good = first_read("b", victims[0])
        print(f"# hedge: first read after the kill {dt * 1000:.0f} ms (hedge {HEDGE_MS} ms, "
              f"timeout {SLOW_MS} ms)")
        check("the read answers the bytes from the other owner", good)
        check(f"the first read after the kill asks the next owner within 2x the hedge delay "
              f"({dt * 1000:.0f} ms, hedge {HEDGE_MS} ms)", dt < 2 * HEDGE_MS / 1000)
        check("hedged fetches are counted", stats("b").get("cluster_hedged", 0) >= 1,
              str(stats("b").get("cluster_hedged")))
        # the control: b again, without hedging, still knowing nothing of c's death
        daemons["b"].stop()
        check("b restarts with --cluster-hedge-ms 0", start("b", *flags, "--cluster-hedge-ms", 0,
                                                             ttl=30))
        dt, good = first_read("b", victims[1])
        print(f"# hedge: without hedging, the first read after the kill {dt * 1000:.0f} ms")
        check(f"without hedging the first read waits for c's deadline ({dt * 1000:.0f} ms): "
              "the check can fail", good and dt >= 0.8 * SLOW_MS / 1000)

    GRACE = 10

    def part_grace():
        up("abc", "--cluster-grace", GRACE, "--cluster-timeout-ms", 300)
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 40, np.random.default_rng(6))
        ok = wait_for(lambda: settled("abc") and not short(chunks, "abc"), 30)
        check("40 chunks on their owners", ok)
        time.sleep(2.5)
        before = total("abc", "cluster_rebalance_pushes")
        # a gray failure: c paused past its lease (TTL 3 s) but within the grace
        daemons["c"].send_signal(signal.SIGSTOP)
        gone = wait_for(lambda: stats("a").get("member:c") == -1, TTL + 5)
        check("paused c's lease runs out: a shows it gone", gone, str(stats("a").get("member:c")))
        time.sleep(2)
        daemons["c"].send_signal(signal.SIGCONT)
        ok = wait_for(lambda: all(alive(n) == set("abc") for n in "abc"), 15)
        check("c, continued, is back", ok, str({n: alive(n) for n in "abc"}))
        wait_for(lambda: settled("abc"), 10)
        time.sleep(2)
        sent = total("abc", "cluster_rebalance_pushes") - before
        check(f"a pause within the grace copies nothing ({sent} rebalance pushes)", sent == 0)
        check("every chunk is still on its owners", not short(chunks, "abc"))
        # (no read through b: its read-through copies would make the check below trivial)
        before_ab = total("ab", "cluster_rebalance_pushes")
        # c gone for longer than the grace: re-replicated after it, not before
        daemons["c"].send_signal(signal.SIGKILL)
        daemons["c"].wait()
        t0 = time.time()
        wait_for(lambda: stats("a").get("member:c") == -1, TTL + 5)
        time.sleep(max(0.0, GRACE - 3 - (time.time() - t0)))
        early = total("ab", "cluster_rebalance_pushes") - before_ab
        check(f"within the grace nothing is re-replicated ({early} pushes)", early == 0)
        ok = wait_for(lambda: not short(chunks, "ab"), GRACE + 20)
        dt = time.time() - t0
        check(f"after the grace c's chunks are on their new owners ({dt:.1f} s after the kill)",
              ok and dt >= GRACE - 1, str(short(chunks, "ab")))

    def part_drain():
        # a grace long enough that the others copy nothing themselves during the test
        up("abcd", "--cluster-grace", 120)
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 60, np.random.default_rng(8))
        ok = wait_for(lambda: settled("abcd") and not short(chunks, "abcd"), 30)
        check("60 chunks on their owners among four", ok)
        t0 = time.time()
        rc = daemons["d"].stop()
        dt = time.time() - t0
        check(f"d stops cleanly, drained ({dt:.1f} s)", rc == 0 and "drained" in
              daemons["d"].log_text(), daemons["d"].log_text()[-1500:])
        miss = short(chunks, "abc")
        check("right after d's drain every chunk has R copies on a, b, c", not miss, str(miss))
        # the control: c stops without a drain; the others (grace 120 s) copy nothing yet
        daemons["c"].stop()
        check("c (drain off) restarts", start("c", "--cluster-grace", 120,
                                               "--cluster-drain-timeout", 0))
        wait_for(lambda: all(alive(n) == set("abc") for n in "abc"), 20)
        wait_for(lambda: settled("abc"), 20)
        check("c stops without draining", daemons["c"].stop() == 0)
        miss = short(chunks, "ab")
        check(f"without a drain chunks are short ({len(miss)} copies): the check can fail",
              len(miss) > 0, str(miss))

    def owned_by(chunks, members):
        own = owners([h for h, _ in chunks], members)
        return {m: {h for h, o in own.items() if m in o} for m in members}

    def part_copies():
        # equal capacities (equal weights), 1 MiB: far above what the chunks take
        up("abc", "--capacity", "1M", "--cluster-cache-pct", 0)
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 60, np.random.default_rng(9))
        ok = wait_for(lambda: settled("abc") and not short(chunks, "abc"), 30)
        check("60 chunks on their owners", ok)
        bad = cc.readable(cli, TMP, "b", chunks)
        check("every chunk reads back through b (read-through copies there)", not bad, str(bad))
        want = owned_by(chunks, "abc")
        ok = wait_for(lambda: all(held(n) == want[n] for n in "abc"), 30, step=0.5)
        copies = sum(len(held(n)) for n in "abc")
        print(f"# copies: {copies} copies of {len(chunks)} chunks after a PUT through a and reads "
              f"through b (R = {R}; without reclaiming: 60 on a, 60 on b and c's share)")
        check(f"exactly R copies settle, each member holding what it owns ({copies})", ok,
              str({n: (len(held(n)), len(want[n])) for n in "abc"}))
        st = {n: stats(n) for n in "abc"}
        check("the writer's and the reader's cache copies were reclaimed, none is left",
              st["a"]["cluster_cache_reclaimed"] > 0 and st["b"]["cluster_cache_reclaimed"] > 0
              and all(s["cluster_cache_bytes"] == 0 for s in st.values()),
              str({n: (s["cluster_cache_reclaimed"], s["cluster_cache_bytes"]) for n, s in
                   st.items()}))
        bad = cc.readable(cli, TMP, "c", chunks)
        check("every chunk still reads back through c", not bad, str(bad))
        # a budget: b (3 % of 1 MiB: 31457 bytes) keeps some cache copies, within it. Its
        # drain on the way leaves stand-in copies on a and c, reclaimed once it is back.
        daemons["b"].stop()
        check("b restarts with cluster_cache_pct 3",
              start("b", "--capacity", "1M", "--cluster-cache-pct", 3))
        wait_for(lambda: all(alive(n) == set("abc") for n in "abc"), 20)
        bad = cc.readable(cli, TMP, "b", chunks)
        check("every chunk reads back through b again", not bad, str(bad))
        budget = (1 << 20) * 3 // 100
        ok = wait_for(lambda: 0 < stats("b")["cluster_cache_bytes"] <= budget and
                      stats("b")["cluster_cache_reclaimed"] > 0, 30, step=0.5)
        extra = held("b") - want["b"]
        print(f"# copies: b keeps {len(extra)} cache copies, {stats('b')['cluster_cache_bytes']} "
              f"bytes (budget {budget})")
        check("b's cache copies settle within the budget, some kept", ok and len(extra) > 0 and
              want["b"] <= held("b"), str(stats("b")["cluster_cache_bytes"]))
        ok = wait_for(lambda: all(held(n) == want[n] for n in "ac"), 30, step=0.5)
        check("the stand-in copies b's drain left on a and c are reclaimed now that it is back",
              ok, str({n: (len(held(n)), len(want[n])) for n in "ac"}))

    def cluster_check(n):
        r = cli(n, "cluster", "check", "--json", ok=False)
        try:
            return r.returncode, json.loads(r.stdout), r.stderr
        except ValueError:
            return r.returncode, {}, r.stderr

    def part_check():
        # cache copies kept (cluster_cache_pct 100): the writer's copies are beyond R
        # (sockets any local user may open: the check must refuse such a user itself)
        os.chmod(TMP, 0o711)
        up("abc", "--capacity", "1M", "--cluster-cache-pct", 100, "--socket-mode", "0666")
        cc.add_model(cli, "a")
        chunks = cc.put_chunks(cli, TMP, "a", 0, 30, np.random.default_rng(11))
        ok = wait_for(lambda: settled("abc") and not short(chunks, "abc"), 30)
        check("30 chunks on their owners", ok, str(short(chunks, "abc")))
        want = owned_by(chunks, "abc")
        has = {n: held(n) for n in "abc"}
        rc, out, err = cluster_check("b")
        print(f"# check: {json.dumps(out)}")
        mem = {m["id"]: m for m in out.get("members", [])}
        check("cluster check: exit 0, no chunk under R, every member answered",
              rc == 0 and out["under_replicated"] == 0 and out["checked"] == 3 == out["of"] and
              set(mem) == set("abc"), f"{rc} {out} {err}")
        check("per member: chunks held, owned and beyond R as held and as placement says",
              all(mem[n]["chunks"] == len(has[n]) and mem[n]["owned"] == len(want[n] & has[n])
                  and mem[n]["beyond"] == len(has[n] - want[n]) and mem[n]["missing"] == 0 and
                  mem[n]["unverified"] == 0 for n in "abc"),
              str({n: (mem[n], len(has[n]), len(want[n])) for n in "abc"}))
        check("a, the writer, holds copies beyond R; the total is theirs",
              mem["a"]["beyond"] > 0 and out["copies_beyond_r"] == sum(
                  mem[n]["beyond"] for n in "abc"), str(out))
        # issue 30, defect 3: the check ran on the lane, not a worker; and only members and
        # administrators may run it (here: a local user who is neither root nor the daemon's)
        check("the cluster check ran on the lane (lane_done), off the workers",
              stats("b")["lane_done"] >= 1, str(stats("b").get("lane_done")))
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", kvblend,
                  "--endpoint", f"ipc://{TMP}/b.sock", "--timeout", "20000"]
        st = subprocess.run(nobody + ["stats", "--json"], capture_output=True, text=True)
        ck = subprocess.run(nobody + ["cluster", "check", "--json"], capture_output=True,
                            text=True)
        check("an unprivileged local user: stats served, cluster check refused naming who may",
              st.returncode == 0 and ck.returncode != 0 and
              "members and for administrators" in ck.stderr,
              f"stats {st.returncode} {st.stderr[-300:]}; check {ck.returncode} {ck.stderr[-300:]}")
        # c's copies of five chunks it owns, deleted: each has one copy left among its owners
        gone = sorted(want["c"])[:5]
        for h in gone:
            cli("c", "rm", "--model", "cm", "--hash", h)
        own = owners(gone, "abc")
        other = {h: next(o for o in own[h] if o != "c") for h in gone}
        rc, out, err = cluster_check("a")
        print(f"# check: {json.dumps(out)}")
        mem = {m["id"]: m for m in out.get("members", [])}
        per = {n: sum(1 for h in gone if other[h] == n) for n in "abc"}
        check("5 copies deleted on c: 5 chunks reported under R, c missing 5; exit status 1",
              rc == 1 and out["under_replicated"] == 5 and
              mem["c"]["missing"] == 5 and mem["a"]["missing"] == mem["b"]["missing"] == 0,
              f"{rc} {out} {per}")
        # the same check from Python (Client.cluster_check(), over kvb_cluster_check)
        r = kvbtest.python_client(kvblend, f"""
import json, kvblend
c = kvblend.Client({f"ipc://{TMP}/a.sock"!r}, timeout_ms=20000)
print(json.dumps(c.cluster_check()))
c.close()
""")
        try:
            py = json.loads(r.stdout)
        except ValueError:
            py = {}
        check("Python Client.cluster_check(): the same 5 under R, c missing 5, 3 members",
              py.get("check_under") == 5 and py.get("check_missing:c") == 5 and
              py.get("check_members") == 3 and py.get("check_answered") == 3,
              f"{r.stderr[-500:]} {py}")
        # the gauge: each member's own check (run in the background after the cluster check)
        ok = wait_for(lambda: all(stats(n)["cluster_under_replicated"] == per[n] for n in "abc"),
                      10)
        st = {n: stats(n) for n in "abc"}
        check("the stats gauge (cluster_under_replicated): each chunk counted once, by its "
              "other owner", ok and all(0 <= st[n]["cluster_check_age_ms"] < 60000 for n in "abc"),
              str({n: (st[n]["cluster_under_replicated"], st[n]["cluster_check_age_ms"])
                   for n in "abc"}))
        # repaired by hand (a GET through c reads through and keeps the copy): all well again
        bad = cc.readable(cli, TMP, "c", [(h, kv) for h, kv in chunks if h in gone])
        rc, out, _ = cluster_check("c")
        check("after reading them back through c: exit 0, nothing under R",
              not bad and rc == 0 and out["under_replicated"] == 0, f"{bad} {rc} {out}")
        daemons["c"].send_signal(signal.SIGKILL)
        daemons["c"].wait(10)
        rc, out, err = cluster_check("a")
        mem = {m["id"]: m for m in out.get("members", [])}
        check("c SIGKILLed: reported as not answering (exit 1, named on stderr), its copies "
              "unverified", rc == 1 and not mem["c"]["answered"] and out["checked"] == 2 and
              mem["c"]["unverified"] > 0 and out["under_replicated"] > 0 and
              "did not answer" in err,
              f"{rc} {out} {err}")

    try:
        check("etcd starts", ETCD.start(), ETCD.log_text()[-2000:])
        {"join": part_join, "hedge": part_hedge, "grace": part_grace, "drain": part_drain,
         "copies": part_copies, "check": part_check}[part]()
    except Exception as x:  # a failed CLI call: the check fails, the daemons still stop
        check(f"{part} runs to its end", False, repr(x))
    finally:
        cc.stop_all(daemons, check, log_tail=3000, timeout=60)
        ETCD.stop()
        kvbtest.remove(TMP)
    check.done()
