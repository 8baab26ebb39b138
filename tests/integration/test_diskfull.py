#!/usr/bin/env python3
"""A full disk through the real daemon and CLI, on a small real file system (a loop-mounted
ext4 image and a tmpfs, each that can be mounted): PUTs fill it until the daemon answers
`full` (not `internal`); the daemon keeps serving; after a DELETE the next PUT fits; with
the chunks unpinned a PUT on the full disk makes room by eviction and succeeds; restarted
on the full disk with a capacity below the disk, it evicts down to its watermark and takes
PUTs again. Every chunk acknowledged and not deleted or evicted reads back byte for byte.

Needs root (mount). Skipped (pytest's skip; ctest's 77) only when no small file system can
be mounted.

usage: python3 -m pytest tests/integration/test_diskfull.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

import kvbtest


def test_diskfull(kvblendd, kvblend):
    FS_MIB = 40
    LAYERS, HEADS, DIM, TOKENS = 4, 2, 64, 1024  # 2 MiB of f16 K and V a chunk
    CHUNK_BYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 2
    check = kvbtest.Checks()

    def run(*args):
        return subprocess.run(list(args), capture_output=True, text=True)

    def mount_tmpfs(mnt):
        r = run("mount", "-t", "tmpfs", "-o", f"size={FS_MIB}m,mode=0700", "tmpfs", mnt)
        return r.returncode == 0, r.stderr.strip()

    def mount_ext4(mnt, image):
        """A loop-mounted ext4 image: a disk-like file system (journal, fsync, block allocation)."""
        if not shutil.which("mkfs.ext4"):
            return False, "no mkfs.ext4"
        with open(image, "wb") as f:
            f.truncate(FS_MIB << 20)
        r = run("mkfs.ext4", "-q", "-F", "-m", "0", image)
        if r.returncode:
            return False, r.stderr.strip()
        r = run("mount", "-o", "loop", image, mnt)
        return r.returncode == 0, r.stderr.strip()

    class Daemon(kvbtest.Daemon):
        def __init__(self, tmp, data, *flags):
            super().__init__(kvblendd, kvblend, tmp, "--map-size", "1G", "--workers", "2", *flags,
                             data=data, timeout_ms=30000)
            if not self.start():
                raise RuntimeError("daemon did not start")

    def chunk(i):
        """Chunk i: incompressible f16 bits (so the disk fills at the rate we count),
        [L, 2, T, H, D]."""
        rng = np.random.default_rng(1000 + i)
        bits = rng.integers(0, 0x7c00, size=(LAYERS, 2, TOKENS, HEADS, DIM), dtype=np.uint16)
        return bits.view("<f2")

    def hexhash(i):
        return f"{i + 1:064x}"

    def put(d, tmp, i):
        path = f"{tmp}/kv.npy"
        np.save(path, chunk(i))
        return d.cli("put", "--model", "t", "--kv", path, "--hash", hexhash(i))

    def reads_back(d, tmp, i):
        out = f"{tmp}/out.npy"
        r = d.cli("get", "--model", "t", "--hash", hexhash(i), "--out", out)
        if r.returncode:
            return False, r.stderr.strip()
        got = np.load(out)
        return got.tobytes() == chunk(i).tobytes(), "bytes differ"

    def stored(d):
        r = d.cli("ls", "--model", "t", "--json")
        return {int(c["hash"], 16) - 1 for c in json.loads(r.stdout)} if r.returncode == 0 else None

    def check_acked(d, tmp, acked, what):
        """Every acknowledged chunk the store still lists reads back byte for byte."""
        now = stored(d)
        bad = [i for i in sorted(acked & now) if not reads_back(d, tmp, i)[0]]
        check(f"{what}: chunks still stored read back byte for byte ({len(acked & now)})",
              now is not None and not bad, f"differ: {bad}")
        check(f"{what}: nothing stored that was not acknowledged", now is not None and now <= acked,
              f"extra: {sorted(now - acked) if now else now}")
        return now

    def full_reply(r):
        return r.returncode == 1 and "store full" in r.stderr and "internal" not in r.stderr

    def put_more(d, tmp, i, count, acked, pause=0.0):
        """PUT chunks i..i+count-1, each acknowledged one added to acked (a refusal printed),
        pause seconds after each; returns how many succeeded and the next chunk's index."""
        ok = 0
        for j in range(i, i + count):
            r = put(d, tmp, j)
            ok += r.returncode == 0
            if r.returncode == 0:
                acked.add(j)
            else:
                print(f"# put {j}: {r.stderr.strip()}")
            time.sleep(pause)
        return ok, i + count

    def scenario(kind, tmp, mnt):
        data = f"{mnt}/data"
        d = Daemon(tmp, data)
        try:
            r = d.cli("model", "add", "t", "--layers", LAYERS, "--kv-heads", HEADS, "--head-dim",
                      DIM,
                      "--dtype", "f16", "--rope-theta", 10000)
            check(f"{kind}: model registered", r.returncode == 0, r.stderr)
            # Pinned chunks cannot be evicted: the disk must fill and the daemon say so.
            acked, i, last = set(), 0, None
            limit = 2 * FS_MIB * (1 << 20) // CHUNK_BYTES
            while i < limit:
                last = put(d, tmp, i)
                if last.returncode:
                    break
                acked.add(i)
                d.cli("pin", "--model", "t", "--hash", hexhash(i), "--ttl", 3600)
                i += 1
            check(f"{kind}: PUTs fill the disk ({len(acked)} chunks) until one fails",
                  last is not None and last.returncode != 0 and len(acked) >= 5)
            check(f"{kind}: the failure is `full`, not `internal`", full_reply(last), last.stderr)
            st = os.statvfs(mnt)
            check(f"{kind}: the file system is really full",
                  st.f_bavail * st.f_frsize < CHUNK_BYTES,
                  f"{st.f_bavail * st.f_frsize} bytes free")
            check(f"{kind}: the message says the store is full",
                  "full" in last.stderr.split("store full:", 1)[-1], last.stderr)
            r = put(d, tmp, i)
            check(f"{kind}: the next PUT is `full` again", full_reply(r), r.stderr)
            check(f"{kind}: the daemon still answers", d.cli("ping").returncode == 0)
            now = stored(d)
            check(f"{kind}: the failed chunk left nothing behind", now is not None and i not in now)
            check_acked(d, tmp, acked, f"{kind}: full")

            # A DELETE makes room for the next PUT.
            r = d.cli("rm", "--model", "t", "--hash", hexhash(0))
            check(f"{kind}: DELETE on the full disk", r.returncode == 0, r.stderr)
            acked.discard(0)
            r = put(d, tmp, i)
            check(f"{kind}: after a DELETE the next PUT succeeds", r.returncode == 0, r.stderr)
            if r.returncode == 0:
                acked.add(i)
            i += 1

            # Unpinned, the least recently used chunks are evicted to make room.
            for j in sorted(acked):
                d.cli("unpin", "--model", "t", "--hash", hexhash(j))
            ok, i = put_more(d, tmp, i, 4, acked)
            stats = json.loads(d.cli("stats", "--json").stdout)
            check(f"{kind}: on the full disk PUTs evict and succeed ({ok} of 4)", ok == 4)
            check(f"{kind}: evictions counted", stats.get("evictions", 0) > 0,
                  stats.get("evictions"))
            now = check_acked(d, tmp, acked, f"{kind}: after eviction")
            check(f"{kind}: the newest chunks survived eviction",
                  now is not None and {i - 1, i - 2} <= now)
            acked &= now or set()
        finally:
            check(f"{kind}: daemon exits 0", d.stop() == 0)

        # Restarted on the full disk with a capacity below it: evicts to the low mark, serves.
        cap = (FS_MIB // 2) << 20
        d = Daemon(tmp, data, "--capacity", cap, "--evict-high", 80, "--evict-low", 50)
        try:
            check(f"{kind}: restart on the full disk", d.cli("ping").returncode == 0)
            for _ in range(50):
                if json.loads(d.cli("stats", "--json").stdout)["stored_bytes"] <= 0.8 * cap:
                    break
                time.sleep(0.1)
            # a pause after each: the background evictor keeps to the watermark
            ok, i = put_more(d, tmp, i, 8, acked, pause=0.2)
            check(f"{kind}: with a capacity, PUTs keep succeeding ({ok} of 8)", ok == 8)
            stats = json.loads(d.cli("stats", "--json").stdout)
            check(f"{kind}: stored bytes kept near the capacity",
                  stats["stored_bytes"] <= cap + CHUNK_BYTES + (1 << 20), stats["stored_bytes"])
            check_acked(d, tmp, acked, f"{kind}: with a capacity")
        finally:
            check(f"{kind}: daemon exits 0 after the restart", d.stop() == 0)

    def main():
        tmp = tempfile.mkdtemp(prefix="kvb-diskfull-")
        mounted, reasons = 0, []
        try:
            for kind in ("ext4", "tmpfs"):
                mnt = f"{tmp}/{kind}"
                os.mkdir(mnt)
                ok, why = (mount_ext4(mnt, f"{tmp}/ext4.img") if kind == "ext4"
                           else mount_tmpfs(mnt))
                if not ok:
                    reasons.append(f"{kind}: {why or 'mount failed'}")
                    print(f"# cannot mount a small {kind}: {why}")
                    continue
                mounted += 1
                try:
                    scenario(kind, tmp, mnt)
                finally:
                    for _ in range(50):
                        if run("umount", mnt).returncode == 0:
                            break
                        time.sleep(0.1)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not mounted:
            pytest.skip(f"no small file system can be mounted here ({'; '.join(reasons)})")
        check.done()

    main()
