#!/usr/bin/env python3
"""Join traffic: a member joining a cluster, in chunk transfers per chunk moved.

Starts a real etcd (Debian's etcd-server) and three kvblendd members on loopback
(R = 2, equal capacities; eval/harness.py's Etcd and Daemon), PUTs CHUNKS chunks of realistic KV (f16, stored raw)
through one of them and waits until every owner holds its chunks; then starts a
fourth member and times until `kvblend cluster check` finds every chunk on its
owners again. Prints the chunks that moved (the joiner's owned chunks: each gets
one new copy), the transfers the others made for it (their rebalance pushes),
their ratio (1.00: one sender per moved chunk; issue 20 measured 3.25 before),
and the rate of the moved bytes against cluster_rebalance_rate, the limit each
sender keeps to, and against a plain single-stream TCP copy of the same bytes on
loopback right after. The join's time runs from the joiner's start to every chunk
found on its owners (the joiner's start, its registration and the rebalance's
LOOKUPs are in it); the moving phase, from the first chunk the joiner holds to the
last (its count polled every 5 ms on one connection, from the moment it answers), is
what is compared with the plain copy, and with a write of the same bytes to a new file
on the members' file system (no fsync, as a no_sync store writes: the bytes must be
written, so this bounds a join on a machine whose page cache is slow to grow).
Prints figures; never passes or fails.

usage: bench_join.py BUILD_DIR [--chunks N] [--tokens T] [--rate SIZE]
(needs numpy and etcd on PATH or in /usr/bin)
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "eval"), os.path.join(ROOT, "client", "python", "src")]
from harness import Daemon, Etcd, free_port, wait_for  # noqa: E402

L, H, D = 32, 8, 128  # Mistral-7B's KV shape


def plain_copy_rate(chunk_bytes, count):
    """Bytes/s of a plain single-stream TCP copy on loopback of count chunks of chunk_bytes
    (send from one buffer, recv_into another, two threads): the socket's speed here, now."""
    src = np.random.default_rng(1).integers(0, 255, chunk_bytes, dtype=np.uint8).tobytes()
    dst = bytearray(chunk_bytes)
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    done = threading.Event()

    def sink():
        c, _ = ls.accept()
        view = memoryview(dst)
        for _ in range(count):
            got = 0
            while got < chunk_bytes:
                n = c.recv_into(view[got:], chunk_bytes - got)
                if not n:
                    return
                got += n
        c.close()
        done.set()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.time()
    for _ in range(count):
        s.sendall(src)
    done.wait(60)
    took = time.time() - t0
    s.close()
    ls.close()
    return count * chunk_bytes / took


def fresh_write_rate(chunk_bytes, count, where):
    """Bytes/s of writing count chunks of chunk_bytes to a new file in where (the members'
    file system), no fsync, as a no_sync store writes: what storing the bytes costs here,
    the peer a join cannot beat. Fresh pages of the page cache, as a joiner's store needs."""
    src = np.random.default_rng(2).integers(0, 255, chunk_bytes, dtype=np.uint8).tobytes()
    path = os.path.join(where, "fresh-write")
    t0 = time.time()
    with open(path, "wb", buffering=0) as f:
        for _ in range(count):
            f.write(src)
    took = time.time() - t0
    os.unlink(path)
    return count * chunk_bytes / took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--chunks", type=int, default=120)
    ap.add_argument("--tokens", type=int, default=16, help="tokens a chunk (16: 2 MiB)")
    ap.add_argument("--rate", default="256M", help="cluster_rebalance_rate")
    a = ap.parse_args()
    # the joiner is polled through the Python client: this build's libkvblend
    os.environ.setdefault("KVBLEND_LIB", os.path.join(a.build, "lib", "libkvblend.so"))
    tmp = tempfile.mkdtemp(prefix="kvb-bjoin-")
    procs = []
    cli_bin = f"{a.build}/bin/kvblend"

    def cli(n, *args):
        r = subprocess.run([cli_bin, "--endpoint", f"ipc://{tmp}/{n}.sock", "--timeout",
                            "60000", *map(str, args)], capture_output=True, text=True,
                           check=False)
        if r.returncode not in (0, 1):
            raise RuntimeError(f"kvblend@{n} {args}: {r.stderr}")
        return r

    def stats(n):
        return json.loads(cli(n, "stats", "--json").stdout)

    try:
        etcd = Etcd(tmp, name="bj")
        procs.append(etcd)
        if not etcd.start():
            sys.exit("etcd did not start")
        url = etcd.url

        def start(n):
            try:
                procs.append(Daemon(
                    "--node-id", n, "--cluster-etcd", url, "--capacity", "8G", "--map-size",
                    "16G", "--cluster-replicas", "2", "--cluster-rebalance-rate", a.rate,
                    "--no-sync", "--log-level", "warn", kvblendd=f"{a.build}/bin/kvblendd",
                    kvblend_cli=cli_bin, dir=tmp, name=n,
                    tcp=f"tcp://127.0.0.1:{free_port()}", workers=None))
            except RuntimeError as e:
                sys.exit(f"{n}: {e}")

        for n in "abc":
            start(n)
        wait_for(lambda: all(stats(n)["cluster_members"] == 3 for n in "abc"), 20)
        cli("a", "model", "add", "bj", "--layers", L, "--kv-heads", H, "--head-dim", D,
            "--dtype", "f16", "--rope-theta", 10000)
        rng = np.random.default_rng(20)
        chunk_bytes = L * 2 * a.tokens * H * D * 2
        for i in range(a.chunks):
            np.save(f"{tmp}/kv.npy",
                    rng.standard_normal((L, 2, a.tokens, H, D)).astype(np.float16))
            np.save(f"{tmp}/ids.npy", np.arange(a.tokens * i, a.tokens * (i + 1)))
            cli("a", "put", "--model", "bj", "--kv", f"{tmp}/kv.npy", "--tokens",
                f"{tmp}/ids.npy", "--pos", 0)

        def placed():
            r = cli("a", "cluster", "check", "--json")
            return r.returncode == 0 and json.loads(r.stdout)["under_replicated"] == 0
        if not wait_for(lambda: placed() and all(stats(n)["cluster_pushes_owed"] == 0
                                             for n in "abc"), 120, 0.5):
            sys.exit("the chunks did not settle on their owners")
        time.sleep(2)  # chunks stored well before the join (stored seconds are whole)
        before = sum(stats(n)["cluster_rebalance_pushes"] for n in "abc")
        t0 = time.time()
        # the joiner's chunk count, polled every 5 ms on one connection from the moment
        # it answers (its first chunks may come before its start returns here): when the
        # first and the last chunk arrived
        seen = {"first": None, "last": None, "held": 0, "at_first": 0, "error": None}
        watching = threading.Event()
        import kvblend  # (here: a missing library fails the run, not the thread)

        def watch():
            try:
                poll()
            except Exception as e:  # noqa: BLE001 (reported by the main thread)
                seen["error"] = e

        def poll():
            while not watching.is_set():
                try:
                    c = kvblend.Client(f"ipc://{tmp}/d.sock", timeout_ms=1000)
                    break
                except Exception:  # noqa: BLE001 (not listening yet)
                    time.sleep(0.005)
            else:
                return
            with c:
                while not watching.is_set():
                    try:
                        n = int(c.stats()["chunks"])
                    except Exception:  # noqa: BLE001 (starting: asked again)
                        n = seen["held"]
                    now = time.time()
                    if n and seen["first"] is None:
                        seen["first"], seen["at_first"] = now, n
                    if n != seen["held"]:
                        seen["last"] = now  # before held: the main thread reads held first
                        seen["held"] = n
                    time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start("d")
        end = t0 + 600
        while True:
            now = time.time()
            if seen["error"] is not None:
                sys.exit(f"polling the joiner failed: {seen['error']}")
            if seen["held"] and now - seen["last"] > 0.5 and \
                    stats("d")["cluster_members"] == 4 and placed():
                break
            if now > end:
                sys.exit("the joiner did not receive its chunks")
            time.sleep(0.05)
        watching.set()
        watcher.join()
        first, last, held, at_first = seen["first"], seen["last"], seen["held"], seen["at_first"]
        took = time.time() - t0
        wait_for(lambda: all(stats(n)["cluster_pushes_owed"] == 0 for n in "abcd"), 60)
        time.sleep(1)  # a late duplicate would show here
        sent = sum(stats(n)["cluster_rebalance_pushes"] for n in "abc") - before
        out = json.loads(cli("a", "cluster", "check", "--json").stdout)
        moved = next(m["owned"] for m in out["members"] if m["id"] == "d")
        rate = moved * chunk_bytes / took
        limit = int(a.rate[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[a.rate[-1]] \
            if a.rate[-1] in "KMG" else int(a.rate)
        print(f"# bench_join: 3 members + 1 joining, R = 2, {a.chunks} chunks of "
              f"{chunk_bytes / (1 << 20):.2f} MiB (f16, stored raw), loopback, no_sync")
        plain = plain_copy_rate(chunk_bytes, max(moved, 1))
        written = fresh_write_rate(chunk_bytes, max(moved, 1), tmp)
        # the moving phase: from the first chunk on the joiner to the last (the rest
        # is the joiner's start, its registration and the rebalance's LOOKUPs)
        phase = (last - first) if first and last and last > first else float("nan")
        # the chunks that arrived after the first poll that saw any, over that time
        moving = (held - at_first) * chunk_bytes / phase if held > at_first else float("nan")
        print("| chunks moved | transfers | per chunk moved | bytes moved | join to settled "
              "| moved bytes/s | of cluster_rebalance_rate | first to last chunk on the "
              "joiner | its bytes/s | of a plain TCP copy | of a fresh file write |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {moved} | {sent} | {sent / moved if moved else float('nan'):.2f} | "
              f"{moved * chunk_bytes / 1e6:.1f} MB | {took:.2f} s | {rate / 1e6:.1f} MB/s | "
              f"{rate / limit:.2f}x of {limit / 1e6:.0f} MB/s | {phase:.2f} s | "
              f"{moving / 1e6:.1f} MB/s | {moving / plain:.2f}x of {plain / 1e6:.0f} MB/s | "
              f"{moving / written:.2f}x of {written / 1e6:.0f} MB/s |")
        bulk = sum(stats(n)["cluster_bulk_pushes"] for n in "abc")
        print(f"# pushes on bulk connections (cluster_bulk_pushes, a b c): {bulk}")
    finally:
        for p in reversed(procs):
            p.stop()
        if not os.environ.get("KVB_KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
