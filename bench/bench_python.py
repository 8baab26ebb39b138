#!/usr/bin/env python3
"""The Python binding against the C client on the same calls, in the same run.

Starts its own kvblendd, stores a 64 KiB chunk and a 32 MiB chunk, then measures
GET into a private buffer (a NumPy array for Python, malloc'd memory for C):
median latency of the 64 KiB GET and median throughput of the 32 MiB one. C and
Python runs alternate, ROUNDS times, and the medians of the rounds are compared.
Targets (issue 11): 64 KiB latency within 1.3x of C's, 32 MiB throughput at least
0.95x of C's. Prints figures and ratios; never passes or fails on time.

usage: bench_python.py BUILD_DIR [--rounds N]
(the kvblend package must be importable, e.g. from BUILD_DIR/pyvenv after ctest
test_python, with KVBLEND_LIB=BUILD_DIR/lib/libkvblend.so)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvblend

SMALL = kvblend.Model("small", num_layers=4, num_kv_heads=4, head_dim=64, dtype="f16")
LARGE = kvblend.Model("large", num_layers=32, num_kv_heads=8, head_dim=128, dtype="f16")


def start_daemon(build):
    """A kvblendd of this build through eval/harness.py's Daemon (the one Python
    harness that starts one), with its own data directory and IPC socket."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eval"))
    from harness import Daemon

    return Daemon("--map-size", "4G", "--no-sync", "--log-level", "warn",
                  kvblendd=f"{build}/bin/kvblendd", workers=None)


def store(c, model, tokens, seed):
    c.model_register(model)
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal(
        (model.num_layers, 2, tokens, model.num_kv_heads, model.head_dim)).astype(np.float16)
    h = kvblend.chunk_hash(range(seed, seed + tokens))
    c.put(model.name, h, kv)
    return h, kv.nbytes


def python_get(c, model, h, nbytes, reps):
    out = np.empty(nbytes, np.uint8)
    c.get(model, h, out=out)  # untimed: segment attached, pages touched
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.get(model, h, out=out)
        t.append(time.perf_counter() - t0)
    med = statistics.median(t)
    return {"median_s": med, "gbps": nbytes / med / 1e9}


def c_get(build, ep, model, h, nbytes, reps):
    r = subprocess.run([f"{build}/bin/bench_client", ep, model, h.hex(), str(nbytes), str(reps)],
                       check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    d = start_daemon(build)
    ep = d.endpoint
    try:
        with kvblend.Client(ep) as c:
            hs, ns = store(c, SMALL, 16, 1)      # 64 KiB
            hl, nl = store(c, LARGE, 256, 1000)  # 32 MiB
            rows = {"c_small": [], "py_small": [], "c_large": [], "py_large": []}
            for _ in range(a.rounds):
                rows["c_small"].append(c_get(build, ep, "small", hs, ns, 2000)["median_s"])
                rows["py_small"].append(python_get(c, "small", hs, ns, 2000)["median_s"])
                rows["c_large"].append(c_get(build, ep, "large", hl, nl, 20)["gbps"])
                rows["py_large"].append(python_get(c, "large", hl, nl, 20)["gbps"])
    finally:
        d.stop()
    m = {k: statistics.median(v) for k, v in rows.items()}
    print(f"kvblend bench_python: median of {a.rounds} alternating rounds, GET into a private buffer")
    print()
    print("| call | C | Python | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| GET 64 KiB, median latency | {m['c_small'] * 1e6:.1f} us | "
          f"{m['py_small'] * 1e6:.1f} us | {m['py_small'] / m['c_small']:.2f}x | <= 1.3x |")
    print(f"| GET 32 MiB, throughput | {m['c_large']:.2f} GB/s | {m['py_large']:.2f} GB/s | "
          f"{m['py_large'] / m['c_large']:.2f}x | >= 0.95x |")


if __name__ == "__main__":
    main()
