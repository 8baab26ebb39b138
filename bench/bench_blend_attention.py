"""The blend pass's attention of scattered rows: vLLM's CPU kernel against the alternatives.

Issue 57's profile (docs/benchmarks.md, "Where a blend's TTFT goes") shows the attention of
the recomputed rows growing to half of the pass at 4K tokens. This times one layer's
attention of the pass alone, at SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim
64, float32), for prompts of N tokens of which the last 35 (the question) and a random
15% of the others are recomputed (the default blend's rows), each implementation against
the reference (``kvblend.blend.attention.causal_attention``) and against vLLM's kernel
in the same run:

  paged       :class:`kvblend.vllm.attention.PagedAttention` (what the pass uses on the CPU:
              vLLM's ``cpu_attention_with_kv_cache``, each run of consecutive rows one
              request over the keys up to its last row)
  sdpa-mask   PyTorch's fused attention with a boolean [rows, N] mask (the fallback)
  groupedG    the rows in groups of G, each group one fused attention over the keys up to
              its last row, with a boolean mask for the rows inside that span

Prints, per size, each one's minimum time over --repeats, its largest difference from the
reference, and its time over paged's. Never passes or fails on time.

Usage (the engine venv's python, for vLLM's kernel)::

    PYTHONPATH=client/python/src /var/cache/kvblend/vllm-0.32.0/bin/python \\
        bench/bench_blend_attention.py [--sizes 1024,2048,4096] [--repeats 5]
"""

import argparse
import time

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kvblend.blend.attention import causal_attention
from kvblend.vllm.attention import paged_attention_for

HEADS, KV_HEADS, HEAD_DIM, QUESTION, RATIO, SCALE = 9, 3, 64, 35, 0.15, 0.125


def grouped(q, k, v, rows, scale, g):
    """The rows in groups of g, each over the keys up to its last row."""
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    outs = []
    for s in range(0, rows.numel(), g):
        r = rows[s: s + g]
        n = int(r[-1]) + 1
        mask = torch.arange(n)[None, :] <= r[:, None]
        o = sdpa(q[s: s + g].transpose(0, 1)[None], kt[:, :, :n], vt[:, :, :n],
                 attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(r.numel(), -1))
    return torch.cat(outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    paged = paged_attention_for(torch.device("cpu"), HEADS, KV_HEADS, HEAD_DIM, torch.float32)
    if paged is None:
        raise SystemExit("vLLM's CPU attention ops are not here: run with the engine venv")
    print("| tokens | rows | implementation | min ms | largest difference | / paged |")
    print("|---|---|---|---|---|---|")
    for size in (int(x) for x in args.sizes.split(",")):
        rng = np.random.default_rng(size)
        body = size - QUESTION
        rows = np.concatenate([np.sort(rng.choice(body, int(RATIO * body), replace=False)),
                               np.arange(body, size)])
        rows_t = torch.as_tensor(rows)
        q = torch.randn(rows.size, HEADS, HEAD_DIM)
        k, v = torch.randn(size, KV_HEADS, HEAD_DIM), torch.randn(size, KV_HEADS, HEAD_DIM)
        ref = causal_attention(q, k, v, rows_t, SCALE)
        ways = {"paged": lambda: paged.many([q], [k], [v], [rows_t], SCALE),
                "sdpa-mask": lambda: causal_attention(q, k, v, rows_t, SCALE),
                "grouped64": lambda: grouped(q, k, v, rows_t, SCALE, 64),
                "grouped128": lambda: grouped(q, k, v, rows_t, SCALE, 128)}
        times = {}
        for name, f in ways.items():
            err = float((f() - ref).abs().max())
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t)
            times[name] = min(ts) * 1000
            print(f"| {size} | {rows.size} | {name} | {times[name]:.1f} | {err:.1e} | "
                  f"{times[name] / times['paged']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
