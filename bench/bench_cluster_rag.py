#!/usr/bin/env python3
"""The cluster's chunk hit rate on a RAG trace, and what a read from another member costs.

Issue 34. Starts --members real kvblendd daemons as members of one static cluster
(eval/harness.py's cluster(): own data directory and IPC socket each, loopback TCP
between them, cluster_replicas --replicas, --capacity each, no_sync, no drain on stop),
registers one small model on every member, then runs --clients client processes. Client
i is attached to member i mod --members (its local member, over IPC) and replays its own
--queries queries:

  Queries (seeded, --seed): as bench/bench_rag.py draws them, each retrieves --k distinct
  chunks by a Zipf popularity over --chunks chunks (rank r with weight 1/r^--zipf, ranks a
  random permutation of the chunks), without replacement, in the order drawn. One random
  stream draws every client's queries, client after client.

  Per query: one LOOKUP of its k chunks on the local member (what the vLLM connector's
  scheduler sends; a chunk the member lacks is found when one of its owners holds it),
  then per chunk: found, a GET into a preallocated array (no second LOOKUP); not found,
  or gone by the GET, the chunk is "computed" (deterministic synthetic KV from the chunk
  id: float16 standard normal values seeded by the id, --layers x 2 x --tokens x
  --kv-heads x --head-dim, stored raw as real KV is) and PUT to the local member, which
  pushes copies to the chunk's R owners. The chunk hash is that of the token ids
  id * tokens .. (id + 1) * tokens - 1. Each GET's first row is checked against the
  chunk's synthetic KV.

The first --warmup share of every client's queries is the warm-up; all clients meet at a
barrier after it, the daemons' STATS are read, then the measured queries run and STATS
are read again once every client has finished. Figures over the measured queries:

- chunk hit rate: hits / chunk requests, a hit being a chunk found by the LOOKUP and
  returned by the GET (from the clients' own counts); target >= 90%, PASS or FAIL.
- hits served by another member: the sum over members of the difference of
  cluster_remote_hits (chunks a member fetched from another one on a local miss of a
  GET) over the measured phase, over the hits.
- GET latency, local against remote: every measured GET is timed, and classified by
  whether its local member's cluster_remote_hits moved across it. To make that exact,
  a client holds its member's lock (one per member, shared by the clients attached to
  it) while it reads STATS, GETs and reads STATS again, so no other GET runs on that
  member meanwhile (only GETs fetch; LOOKUPs and PUTs of other clients may run). The
  time is the GET call alone (Client.get into the preallocated array), not the STATS
  calls. Median and p90 of each class; what a remote read adds is the difference of the
  medians.
Prints a markdown table and the exact command line; --out writes them as JSON with
every client's counts and latencies. Never fails on time; exits 1 only when a check of
the returned bytes failed. The members and their folders are removed at the end, on an
error, Ctrl-C or SIGTERM too (kept, with their logs, when KVBLEND_KEEP_DAEMON_DIRS is set).

usage: bench_cluster_rag.py [--members 3] [--replicas 2] [--clients 4] [--chunks 1000]
       [--queries 400] [--k 4] [--zipf 1.1] [--warmup 0.3] [--seed 1] [--layers 4]
       [--kv-heads 2] [--head-dim 64] [--tokens 256] [--capacity 1G] [--build DIR]
       [--out FILE.json]
(a python3 with numpy: Debian's /usr/bin/python3 here; client/python/src and eval/ are
put on sys.path by the script, libkvblend and kvblendd taken from --build, default build/)
"""

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "client" / "python" / "src"), str(ROOT / "eval")]

MODEL = "cluster-rag"
TARGET = 0.90  # issue 34: chunk hit rate once warm
CHECK = 128  # values of each GET's first row checked against the synthetic KV
COUNTERS = ("lookup_hits", "lookup_misses", "cluster_remote_hits", "cluster_remote_misses",
            "cluster_fetch_failures", "cluster_hedged", "cluster_pushes_done",
            "cluster_push_failures", "cluster_cache_reclaimed", "evictions")


def make_queries(n_clients, n_queries, n_chunks, k, zipf, seed):
    """Each client's queries: ``n_queries`` lists of ``k`` distinct chunk ids.

    Zipf draws over ``n_chunks`` chunks (popularity rank r has weight 1/r^zipf, the ranks a
    seeded random permutation of the chunks), without replacement within a query, in the
    order drawn: bench/bench_rag.py's draw. One stream, client after client.
    """
    rng = random.Random(seed)
    rank = list(range(n_chunks))
    rng.shuffle(rank)  # rank[r] is the chunk of popularity rank r + 1
    weights = [1.0 / (r + 1) ** zipf for r in range(n_chunks)]
    out = []
    for _ in range(n_clients):
        qs = []
        for _ in range(n_queries):
            picked = []
            while len(picked) < k:  # weighted draws without replacement
                c = rank[rng.choices(range(n_chunks), weights)[0]]
                if c not in picked:
                    picked.append(c)
            qs.append(picked)
        out.append(qs)
    return out


def synthetic_kv(chunk, shape):
    """The KV a node would compute for ``chunk``: float16 standard normal, seeded by its id."""
    n = math.prod(shape)
    return np.random.default_rng(chunk).standard_normal(n, np.float32).astype(np.float16) \
        .reshape(shape)


def client_main(idx, endpoint, queries, n_warm, shape, lock, barrier, results):
    """One client process: replay ``queries`` against the member at ``endpoint``.

    Meets the others at ``barrier`` after the first ``n_warm`` queries (twice: the parent
    reads STATS in between). Measured GETs run under ``lock``, the member's lock, between
    two STATS reads. Puts its counts and GET latencies on ``results``.
    """
    try:
        import kvblend

        tokens = shape[2]
        hashes = {}
        out = np.empty(shape, np.float16)
        firsts = {}
        r = {"client": idx, "endpoint": endpoint, "requests": 0, "hits": 0, "misses": 0,
             "get_gone": 0, "bad_bytes": 0, "local_ms": [], "remote_ms": [],
             "warm_requests": 0, "warm_hits": 0}
        with kvblend.Client(endpoint, timeout_ms=30000) as c:
            for qi, chunks in enumerate(queries):
                if qi == n_warm:
                    barrier.wait()  # every client warm: the parent reads STATS
                    barrier.wait()  # and lets the measured phase start
                measured = qi >= n_warm
                hs = []
                for ch in chunks:
                    if ch not in hashes:
                        hashes[ch] = kvblend.chunk_hash(range(ch * tokens, (ch + 1) * tokens))
                    hs.append(hashes[ch])
                found = [i.found for i in c.lookup(MODEL, hs)]
                for ch, h, f in zip(chunks, hs, found):
                    hit = False
                    if f:
                        try:
                            if measured:
                                with lock:
                                    before = c.stats()["cluster_remote_hits"]
                                    t0 = time.perf_counter_ns()
                                    c.get(MODEL, h, out=out)
                                    ms = (time.perf_counter_ns() - t0) / 1e6
                                    moved = c.stats()["cluster_remote_hits"] - before
                                r["remote_ms" if moved else "local_ms"].append(ms)
                            else:
                                c.get(MODEL, h, out=out)
                            hit = True
                        except kvblend.NotFound:  # evicted, or its holder did not answer
                            r["get_gone"] += measured
                        if hit:
                            if ch not in firsts:
                                firsts[ch] = np.random.default_rng(ch).standard_normal(
                                    CHECK, np.float32).astype(np.float16)
                            r["bad_bytes"] += not np.array_equal(out.reshape(-1)[:CHECK],
                                                                 firsts[ch])
                    if not hit:
                        c.put(MODEL, h, synthetic_kv(ch, shape), base_pos=0)
                    if measured:
                        r["requests"] += 1
                        r["hits"] += hit
                        r["misses"] += not hit
                    else:
                        r["warm_requests"] += 1
                        r["warm_hits"] += hit
        results.put(r)
    except BaseException:
        barrier.abort()  # the others and the parent stop waiting for this client
        raise


def member_stats(kvblend, daemons):
    """The COUNTERS of every member, by member id."""
    out = {}
    for name, d in daemons.items():
        with kvblend.Client(d.endpoint, timeout_ms=5000) as c:
            s = c.stats()
        out[name] = {k: int(s.get(k, 0)) for k in COUNTERS + ("chunks",)}
    return out


def wait_members(kvblend, daemons, seconds=30.0):
    """Wait until every member sees all the others alive (none suspect)."""
    deadline = time.monotonic() + seconds
    while True:
        ok = True
        for d in daemons.values():
            with kvblend.Client(d.endpoint, timeout_ms=5000) as c:
                s = c.stats()
            ok = ok and s["cluster_members"] == len(daemons) and s["cluster_suspect"] == 0
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the members did not all see each other alive")
        time.sleep(0.2)


def pct(xs, q):
    """The q-quantile of xs by nearest rank; None when xs is empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def run_clients(args, daemons, queries, n_warm, shape, kvblend):
    """Run the client processes; return their results, the members' STATS before and
    after the measured phase, and its wall time in seconds."""
    ctx = mp.get_context("spawn")
    names = list(daemons)
    locks = {n: ctx.Lock() for n in names}
    barrier = ctx.Barrier(args.clients + 1)
    results = ctx.Queue()
    procs = []
    try:
        for i in range(args.clients):
            m = names[i % len(names)]
            procs.append(ctx.Process(target=client_main, args=(
                i, daemons[m].endpoint, queries[i], n_warm, shape, locks[m], barrier,
                results), name=f"client-{i}"))
            procs[-1].start()
        barrier.wait(timeout=600)  # every client warm
        before = member_stats(kvblend, daemons)
        t0 = time.monotonic()
        barrier.wait(timeout=60)
        got = []
        while len(got) < len(procs):
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} failed (traceback above)") from None
        wall = time.monotonic() - t0
        after = member_stats(kvblend, daemons)
        for p in procs:
            p.join()
        return sorted(got, key=lambda r: r["client"]), before, after, wall
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()


def summarize(args, clients, before, after):
    """The measured figures, from the clients' counts and the STATS differences."""
    delta = {m: {k: after[m][k] - before[m][k] for k in COUNTERS} for m in after}
    total = {k: sum(d[k] for d in delta.values()) for k in COUNTERS}
    req = sum(r["requests"] for r in clients)
    hits = sum(r["hits"] for r in clients)
    local = [x for r in clients for x in r["local_ms"]]
    remote = [x for r in clients for x in r["remote_ms"]]
    rate = hits / req if req else 0.0
    s = {
        "chunk_requests": req, "hits": hits, "misses": req - hits,
        "hit_rate": rate, "target": TARGET, "pass": rate >= TARGET,
        "gets_gone": sum(r["get_gone"] for r in clients),
        "bad_bytes": sum(r["bad_bytes"] for r in clients),
        "remote_hits_counter": total["cluster_remote_hits"],
        "remote_share_counter": total["cluster_remote_hits"] / hits if hits else None,
        "gets_local": len(local), "gets_remote": len(remote),
        "remote_share_classified": len(remote) / hits if hits else None,
        "local_p50_ms": pct(local, 0.5), "local_p90_ms": pct(local, 0.9),
        "remote_p50_ms": pct(remote, 0.5), "remote_p90_ms": pct(remote, 0.9),
        "warm_requests": sum(r["warm_requests"] for r in clients),
        "warm_hits": sum(r["warm_hits"] for r in clients),
        "counters_delta": total, "counters_delta_by_member": delta,
        "chunks_by_member": {m: after[m]["chunks"] for m in after},
    }
    if local and remote:
        s["remote_adds_p50_ms"] = s["remote_p50_ms"] - s["local_p50_ms"]
    return s


def ms(x):
    """Milliseconds for the table; - when there is no figure."""
    return "-" if x is None else f"{x:.3f}"


def share(x):
    """A share as a percentage for the table; - when there is no figure."""
    return "-" if x is None else f"{x:.1%}"


def table(args, s, wall):
    """The results as markdown lines."""
    c = s["counters_delta"]
    return [
        f"{args.members} members, R = {args.replicas}, {args.clients} clients, "
        f"{args.chunks} chunks of {args.layers} layers x 2 x {args.tokens} tokens x "
        f"{args.kv_heads} KV heads x {args.head_dim} f16, {args.queries} queries a client of "
        f"k = {args.k}, Zipf {args.zipf}, seed {args.seed}, first {args.warmup:.0%} warm-up; "
        f"measured phase {wall:.1f} s",
        "",
        "| figure | measured |",
        "|---|---|",
        f"| chunk requests once warm | {s['chunk_requests']} (warm-up: {s['warm_requests']}, "
        f"{share(s['warm_hits'] / s['warm_requests'] if s['warm_requests'] else None)} hits) |",
        f"| chunk hit rate once warm | **{s['hit_rate']:.1%}** ({s['hits']} hits, "
        f"{s['misses']} computed and PUT) (target >= {TARGET:.0%}: "
        f"**{'PASS' if s['pass'] else 'FAIL'}**) |",
        f"| hits served by another member (sum of cluster_remote_hits differences) | "
        f"{share(s['remote_share_counter'])} ({s['remote_hits_counter']} of {s['hits']}) |",
        f"| hits served by another member (GETs classified) | "
        f"{share(s['remote_share_classified'])} ({s['gets_remote']} of {s['hits']}) |",
        f"| GET served by the local member, median / p90 | {ms(s['local_p50_ms'])} / "
        f"{ms(s['local_p90_ms'])} ms ({s['gets_local']} GETs) |",
        f"| GET fetched from another member, median / p90 | {ms(s['remote_p50_ms'])} / "
        f"{ms(s['remote_p90_ms'])} ms ({s['gets_remote']} GETs) |",
        f"| a cross-member read adds (median) | {ms(s.get('remote_adds_p50_ms'))} ms |",
        f"| found by LOOKUP, gone by the GET | {s['gets_gone']} |",
        f"| member counters over the phase (sum) | lookup_hits {c['lookup_hits']}, "
        f"lookup_misses {c['lookup_misses']} (members' LOOKUPs of each other included), "
        f"cluster_remote_misses {c['cluster_remote_misses']}, cluster_hedged "
        f"{c['cluster_hedged']}, cluster_pushes_done {c['cluster_pushes_done']}, "
        f"cluster_cache_reclaimed {c['cluster_cache_reclaimed']}, evictions "
        f"{c['evictions']} |",
        f"| chunks held at the end, by member | "
        f"{', '.join(f'{m} {n}' for m, n in s['chunks_by_member'].items())} |",
    ]


def parse_args():
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2, help="cluster_replicas (R)")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--chunks", type=int, default=1000, help="distinct chunks of the corpus")
    ap.add_argument("--queries", type=int, default=400, help="queries a client")
    ap.add_argument("--k", type=int, default=4, help="chunks a query")
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    ap.add_argument("--warmup", type=float, default=0.3,
                    help="share of each client's queries that is warm-up")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="tokens a chunk")
    ap.add_argument("--capacity", default="1G", help="each member's capacity")
    ap.add_argument("--build", default=str(ROOT / "build"),
                    help="build folder (lib/libkvblend.so, bin/kvblendd)")
    ap.add_argument("--out", help="write the figures and every client's counts as JSON")
    args = ap.parse_args()
    if not 0 <= args.warmup < 1:
        ap.error("--warmup must be in [0, 1)")
    if not 1 <= args.k <= args.chunks:
        ap.error("--k must be in 1 .. --chunks")
    if args.members < 1 or args.clients < 1 or args.queries < 1:
        ap.error("--members, --clients and --queries must be at least 1")
    return args


def stop_on_sigterm(signum, frame):
    """SIGTERM: leave through the same cleanup as Ctrl-C."""
    raise SystemExit(128 + signum)


def main():
    """Start the cluster, run the clients, print and save the figures."""
    args = parse_args()
    build = Path(args.build).resolve()
    os.environ.setdefault("KVBLEND_LIB", str(build / "lib" / "libkvblend.so"))
    os.environ.setdefault("KVBLENDD", str(build / "bin" / "kvblendd"))
    import kvblend
    from harness import cluster

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    command = shlex.join([sys.executable, *sys.argv])
    shape = (args.layers, 2, args.tokens, args.kv_heads, args.head_dim)
    queries = make_queries(args.clients, args.queries, args.chunks, args.k, args.zipf,
                           args.seed)
    n_warm = int(args.queries * args.warmup)
    work = tempfile.mkdtemp(prefix="kvblend-cluster-rag.")
    tempfile.tempdir = work  # the members' folders (harness.Daemon) go in here
    daemons = {}
    t_all = time.monotonic()
    try:
        ids = [f"m{i + 1}" for i in range(args.members)]
        daemons = dict(zip(ids, cluster(
            ids, "--cluster-replicas", str(args.replicas), "--capacity", args.capacity,
            "--no-sync", "--log-level", "warn", "--cluster-drain-timeout", "0")))
        wait_members(kvblend, daemons)
        model = kvblend.Model(MODEL, num_layers=args.layers, num_kv_heads=args.kv_heads,
                              head_dim=args.head_dim, dtype="f16")
        for d in daemons.values():
            with kvblend.Client(d.endpoint, timeout_ms=5000) as c:
                c.model_register(model)
        clients, before, after, wall = run_clients(args, daemons, queries, n_warm, shape,
                                                   kvblend)
        s = summarize(args, clients, before, after)
        lines = table(args, s, wall)
        print("\n".join(lines))
        print(f"\ncommand: {command}")
        print(f"bench_cluster_rag: {time.monotonic() - t_all:.0f} s in all, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"command": command, "args": vars(args), "summary": s, "table": lines,
                 "measured_s": wall, "loadavg": os.getloadavg(), "clients": clients},
                indent=1) + "\n")
        if s["bad_bytes"]:
            print(f"bench_cluster_rag: {s['bad_bytes']} GETs returned other bytes than the "
                  "chunk's", file=sys.stderr)
            return 1
        return 0
    finally:
        for d in daemons.values():
            d.stop()
        tempfile.tempdir = None
        if os.environ.get("KVBLEND_KEEP_DAEMON_DIRS"):
            print(f"bench_cluster_rag: the members' folders (data, logs) kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
