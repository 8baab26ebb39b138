"""Time to first token of a RAG request in vLLM: plain prefill against reuse and CacheBlend.

One vLLM 0.32 engine on the CPU (SmolLM2-135M, float32, enforce_eager, no prefix caching)
with kvblend.vllm.KvblendConnector, and one kvblendd started here. Per prompt size (about
1K, 2K and 4K tokens): five chunks of real text (windows of the repository's docs/*.md,
tokenized with the model's tokenizer) are stored with kvblend.vllm.store_documents; the
request is the five chunks followed by a fresh question. TTFT is the wall time of
llm.generate(max_tokens=1) for that one request: plain (no kv_transfer_params: vLLM
prefills every token), reuse (segments: five chunks, then the question, with "blend":
false: the connector loads the chunks re-rotated to their positions, vLLM computes the
question) and blend (the same segments, CacheBlend at --ratio, value metric, check layer
1: the connector's blend pass over vLLM's own layer modules, then vLLM computes the
question; with --metrics, one blend per metric named, each a mode of its own: the
attention metric's preview and check layer 1, the question and anchored metrics' preview
and no check layer, their ratio the share of chunk tokens recomputed at every layer), in
turn, REPEATS times after one untimed round; the question alone (plain, a few dozen
tokens) is timed with them, as the floor of any request on this engine. The
blend's parts come from the connector's log line per blend ("kvblend: blend of N tokens
... pass X s (daemon: session, load, landing, compute ms), cache write Y s"): the pass
(the node's layers, the check and the waits for the daemon's landing), the daemon's own
load + landing + compute (its threads; on the critical path only as waits) and the write
into vLLM's cache. Then --concurrent requests at the --concurrent-size prompt (the same
chunks, each with its own question) submitted to the engine at once, plain against
blend (each of --metrics in turn): requests per second, and TTFT p50/p90 over those
requests (the blends of the requests vLLM schedules in one step run in one pass over the
layers). The daemon is
started with shm_max above VLLM_CPU_KVCACHE_SPACE, so that vLLM's cache lies in a
kvblend region and reuse loads are landed by the daemon (docs/vllm-reference.md). Per layer: the
connector's load time (its log line "loaded N tokens ... in X s": for a landed load the
time it held the engine, opening the session, the per-layer waits and the close (the
close since 2026-12-02); for a copied
one the get_rerotated calls and the writes into vLLM's cache), the daemon's landing time
(the same line: all layers written into vLLM's cache), and get_rerotated of the same five
chunks called from this process (re-rotation and transfer, no cache writes), each divided
by the layers.
Targets: reuse TTFT at most 0.3x of plain vLLM's (issue 21), blend at r = 0.15 at most
0.5x from 2K tokens on (issue 22). Prints figures and ratios; never passes or fails on
time. kvblend is installed with pip into a temporary folder first (the blend pass needs
its vllm.general_plugins entry point, as tests/engine/test_vllm_blend.py does).

usage: bench_vllm.py BUILD_DIR [--repeats N] [--sizes 1024,2048,4096] [--ratio 0.15]
       [--metrics value[,attention,question:R,anchored:R]] [--concurrent 8]
       [--concurrent-size 2048] [--async-loads auto|true|false] [--model DIR]
(KVB_KEEP_TMP=1 keeps its temporary folder, the engine's log with every blend's line;
with the engine venv's python from .ci/engine-env, the build's libkvblend and
client/python/src on PYTHONPATH, which tests/engine/run.sh sets up:
tests/engine/run.sh build/lib/libkvblend.so build/bin/kvblendd bench/bench_vllm.py build)
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["storage.md", "protocol.md", "cluster.md", "fuse.md", "operations.md"]
QUESTION = ("\n\nQuestion: Using only the documents above, explain where a chunk's KV cache is "
            "stored and how an engine on the same host reads it back.\nAnswer:")
MODEL_NAME = "smollm2-bench"
LOADED = re.compile(
    r"kvblend: loaded (\d+) tokens of (\S+)(?: early)? in ([0-9.]+) s \((landed|copied)"
    r"(?:[^)]*daemon landing ([0-9.]+) ms)?"
)
BLENDED = re.compile(r"kvblend: blend of (\d+) tokens \((\d+) recomputed after layer -?\d+\): "
                     r"pass ([0-9.]+) s (?:for \d+ requests )?\(daemon: session [0-9.]+ ms, "
                     r"load ([0-9.]+) ms, landing ([0-9.]+) ms, compute ([0-9.]+) ms\), "
                     r"cache write ([0-9.]+) s(?:; metric (\w+), preview ([0-9.]+) ms"
                     r"(?: \(([0-9.]+) ms of it waiting)?)?"
                     r"(?:[^\n]*?; pass phases ms: ((?:[a-z]+ [0-9.]+ ?)*))?")


def start_daemon(build):
    """kvblendd of this build (eval/harness.py's Daemon), shm_max above vLLM's whole
    KV cache, which is one shared-memory region."""
    from harness import Daemon

    shm = f"{int(float(os.environ['VLLM_CPU_KVCACHE_SPACE'])) + 1}G"
    return Daemon("--shm-max", shm, kvblendd=f"{build}/bin/kvblendd")


def chunks_for(tok, per_chunk, skip):
    """Five token windows of ``per_chunk`` ids, one per docs file, ``skip`` ids in."""
    out = []
    for name in SOURCES:
        ids = tok.encode((ROOT / "docs" / name).read_text(), add_special_tokens=False)
        if len(ids) < skip + per_chunk:
            raise RuntimeError(f"docs/{name}: {len(ids)} tokens, need {skip + per_chunk}")
        out.append(ids[skip : skip + per_chunk])
    return out


def run(args, ep, out, log_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import kvblend
    from engine_setup import connector_llm
    from kvblend.vllm import store_documents

    t0 = time.monotonic()
    llm = connector_llm(args.model, {"endpoint": ep, "timeout_ms": 60000,
                                     "model_name": MODEL_NAME,
                                     "blend": {"check_layers": [1], "ratios": [args.ratio]},
                                     # times every load asked for
                                     "load_cost_check": False,
                                     "async_loads": args.async_loads},
                        max_model_len=8192, enable_prefix_caching=False)
    out(f"engine started in {time.monotonic() - t0:.1f} s")
    tok = llm.get_tokenizer()
    q = tok.encode(QUESTION, add_special_tokens=False)
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers

    def ttft(prompt, params):
        sp = SamplingParams(temperature=0.0, max_tokens=1,
                            extra_args=None if params is None else {"kv_transfer_params": params})
        t = time.monotonic()
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)
        return time.monotonic() - t, o[0].outputs[0].token_ids[0]

    rows = []
    for skip, size in enumerate(args.sizes):
        per_chunk = (size - len(q)) // len(SOURCES)
        docs = chunks_for(tok, per_chunk, skip * 7)  # other windows per size: other chunks
        hashes = store_documents(llm, docs)
        prompt = [t for d in docs for t in d] + q
        segs, pos = [], 0
        for d in docs:
            segs.append([pos, len(d), "chunk"])
            pos += len(d)
        segs.append([pos, len(q), "fresh"])
        reuse = {"kvblend": {"segments": segs, "blend": False}}
        blends_by = {f"blend-{m}": {"kvblend": {"segments": segs, "blend": {
            "metric": m, "ratios": [args.ratios[m]]}}} for m in args.metrics}
        times = {"plain": [], "reuse": [], "question": [], **{k: [] for k in blends_by}}
        first = {}
        text = Path(log_path).read_text(errors="replace")
        loads_before, blends_before = len(LOADED.findall(text)), len(BLENDED.findall(text))
        for rep in range(args.repeats + 1):
            modes = [("plain", prompt, None), ("reuse", prompt, reuse)]
            modes += [(k, prompt, v) for k, v in blends_by.items()] + [("question", q, None)]
            for mode, p, params in modes:
                t, tok0 = ttft(p, params)
                first[mode] = tok0
                if rep:
                    times[mode].append(t)
        time.sleep(0.5)  # the worker's log line reaches the file
        text = Path(log_path).read_text(errors="replace")
        loads = LOADED.findall(text)[loads_before:]
        mine = [x for x in loads if int(x[0]) == pos][1:]  # skip the untimed pair's
        load_s = [float(x[2]) for x in mine]
        land_s = [float(x[4]) / 1000 for x in mine if x[3] == "landed" and x[4]]
        logged = [b for b in BLENDED.findall(text)[blends_before:] if int(b[0]) == pos]
        by_metric = {m: [b for b in logged if b[7] == m][1:] for m in args.metrics}
        blends = by_metric[args.metrics[0]]
        direct, lookups = [], []
        with kvblend.Client(ep, timeout_ms=10000) as c:
            for _ in range(args.repeats):
                t = time.monotonic()
                c.lookup(MODEL_NAME, hashes)  # the scheduler's one lookup of the request
                lookups.append(time.monotonic() - t)
                t = time.monotonic()
                for h, s in zip(hashes, segs):
                    c.get_rerotated(MODEL_NAME, h, pos=s[0])
                direct.append(time.monotonic() - t)
        r = {
            "tokens": len(prompt), "chunks": len(docs), "chunk_tokens": per_chunk,
            "question_tokens": len(q),
            "plain_median_s": statistics.median(times["plain"]), "plain_min_s": min(times["plain"]),
            "reuse_median_s": statistics.median(times["reuse"]), "reuse_min_s": min(times["reuse"]),
            "connector_loads": len(load_s),
            "connector_load_median_s": statistics.median(load_s) if load_s else None,
            "landed_loads": sum(x[3] == "landed" for x in mine),
            "daemon_land_median_s": statistics.median(land_s) if land_s else None,
            "get_rerotated_median_s": statistics.median(direct),
            "lookup_median_s": statistics.median(lookups),
            "question_alone_median_s": statistics.median(times["question"]),
            "connector_load_s": load_s, "loadavg": os.getloadavg(),
            "layers": layers, "same_first_token": first["plain"] == first["reuse"],
            "plain_s": [round(x, 3) for x in times["plain"]],
            "reuse_s": [round(x, 3) for x in times["reuse"]],
        }
        for m in args.metrics:
            ts, bs = times[f"blend-{m}"], by_metric[m]
            r.setdefault("metrics", {})[m] = {
                "ratio": args.ratios[m], "median_s": statistics.median(ts), "min_s": min(ts),
                "ratio_median": statistics.median(ts) / r["plain_median_s"],
                "recomputed": int(bs[0][1]) if bs else None,
                "pass_median_s": statistics.median(float(b[2]) for b in bs) if bs else None,
                "preview_median_ms": statistics.median(float(b[8]) for b in bs) if bs else None,
                "preview_wait_median_ms": statistics.median(float(b[9] or 0) for b in bs)
                if bs else None,
                "cache_write_median_s": statistics.median(float(b[6]) for b in bs)
                if bs else None,
                "phases_median_ms": phase_medians([b[10] for b in bs]),
                "same_first_token": first["plain"] == first[f"blend-{m}"],
                "s": [round(x, 3) for x in ts]}
        times["blend"], first["blend"] = times[f"blend-{args.metrics[0]}"], first[
            f"blend-{args.metrics[0]}"]
        med = lambda i: statistics.median(float(b[i]) for b in blends) if blends else None  # noqa: E731
        r.update({
            "blend_median_s": statistics.median(times["blend"]), "blend_min_s": min(times["blend"]),
            "blend_s": [round(x, 3) for x in times["blend"]], "blends_logged": len(blends),
            "blend_recomputed": int(blends[0][1]) if blends else None,
            "blend_pass_median_s": med(2),
            "daemon_median_ms": statistics.median(float(b[3]) + float(b[4]) + float(b[5])
                                                  for b in blends) if blends else None,
            "cache_write_median_s": med(6), "same_first_token_blend": first["plain"] == first["blend"],
        })
        r["blend_ratio_median"] = r["blend_median_s"] / r["plain_median_s"]
        r["blend_ratio_min"] = r["blend_min_s"] / r["plain_min_s"]
        r["ratio_median"] = r["reuse_median_s"] / r["plain_median_s"]
        r["ratio_min"] = r["reuse_min_s"] / r["plain_min_s"]
        rows.append(r)
        out(f"size {size}: " + json.dumps(r))
        if size == args.concurrent_size and args.concurrent:
            rows.append(concurrent(llm, docs, segs, pos, tok, args, out))
    return rows


def phase_medians(logged):
    """Each pass phase's median over the logged blends ("pass phases ms: qkv 1.0 ...")."""
    per = {}
    for text in logged:
        words = (text or "").split()
        for name, v in zip(words[::2], words[1::2]):
            per.setdefault(name, []).append(float(v))
    return {k: statistics.median(v) for k, v in per.items()}


def profile(rows, out):
    """Where a request's TTFT goes, per prompt size: reuse and each blend metric."""
    order = ("wait", "embed", "qkv", "rows", "check", "gather", "attention", "mlp", "attend")
    out("")
    out("| prompt | mode | TTFT | lookup | connector load | preview (waiting) | "
        + " | ".join(f"pass: {k}" for k in order) + " | cache write | rest of the step |")
    out("|---|---|---|---|---|---|" + "---|" * len(order) + "---|---|")
    for r in rows:
        lk = r["lookup_median_s"] * 1000
        cl = (r["connector_load_median_s"] or 0) * 1000
        out(f"| {r['tokens']} | reuse | {r['reuse_median_s'] * 1000:.0f} | {lk:.1f} | {cl:.0f} | - | "
            + " | ".join("-" for _ in order)
            + f" | - | {r['reuse_median_s'] * 1000 - lk - cl:.0f} |")
        for m, x in r.get("metrics", {}).items():
            ph = x.get("phases_median_ms") or {}
            pv = x["preview_median_ms"] or 0.0
            pw = x["preview_wait_median_ms"] or 0.0
            cw = (x["cache_write_median_s"] or 0) * 1000
            pas = (x["pass_median_s"] or 0) * 1000
            rest = x["median_s"] * 1000 - lk - pas - cw
            out(f"| {r['tokens']} | {m} r={x['ratio']:g} | {x['median_s'] * 1000:.0f} | {lk:.1f} "
                f"| - | {pv:.0f} ({pw:.0f}) | "
                + " | ".join(f"{ph[k]:.0f}" if k in ph else "-" for k in order)
                + f" | {cw:.0f} | {rest:.0f} |")
    out("(ms, medians; the pass's phases add up to the pass (with the preview for the node "
        "metrics); rest of the step: TTFT less lookup, load or pass, and cache write: "
        "vLLM's own prefill of the fresh tokens and its step)")


def concurrent(llm, docs, segs, pos, tok, args, out):
    """args.concurrent requests (the same chunks, each its own question) submitted at once,
    plain against blend, alternating: requests per second and each request's TTFT (the
    time from the submission to its one token: max_tokens=1), p50 and p90 over every
    request of the timed rounds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n = args.concurrent
    ctx = [t for d in docs for t in d]
    prompts = [ctx + tok.encode(QUESTION.replace("Question:", f"Question {i + 1}:"),
                                add_special_tokens=False) for i in range(n)]
    chunk_segs = [s for s in segs if s[2] == "chunk"]
    modes = ["plain"] + [f"blend-{m}" for m in args.metrics]
    times = {m: [] for m in modes}
    ttfts = {m: [] for m in modes}
    eng = llm.llm_engine
    for rep in range(args.repeats + 1):
        for mode in modes:
            params = None if mode == "plain" else {"kv_transfer_params": {"kvblend": {
                "segments": chunk_segs, "blend": {"metric": mode.split("-", 1)[1],
                                                  "ratios": [args.ratios[mode[6:]]]}}}}
            sps = [SamplingParams(temperature=0.0, max_tokens=1, extra_args=params)
                   for _ in prompts]
            t = time.monotonic()
            for i, (p, sp) in enumerate(zip(prompts, sps)):
                eng.add_request(f"conc-{rep}-{mode}-{i}", TokensPrompt(prompt_token_ids=p), sp)
            first = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                        first[o.request_id] = time.monotonic() - t
            if rep:
                times[mode].append(time.monotonic() - t)
                ttfts[mode] += first.values()
    times["blend"], ttfts["blend"] = times[modes[1]], ttfts[modes[1]]
    q = lambda xs, f: statistics.quantiles(xs, n=10)[int(f * 10) - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    r = {"concurrent": n, "tokens": len(prompts[0]), "loadavg": os.getloadavg(),
         "plain_batch_s": [round(x, 3) for x in times["plain"]],
         "blend_batch_s": [round(x, 3) for x in times["blend"]]}
    for mode in ["plain", "blend"] + modes[1:]:
        r[f"{mode}_rps"] = n / statistics.median(times[mode])
        r[f"{mode}_ttft_p50_s"] = statistics.median(ttfts[mode])
        r[f"{mode}_ttft_p90_s"] = q(ttfts[mode], 0.9)
    r["rps_ratio"] = r["blend_rps"] / r["plain_rps"]
    out(f"concurrent {n}: " + json.dumps(r))
    return r


def table(rows, out):
    ms = lambda s: "-" if s is None else f"{s * 1000:.0f} ms"  # noqa: E731
    conc = [r for r in rows if "concurrent" in r]
    rows = [r for r in rows if "concurrent" not in r]
    out("")
    out("| prompt | plain TTFT median (min) | reuse TTFT median (min) | reuse/plain median (min) "
        "| connector load, per layer | daemon landing, per layer | get_rerotated, per layer "
        "| question alone |")
    out("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cl = r["connector_load_median_s"]
        per_layer = lambda s: "-" if s is None else f"{s / r['layers'] * 1000:.1f} ms"  # noqa: E731
        shape = f"{r['chunks']} x {r['chunk_tokens']} + {r['question_tokens']}"
        out(f"| {r['tokens']} tokens ({shape}) "
            f"| {ms(r['plain_median_s'])} ({ms(r['plain_min_s'])}) "
            f"| {ms(r['reuse_median_s'])} ({ms(r['reuse_min_s'])}) "
            f"| {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}x) "
            f"| {ms(cl)} total, {per_layer(cl)} ({r['landed_loads']}/{r['connector_loads']} landed) "
            f"| {ms(r['daemon_land_median_s'])} total, {per_layer(r['daemon_land_median_s'])} "
            f"| {ms(r['get_rerotated_median_s'])} total, "
            f"{r['get_rerotated_median_s'] / r['layers'] * 1000:.1f} ms "
            f"| {ms(r['question_alone_median_s'])} |")
    out("")
    out("target: reuse/plain <= 0.3x")
    out("")
    out("| prompt | plain TTFT median (min) | blend TTFT median (min) | blend/plain median (min) "
        "| recomputed | blend pass (share of blend TTFT) | daemon load+land+compute (share) "
        "| cache write | rest of blend TTFT | same 1st token |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, p, d = r["blend_median_s"], r["blend_pass_median_s"], r["daemon_median_ms"]
        share = lambda x: "-" if x is None else f"{x * 1000:.0f} ms ({x / b:.0%})"  # noqa: E731
        rest = "-" if p is None else ms(b - p - r["cache_write_median_s"])
        out(f"| {r['tokens']} tokens | {ms(r['plain_median_s'])} ({ms(r['plain_min_s'])}) "
            f"| {ms(b)} ({ms(r['blend_min_s'])}) "
            f"| {r['blend_ratio_median']:.2f}x ({r['blend_ratio_min']:.2f}x) "
            f"| {r['blend_recomputed']} of {r['tokens'] - r['question_tokens']} "
            f"| {share(p)} | {share(None if d is None else d / 1000)} "
            f"| {ms(r['cache_write_median_s'])} | {rest} | {r['same_first_token_blend']} |")
    out("")
    out("target: blend/plain <= 0.5x from 2K tokens on")
    if any(len(r.get("metrics", {})) > 1 for r in rows):
        out("")
        out("| prompt | metric | blend TTFT median (min) | blend/plain median | rows computed "
            "| pass | preview | same 1st token |")
        out("|---|---|---|---|---|---|---|---|")
        for r in rows:
            for m, x in r["metrics"].items():
                pv = "-" if x["preview_median_ms"] is None else (
                    f"{x['preview_median_ms']:.0f} ms ({x['preview_wait_median_ms']:.0f} ms "
                    "waiting for landing)")
                out(f"| {r['tokens']} tokens | {m} r={x['ratio']:g} "
                    f"| {ms(x['median_s'])} ({ms(x['min_s'])}) "
                    f"| {x['ratio_median']:.2f}x | {x['recomputed']} | {ms(x['pass_median_s'])} "
                    f"| {pv} | {x['same_first_token']} |")
    for c in conc:
        out("")
        out(f"{c['concurrent']} concurrent requests of {c['tokens']} tokens (submitted at once, "
            f"max_tokens=1; median of {len(c['plain_batch_s'])}): plain {c['plain_rps']:.2f} "
            f"req/s, blend {c['blend_rps']:.2f} req/s: {c['rps_ratio']:.2f}x (target 2.5x; "
            f"load average {', '.join(f'{x:.1f}' for x in c['loadavg'])})")
        out(f"  TTFT p50 / p90: plain {c['plain_ttft_p50_s']:.2f} / {c['plain_ttft_p90_s']:.2f} s, "
            f"blend {c['blend_ttft_p50_s']:.2f} / {c['blend_ttft_p90_s']:.2f} s")
        for k in [k[:-4] for k in c if k.startswith("blend-") and k.endswith("_rps")]:
            out(f"  {k[6:]} metric: {c[k + '_rps']:.2f} req/s "
                f"({c[k + '_rps'] / c['plain_rps']:.2f}x plain), TTFT p50 / p90 "
                f"{c[k + '_ttft_p50_s']:.2f} / {c[k + '_ttft_p90_s']:.2f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--ratio", type=float, default=0.15, help="CacheBlend's r (check layer 1)")
    ap.add_argument("--metrics", default="value",
                    help="blend metrics timed side by side, comma-separated (value, key, "
                         "attention, question, anchored), each optionally :ratio (e.g. "
                         "anchored:0.2); the first one is the blend of the tables")
    ap.add_argument("--concurrent", type=int, default=8,
                    help="requests in the concurrency run (0: none)")
    ap.add_argument("--concurrent-size", type=int, default=2048,
                    help="which of --sizes the concurrency run uses")
    ap.add_argument("--async-loads", choices=("auto", "true", "false"), default="auto",
                    help="the connector's async_loads (auto: off on vLLM 0.32): true lands "
                         "reuse loads between the engine's steps, and their 'connector "
                         "load' is then the wall time from the open to the close")
    ap.add_argument("--model", default=os.environ.get("KVBLEND_ENGINE_MODEL"))
    args = ap.parse_args()
    args.async_loads = {"true": True, "false": False}.get(args.async_loads, "auto")
    args.sizes = [int(x) for x in args.sizes.split(",")]
    # "metric" or "metric:ratio" (that metric's own ratio; --ratio otherwise)
    named = [m.split(":")[0] for m in args.metrics.split(",")]
    if len(set(named)) != len(named):
        print(f"bench_vllm: --metrics names a metric twice: {args.metrics}", file=sys.stderr)
        return 2
    args.ratios = {m.split(":")[0]: float(m.split(":")[1]) if ":" in m else args.ratio
                   for m in args.metrics.split(",")}
    args.metrics = named
    if not args.model:
        print("bench_vllm: give --model or KVBLEND_ENGINE_MODEL", file=sys.stderr)
        return 2
    build = str(Path(args.build).resolve())
    os.environ.setdefault("KVBLEND_LIB", f"{build}/lib/libkvblend.so")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    # vLLM's and the worker's logs (the connector's "loaded" lines among them) go to a file;
    # the figures go to the original stdout.
    tmp = tempfile.mkdtemp(prefix="kvblend-bench-vllm.")
    # the blend pass needs kvblend's vllm.general_plugins entry point: a pip install
    eval_dir = str(ROOT / "eval")
    sys.path.insert(0, eval_dir)
    from engine_setup import install_package

    site = Path(tmp) / "site"
    install_package(site)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), eval_dir])
    sys.path[:0] = [str(site)]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    log_path = f"{tmp}/engine.log"
    saved = os.fdopen(os.dup(1), "w", buffering=1)
    out = lambda s: print(s, file=saved, flush=True)  # noqa: E731
    out(f"load average before: {os.getloadavg()}, cpus {os.cpu_count()}, log {log_path}")
    daemon = start_daemon(build)
    ep = daemon.endpoint
    logf = open(log_path, "w")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(logf.fileno(), 1)
    os.dup2(logf.fileno(), 2)
    rc = 0
    try:
        rows = run(args, ep, out, log_path)
        table(rows, out)
        profile([r for r in rows if "concurrent" not in r], out)
    except Exception as e:  # report with the engine log's tail, then fail
        out(f"bench_vllm: {type(e).__name__}: {e}")
        out("".join(Path(log_path).read_text(errors="replace").splitlines(True)[-40:]))
        rc = 1
    finally:
        out(f"load average after: {os.getloadavg()}")
        daemon.stop(keep=rc != 0)
    if rc == 0 and not os.environ.get("KVB_KEEP_TMP"):
        shutil.rmtree(tmp, ignore_errors=True)
    return rc  # vLLM shuts its engine processes down at exit


if __name__ == "__main__":
    sys.exit(main())
