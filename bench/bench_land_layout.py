"""The daemon's landing rate into vLLM's CPU cache layout: K transposed against K as rows.

One kvblendd started here (BUILD_DIR/bin/kvblendd, libkvblend from BUILD_DIR/lib) holds
five chunks of CHUNK tokens of a SmolLM2-135M-shaped model (30 layers, 3 KV heads,
head_dim 64, float32). A reuse-only landing session over the five (2010 tokens by
default) lands them in a region shaped as vLLM 0.32's CPU "vec" cache (blocks of 128
tokens; per block and KV head, K then V): once with K transposed [head_dim, block_size]
as vLLM keeps it (kvb_fuse_open_into_strided), once with K rows laid out like V (the
peer: the same bytes, the row-copy path), alternating, REPEATS times each. Prints the
daemon's landing time (the session's land_ms) and the rate of K and V written, and the
ratio transposed/rows. Never passes or fails on time.

usage: python3 bench/bench_land_layout.py BUILD_DIR [--repeats N] [--chunk TOKENS]
(system python3 with numpy; client/python/src on PYTHONPATH)
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

L, H, HD, BS, ES = 30, 3, 64, 128, 4


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=402)
    args = ap.parse_args()
    build = Path(args.build).resolve()
    os.environ.setdefault("KVBLEND_LIB", str(build / "lib" / "libkvblend.so"))
    import kvblend

    sys.path.insert(0, str(ROOT / "eval"))
    from harness import Daemon  # the one Python harness that starts a kvblendd

    d = Daemon("--shm-max", "2G", kvblendd=str(build / "bin" / "kvblendd"), workers=None)
    try:
        run(kvblend, d.endpoint, args)
    finally:
        d.stop()


def run(kvblend, ep, args):
    m = kvblend.Model("bench-land", L, H, HD, dtype="f32", rope_theta=1e5)
    c = kvblend.Client(ep, timeout_ms=30000)
    c.model_register(m)
    rng = np.random.default_rng(0)
    segs = []
    for i in range(5):
        h = kvblend.chunk_hash(list(range(i * 100000, i * 100000 + args.chunk)))
        c.put(m.name, h, rng.standard_normal(m.kv_shape(args.chunk)).astype(np.float32))
        segs.append((h, i * args.chunk))
    n = 5 * args.chunk
    pages = -(-n // BS)
    nb = pages + 4
    block = H * 2 * BS * HD * ES
    arr = c.region(L * nb * block).view(np.float32)
    shape, hs = (L, nb, BS, H, HD), 2 * BS * HD * ES
    v = np.lib.stride_tricks.as_strided(arr[BS * HD :], shape, (nb * block, block, HD * ES, hs, ES))
    layouts = {
        "K transposed": np.lib.stride_tricks.as_strided(
            arr, shape, (nb * block, block, ES, hs, BS * ES)),
        "K rows": np.lib.stride_tricks.as_strided(arr, shape, (nb * block, block, HD * ES, hs, ES)),
    }
    table = np.random.default_rng(1).permutation(nb)[:pages].astype(np.uint32)
    ms = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, k in layouts.items():
            s = c.fuse_open_into(m.name, segs, k, v, pages=table)
            s.wait(L - 1, 60)
            ms[name].append(s.close()["land_ms"])
    moved = 2 * n * H * HD * ES * L
    print(f"landing {n} tokens (5 x {args.chunk}), {moved / 1e6:.1f} MB of K and V, "
          f"{args.repeats} runs each, load average {os.getloadavg()[0]:.1f}")
    for name, t in ms.items():
        med = statistics.median(t)
        print(f"  {name:13s} median {med:7.1f} ms (min {min(t):7.1f}), "
              f"{moved / med / 1e6:.2f} GB/s, {med / L:.2f} ms per layer")
    ratio = statistics.median(ms["K transposed"]) / statistics.median(ms["K rows"])
    print(f"  transposed / rows: {ratio:.2f}x the time")


if __name__ == "__main__":
    sys.exit(main())
