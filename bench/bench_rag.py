"""A RAG service through vLLM's OpenAI server: plain, prefix caching, kvblend reuse, CacheBlend.

Issue 32. One corpus, one list of queries, sent in one run to six configurations of
`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; docs/vllm.md, "A RAG
service in five minutes"), one after another, each its own server start and, for the
kvblend ones, its own kvblendd on a fresh data directory (store on a miss starts from
empty, so the hit rate is what the queries' Zipf reuse gives):

  plain            vLLM, --no-enable-prefix-caching, no connector: the reference (full prefill)
  prefix           vLLM with its prefix caching (its default): what a user has without kvblend
  reuse            + KvblendConnector, separator <|endoftext|>, store on a miss, full reuse
                   through the pass ("blend": {"check_layers": [], "ratios": []}: every stored
                   chunk re-rotated into place, nothing recomputed; docs/vllm.md)
  blend-value      + CacheBlend, "blend": {"metric": "value"} (HKVD on V at check layer 1,
                   r = 0.15: CacheBlend's own rule; the connector's default until 2026-12-05)
  blend-attention  + CacheBlend, "blend": {"metric": "attention"} (question-aware selection)
  blend-question   + CacheBlend, "blend": {"metric": "question"} (the question's attention
                   alone, previewed over every layer; on request)
  blend-anchored   + CacheBlend, "blend": {"metric": "anchored"} (the question's attention
                   previewed on each chunk's anchors and one layer; the connector's
                   default, "blend": {}, since 2026-12-05)

Corpus: real prose available offline: the docstrings (module, then its public classes and
functions, inspect.getdoc) of 86 Python standard-library modules of the interpreter that
runs this (the engine venv's, Python 3.11), split at blank lines and packed into documents
of 600-1000 characters (about 150-300 tokens), in a fixed order; a docstring shorter than
600 characters gives none, nor does a piece holding "<|" (the separator and SmolLM2's other
added tokens). The first --docs of them are the corpus.

Queries (seeded, --seed): each retrieves 4-6 distinct documents drawn by a Zipf popularity
over the first --docs documents (rank k with weight 1/k^--zipf, ranks a random permutation),
without replacement, in the order drawn (random), and asks about a word of 7+ letters taken
from one of them; every --first-sight-every-th query instead takes 4-6 documents of the
reserve (the documents after the first --docs, each used once), so that some requests
meet only documents nobody asked for before, spread over the run (with Zipf draws alone
only the first query would). The prompt, sent as text to /v1/completions by the `openai`
client (no chat template), is the instruction, the separator, each document followed by
the separator, then the question: the instruction is the prefix, each document with its
separator a chunk, the question fresh (docs/vllm.md, "Chunk boundaries by a separator").
Requests are sent at a fixed --rate, one every 1/rate seconds, not waiting for answers
(default 0.15/s: about what plain vLLM sustains for these ~900-token prompts on the shared
2-core machine, where one prefill alone takes 3.5-6 s in the server), each streamed
(stream=True), greedy (temperature 0), max_tokens=32 with ignore_eos (every answer 32
tokens), logprobs=20 and return_tokens_as_token_ids. Warm-up: two requests
without the separator (plain vLLM in every configuration) before the timed ones.

Figures per configuration:
- TTFT: from sending the request to its first streamed chunk (the first generated token);
  p50 and p90 over the queries. rps: queries / (last answer's end - first send).
- hit rate: chunks found in kvblendd / chunks looked up (kvblendd's lookup_hits and
  lookup_misses over the configuration's run; the scheduler looks each request's chunks up
  once). "cached": prompt tokens vLLM did not compute (the usage's
  prompt_tokens_details.cached_tokens, --enable-prompt-tokens-details: its prefix cache
  plus what the connector provided, reused or blended), over all prompt tokens.
- KL against plain's full prefill at the first generated token: over plain's top-20
  tokens, both distributions renormalised over those 20 (a token missing from the
  configuration's top-20 gets its 20th logprob, an upper bound), KL(plain || config); the
  mean over queries. Greedy agreement: the fraction of the 32 generated token ids equal
  to plain's at the same position, the mean over queries.
- by what an earlier query retrieved: the queries all of whose documents an earlier query
  retrieved (at best every chunk found, as a store filled on misses holds them once
  stored) and those with some documents new: TTFT p50 of each set against prefix
  caching's on the same queries.
- first sight: the queries none of whose documents an earlier query retrieved (every
  chunk a miss, stored on the miss; the reserve queries and the first): their TTFT
  median against plain's median for the same queries (target: within 10%, at most 1.10x).
A null logprob (NaN on the server) is counted and left out of KL.
Targets (issue 32): CacheBlend's TTFT p50 at most 0.5x of prefix caching's, at a KL at
most 0.35x of full reuse's. Prints figures and ratios; never passes or fails on time.
Server flags: --dtype float32 --max-model-len 2048 --enforce-eager --seed 0,
VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind; kvblendd with --workers 2 and
--shm-max 2G (vLLM's cache in a kvblend region: loads landed by the daemon). kvblend is
pip-installed into a temporary folder first (the blend pass and store on a miss need its
vllm.general_plugins entry point in vLLM's processes).

usage: bench_rag.py [--queries 200] [--docs 100] [--first-sight-every 10] [--rate 0.15]
       [--zipf 1.0] [--seed 0]
       [--configs plain,prefix,reuse,blend-value,blend-attention,blend-anchored]
       (on request: blend-question, and blend-value-idle: blend-value with store_idle_ms
       20, each layer of a store after 20 ms of idle engine; blend-METRIC@R, the
       metric at the connector's ratio R, e.g. blend-anchored@0.25; and blend-budget@MS,
       the default metric with a latency budget of MS ms instead of a ratio)
       [--out FILE.json] [--plot docs/bench_rag.svg] [--model DIR]
       bench_rag.py --from-json FILE.json [--plot FILE.svg]   (the table of a saved run)
(with the engine venv's python from .ci/engine-env, which tests/engine/run.sh sets up:
tests/engine/run.sh build/lib/libkvblend.so build/bin/kvblendd bench/bench_rag.py ...)
"""

import argparse
import asyncio
import importlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEP = "<|endoftext|>"
INSTRUCTION = ("Answer the question using only the documentation excerpts below. "
               "Quote the excerpt that answers it.")
QUESTION = "\n\nQuestion: What do the excerpts above say about {word}?\nAnswer:"
MODULES = [
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cgi", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "enum",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "heapq", "hmac",
    "http.client", "http.cookiejar", "imaplib", "inspect", "ipaddress", "json", "locale",
    "logging", "mailbox", "multiprocessing.pool", "optparse", "pathlib", "pickle", "pydoc",
    "queue", "random", "sched", "shutil", "smtplib", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "zipfile", "abc", "bdb", "code", "dis", "filecmp",
    "fileinput", "gzip", "io", "linecache", "lzma", "mimetypes", "netrc", "numbers", "pdb",
    "poplib", "pprint", "secrets", "selectors", "shelve", "timeit", "tokenize", "trace",
    "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "weakref",
    "xml.dom.minidom",
]
CONFIGS = {
    "plain": {"prefix_caching": False, "kv": None},
    "prefix": {"prefix_caching": True, "kv": None},
    "reuse": {"prefix_caching": True, "kv": {"blend": {"check_layers": [], "ratios": []}}},
    "blend-value": {"prefix_caching": True, "kv": {"blend": {"metric": "value"}}},
    "blend-attention": {"prefix_caching": True, "kv": {"blend": {"metric": "attention"}}},
    # the question's attention alone (A3-style) and its compressed preview (QCFuse-style),
    # issue 35's rules, at the connector's r = 0.15
    "blend-question": {"prefix_caching": True, "kv": {"blend": {"metric": "question"}}},
    "blend-anchored": {"prefix_caching": True, "kv": {"blend": {"metric": "anchored"}}},
    # CacheBlend with each layer of a store waiting for 20 ms of idle engine first
    # (store_idle_ms; blend-value's stores run as soon as the engine is between steps)
    "blend-value-idle": {"prefix_caching": True,
                         "kv": {"blend": {"metric": "value"}, "store_idle_ms": 20}},
}
#: blend-METRIC@R: CacheBlend by that metric at the connector's ratio R (e.g. blend-anchored@0.25)
CUSTOM = re.compile(r"blend-(value|key|attention|question|anchored)@(0(?:\.\d+)?|1(?:\.0*)?)")
#: blend-budget@MS: the default metric with a latency budget of MS milliseconds for the blend
#: pass instead of a ratio (the connector picks each request's ratio from its cost model)
BUDGET = re.compile(r"blend-budget@(\d+(?:\.\d+)?)")


def config_of(name):
    """A configuration by name (CONFIGS, blend-METRIC@R or blend-budget@MS); None for an
    unknown name."""
    if name in CONFIGS:
        return CONFIGS[name]
    b = BUDGET.fullmatch(name)
    if b is not None:
        return {"prefix_caching": True, "kv": {"blend": {"budget_ms": float(b.group(1))}}}
    m = CUSTOM.fullmatch(name)
    if m is None:
        return None
    return {"prefix_caching": True,
            "kv": {"blend": {"metric": m.group(1), "ratios": [float(m.group(2))]}}}


#: Run when --configs is not given (blend-question and blend-value-idle only
#: when asked for).
DEFAULT_CONFIGS = ("plain", "prefix", "reuse", "blend-value", "blend-attention", "blend-anchored")
MAX_TOKENS = 32
TOP = 20
START_TIMEOUT = 900


def corpus():
    """The docstring corpus's documents, in a fixed order (module docstring, above)."""
    import warnings

    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cgi's DeprecationWarning
        for name in MODULES:
            mod = importlib.import_module(name)
            texts = [inspect.getdoc(mod) or ""]
            for attr in sorted(vars(mod)):
                obj = getattr(mod, attr)
                if (not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                        and getattr(obj, "__module__", None) == mod.__name__):
                    texts.append(inspect.getdoc(obj) or "")
            for text in texts:
                if len(text) < 600:
                    continue
                cur = ""
                for para in text.split("\n\n"):
                    cur = f"{cur}\n\n{para}" if cur else para
                    if len(cur) >= 600:
                        if len(cur) <= 1000 and "<|" not in cur:
                            docs.append(cur)
                        cur = ""
    return docs


def make_queries(docs, n_zipf, n, zipf, seed, every):
    """``n`` queries: (document indices in prompt order, question word).

    Zipf draws over ``docs[:n_zipf]``; every ``every``-th query (0: none) instead takes its
    documents from the reserve ``docs[n_zipf:]``, each reserve document once.
    """
    rng = random.Random(seed)
    rank = list(range(n_zipf))
    rng.shuffle(rank)  # rank[k] is the document of popularity rank k + 1
    weights = [1.0 / (k + 1) ** zipf for k in range(n_zipf)]
    out, reserve = [], n_zipf
    for i in range(n):
        k = rng.randint(4, 6)
        if every and i % every == every // 2:
            if reserve + k > len(docs):
                raise RuntimeError(f"the corpus has {len(docs)} documents: too few for "
                                   "--docs and the first-sight queries")
            picked = list(range(reserve, reserve + k))
            reserve += k
        else:
            picked = []
            while len(picked) < k:  # weighted draws without replacement
                d = rank[rng.choices(range(n_zipf), weights)[0]]
                if d not in picked:
                    picked.append(d)
        words = sorted(set(re.findall(r"\b[a-z]{7,}\b", docs[rng.choice(picked)])))
        out.append((picked, rng.choice(words) if words else "this"))
    return out


def prompt_of(docs, query):
    picked, word = query
    return INSTRUCTION + SEP + "".join(docs[d] + SEP for d in picked) + QUESTION.format(word=word)


def first_sight(queries):
    """Indices of the queries none of whose documents an earlier query retrieved."""
    seen, out = set(), []
    for i, (picked, _) in enumerate(queries):
        if not seen.intersection(picked):
            out.append(i)
        seen.update(picked)
    return out


def start_server(name, cfg, model, tmp, env):
    """kvblendd (kvblend configurations) and the OpenAI server; returns (procs, port, ep)."""
    from harness import Daemon, Group, free_port

    d = Path(tmp) / name
    d.mkdir()
    procs, ep = [], None
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048",
            "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log"]
    if not cfg["prefix_caching"]:
        argv.append("--no-enable-prefix-caching")
    if cfg["kv"] is not None:
        ep = f"ipc://{d}/kvblend.sock"
        procs.append(Daemon("--shm-max", "2G", kvblendd=os.environ["KVBLENDD"], dir=d))
        extra = {"endpoint": ep, "chunk_separator_text": SEP, **cfg["kv"]}
        argv += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "KvblendConnector", "kv_connector_module_path": "kvblend.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": extra})]
    port = free_port()
    server = Group(argv + ["--port", str(port)], f"{d}/server.log", env)
    procs.append(server)
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if not server.alive() or time.monotonic() - t0 > START_TIMEOUT:
            for p in reversed(procs):
                p.stop()
            raise RuntimeError(f"{name}: the server did not start:\n{server.tail(60)}")
        time.sleep(2)
    return procs, port, ep, time.monotonic() - t0


async def one_request(client, prompt, when):
    """Send at ``when`` (loop time); returns the request's record."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, when - loop.time()))
    t0 = time.monotonic()
    ttft, ids, tops, usage = None, [], [], None
    stream = await client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
        stream=True, stream_options={"include_usage": True},
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ttft is None:
                ttft = time.monotonic() - t0
            lp = ch.logprobs
            if lp is None:
                continue
            ids += [int(t.split(":", 1)[1]) for t in lp.tokens]
            tops += [{int(k.split(":", 1)[1]): v for k, v in (d or {}).items()}
                     for d in lp.top_logprobs]
    cached = None
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens
    return {"sent": t0, "end": time.monotonic(), "ttft_s": ttft, "ids": ids,
            "top0": {str(k): v for k, v in tops[0].items()} if tops else {},
            "prompt_tokens": usage.prompt_tokens if usage else None, "cached_tokens": cached}


async def send_all(port, prompts, rate, warm):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         timeout=1800, max_retries=0)
    loop = asyncio.get_running_loop()
    for p in warm:
        await one_request(client, p, loop.time())
    t0 = loop.time() + 0.5
    recs = await asyncio.gather(*(one_request(client, p, t0 + i / rate)
                                  for i, p in enumerate(prompts)))
    await client.close()
    return recs


def daemon_lookups(ep):
    import kvblend

    with kvblend.Client(ep, timeout_ms=5000) as c:
        s = c.stats()
    return s["lookup_hits"], s["lookup_misses"]


def kl_top(ref, got):
    """KL(ref || got) over ref's top tokens, both renormalised there (docstring).

    A logprob the server sent as null (JSON has no NaN) counts as absent: in ``got`` it
    gets the floor; None when ``ref`` or ``got`` has no number at all.
    """
    ref = {k: v for k, v in ref.items() if v is not None}
    got = {k: v for k, v in got.items() if v is not None}
    if not ref or not got:
        return None
    floor = min(got.values())
    p = {k: math.exp(v) for k, v in ref.items()}
    q = {k: math.exp(got.get(k, floor)) for k in ref}
    sp, sq = sum(p.values()), sum(q.values())
    return sum(p[k] / sp * math.log((p[k] / sp) / (q[k] / sq)) for k in ref if p[k] > 0)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def seen_before(docs_of):
    """Indices of the queries all of whose documents an earlier query retrieved, and of
    those with some (not all, not none): what a store filled on a miss can hold at best."""
    seen, every, some = set(), [], []
    for i, docs in enumerate(docs_of):
        old = len(seen.intersection(docs))
        if old == len(docs):
            every.append(i)
        elif old:
            some.append(i)
        seen.update(docs)
    return every, some


def summarize(name, recs, ref, lookups, fresh, seen=((), ())):
    ttft = [r["ttft_s"] for r in recs]
    span = max(r["end"] for r in recs) - min(r["sent"] for r in recs)
    s = {"config": name, "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
         "rps": len(recs) / span, "requests": len(recs),
         # the second half of the queries: a store warmed by the first (steady state)
         "ttft_p50_late_s": pct(ttft[len(ttft) // 2:], 0.5)}
    tokens = sum(r["prompt_tokens"] or 0 for r in recs)
    cached = [r["cached_tokens"] for r in recs]
    s["prompt_tokens_mean"] = tokens / len(recs)
    s["cached_share"] = None if None in cached or not tokens else sum(cached) / tokens
    s["lookup_hits"], s["lookup_misses"] = lookups if lookups else (None, None)
    s["hit_rate"] = (lookups[0] / (lookups[0] + lookups[1])
                     if lookups and lookups[0] + lookups[1] else None)
    s["null_logprobs"] = sum(None in r["top0"].values() or not r["top0"] for r in recs)
    kls = [kl_top(rf["top0"], r["top0"]) for r, rf in zip(recs, ref)]
    kls = [x for x in kls if x is not None]
    agree = [sum(a == b for a, b in zip(r["ids"], rf["ids"])) / MAX_TOKENS
             for r, rf in zip(recs, ref)]
    s["kl_mean"] = sum(kls) / len(kls) if kls else float("nan")
    s["kl_p90"] = pct(kls, 0.9)
    s["greedy_agreement"] = sum(agree) / len(agree)
    for key, idx in zip(("seen_all", "seen_some"), seen):
        s[f"{key}_n"] = len(idx)
        s[f"{key}_ttft_p50_s"] = pct([recs[i]["ttft_s"] for i in idx], 0.5) if idx else None
    s["first_sight_n"] = len(fresh)
    if fresh:
        s["first_sight_ttft_p50_s"] = pct([recs[i]["ttft_s"] for i in fresh], 0.5)
        s["first_sight_vs_plain"] = (s["first_sight_ttft_p50_s"]
                                     / pct([ref[i]["ttft_s"] for i in fresh], 0.5))
    return s


def table(rows, out):
    f = lambda x, fmt: "-" if x is None else format(x, fmt)
    out("")
    out("| config | TTFT p50 | TTFT p90 | req/s | chunk hit rate | prompt cached | KL (mean) "
        "| greedy agreement | first-sight TTFT p50 (vs plain) |")
    out("|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        fs = (f"{s['first_sight_ttft_p50_s'] * 1000:.0f} ms "
              f"({s['first_sight_vs_plain']:.2f}x, {s['first_sight_n']} req)"
              if s["first_sight_n"] else "-")
        kl = f"{s['kl_mean']:.4f}"
        if s["null_logprobs"]:
            kl += f" (over {s['requests'] - s['null_logprobs']} of {s['requests']}: rest NaN)"
        out(f"| {s['config']} | {s['ttft_p50_s'] * 1000:.0f} ms | {s['ttft_p90_s'] * 1000:.0f} ms "
            f"| {s['rps']:.3f} | {f(s['hit_rate'], '.1%')} | {f(s['cached_share'], '.1%')} "
            f"| {kl} | {s['greedy_agreement']:.1%} | {fs} |")
    by = {s["config"]: s for s in rows}
    out("")
    for s in rows:
        if s["null_logprobs"]:
            out(f"{s['config']}: {s['null_logprobs']} of {s['requests']} requests had null "
                "logprobs at the first token (NaN on the server; left out of KL)")
    for b in (s["config"] for s in rows if s["config"].startswith("blend-")):
        if "prefix" in by:
            out(f"{b}: TTFT p50 {by[b]['ttft_p50_s'] / by['prefix']['ttft_p50_s']:.2f}x of "
                "prefix caching's (target <= 0.5x)")
        if "reuse" in by and by["reuse"]["null_logprobs"]:
            out(f"{b}: KL against full reuse's: not measurable, full reuse's first token was "
                f"NaN in {by['reuse']['null_logprobs']} of {by['reuse']['requests']} requests")
        elif "reuse" in by and by["reuse"]["kl_mean"] > 0:
            out(f"{b}: KL {by[b]['kl_mean'] / by['reuse']['kl_mean']:.2f}x of full reuse's "
                "(target <= 0.35x)")
    if "prefix" in by:
        ref = by["prefix"].get("ttft_p50_late_s")
        if ref:
            out("second half of the queries (the store warmed by the first): TTFT p50 against "
                "prefix caching's: " + ", ".join(
                    f"{s['config']} {s['ttft_p50_late_s'] * 1000:.0f} ms "
                    f"({s['ttft_p50_late_s'] / ref:.2f}x)"
                    for s in rows if s.get("ttft_p50_late_s")))
    if "prefix" in by:
        for key, what in (("seen_all", "every document retrieved by an earlier query"),
                          ("seen_some", "some documents new, some retrieved before")):
            ref = by["prefix"].get(f"{key}_ttft_p50_s")
            if not ref:
                continue
            out(f"{what} ({by['prefix'][f'{key}_n']} requests): TTFT p50 against prefix "
                "caching's on the same requests: " + ", ".join(
                    f"{s['config']} {s[f'{key}_ttft_p50_s'] * 1000:.0f} ms "
                    f"({s[f'{key}_ttft_p50_s'] / ref:.2f}x)"
                    for s in rows if s.get(f"{key}_ttft_p50_s")))
    out("first sight (every chunk a miss): TTFT p50 against plain's on the same requests, "
        "target <= 1.10x: " + ", ".join(f"{s['config']} {s['first_sight_vs_plain']:.2f}x"
                                        for s in rows if s["first_sight_n"]))
    if "prefix" in by and by["prefix"]["first_sight_n"]:
        ref = by["prefix"]["first_sight_ttft_p50_s"]
        out("the same against prefix caching's (vLLM as a user runs it, plain's work but the "
            "instruction's blocks): " + ", ".join(
                f"{s['config']} {s['first_sight_ttft_p50_s'] / ref:.2f}x"
                for s in rows if s["first_sight_n"]))


def svg_plot(rows, path, title):
    """Two bar panels, TTFT p50/p90 and KL, as a small hand-written SVG."""
    w, h, pad, gap = 900, 380, 60, 40
    pw = (w - 2 * pad - gap) / 2
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
              f'font-family="sans-serif" font-size="12">'),
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']

    def panel(x0, label, series, colors, fmt):
        top, bottom = 50, h - 70
        vmax = max(v for s in series for v in s) or 1.0
        parts.append(f'<text x="{x0 + pw / 2}" y="40" text-anchor="middle">{label}</text>')
        parts.append(f'<line x1="{x0}" y1="{bottom}" x2="{x0 + pw}" y2="{bottom}" stroke="black"/>')
        n, k = len(rows), len(series)
        slot = pw / n
        bw = slot * 0.7 / k
        for i, s in enumerate(rows):
            for j, vals in enumerate(series):
                v = vals[i]
                bh = (bottom - top) * v / vmax
                x = x0 + i * slot + slot * 0.15 + j * bw
                parts.append(f'<rect x="{x:.1f}" y="{bottom - bh:.1f}" width="{bw:.1f}" '
                             f'height="{bh:.1f}" fill="{colors[j]}"/>')
                parts.append(f'<text x="{x + bw / 2:.1f}" y="{bottom - bh - 3:.1f}" '
                             f'text-anchor="middle" font-size="9">{fmt(v)}</text>')
            cx = x0 + i * slot + slot / 2
            parts.append(f'<text x="{cx:.1f}" y="{bottom + 14}" text-anchor="middle" '
                         f'font-size="{10 if n <= 5 else 8}">{s["config"]}</text>')

    panel(pad, "TTFT p50 (dark) and p90 (light), ms",
          [[s["ttft_p50_s"] * 1000 for s in rows], [s["ttft_p90_s"] * 1000 for s in rows]],
          ["#1f5fa8", "#9cc3ea"], lambda v: f"{v:.0f}")
    panel(pad + pw + gap, "KL at the first token against plain (mean, requests without NaN)",
          [[s["kl_mean"] for s in rows]], ["#b5452b"], lambda v: f"{v:.3f}")
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n")


def run_config(name, args, prompts, warm, tmp, env):
    """One configuration: its servers started, the queries sent, the servers stopped."""
    procs, port, ep, secs = start_server(name, config_of(name), args.model, tmp, env)
    try:
        before = daemon_lookups(ep) if ep else None
        t0 = time.monotonic()
        try:
            recs = asyncio.run(send_all(port, prompts, args.rate, warm))
        except Exception as e:
            died = [ln for ln in Path(procs[-1].log_path).read_text(errors="replace").splitlines()
                    if "malloc(" in ln or "died" in ln or "Segmentation" in ln]
            raise RuntimeError(f"{type(e).__name__}: {e} {died[:3]}") from e
        wall = time.monotonic() - t0
        lookups = None
        if ep:
            after = daemon_lookups(ep)
            lookups = (after[0] - before[0], after[1] - before[1])
    finally:
        for p in reversed(procs):
            p.stop()
    return recs, lookups, secs, wall


def bootstrap_mean(diffs, n=10000, seed=1):
    """Mean of paired differences with its 90% bootstrap interval (seeded, n resamples)."""
    rng, m = random.Random(seed), len(diffs)
    means = sorted(sum(diffs[rng.randrange(m)] for _ in range(m)) / m for _ in range(n))
    return sum(diffs) / m, means[int(0.05 * n)], means[int(0.95 * n)]


def paired(res, out):
    """Each CacheBlend configuration against the others, query by query.

    Per pair: the mean difference of first-token KL against plain's (90% bootstrap
    interval, the queries resampled), on how many queries the first is lower, and the
    median of the per-query TTFT ratio. What docs/EVAL.md's rule for a default reads
    ("a 90% interval excluding zero ... and no worse in TTFT").
    """
    names = [n for n in res if n.startswith("blend-")]
    ref = res.get("plain")
    if ref is None or len(names) < 2:
        return
    out("")
    out("paired, query by query (KL of the first token against plain's; 90% bootstrap "
        "interval):")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs = [(kl_top(rf["top0"], x["top0"]), kl_top(rf["top0"], y["top0"]),
                      x["ttft_s"] / y["ttft_s"])
                     for rf, x, y in zip(ref, res[a], res[b])]
            pairs = [p for p in pairs if p[0] is not None and p[1] is not None]
            if not pairs:
                continue
            mean, lo, hi = bootstrap_mean([x - y for x, y, _ in pairs])
            lower = sum(x < y for x, y, _ in pairs)
            out(f"  {a} - {b}: KL {mean:+.4f} ({lo:+.4f} .. {hi:+.4f}), lower on {lower} of "
                f"{len(pairs)}; TTFT {a}/{b} median {pct([r for _, _, r in pairs], 0.5):.2f}x")


def from_json(args):
    """Print the table (and write the plot) of a run saved with --out."""
    data = json.loads(Path(args.from_json).read_text())
    res, meta = data["requests"], data.get("meta", {})
    rows = []
    for name, recs in res.items():
        m = meta.get(name, {})
        s = summarize(name, recs, res["plain"], m.get("lookups"), data["first_sight"],
                      seen_before([q["docs"] for q in data["queries"]]))
        rows.append({**s, **m})
    table(rows, print)
    paired(res, print)
    for name, why in data.get("failed", {}).items():
        print(f"{name}: FAILED: {why}")
    if args.plot:
        a = data["args"]
        svg_plot(rows, args.plot, f"bench_rag.py: {a['queries']} queries at {a['rate']}/s, "
                 "SmolLM2-135M on CPU vLLM 0.32")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--docs", type=int, default=100, help="documents drawn by popularity")
    ap.add_argument("--rate", type=float, default=0.15, help="requests per second")
    ap.add_argument("--first-sight-every", type=int, default=10,
                    help="every Nth query retrieves documents no other query does (0: none)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, plain first, from {', '.join(CONFIGS)}, "
                    "or blend-METRIC@R (a metric at the connector's ratio R, 0 to 1), or "
                    "blend-budget@MS (a latency budget of MS ms for the blend pass)")
    ap.add_argument("--out", help="write every figure and request record as JSON here")
    ap.add_argument("--plot", help="write an SVG plot here (e.g. docs/bench_rag.svg)")
    ap.add_argument("--model", default=os.environ.get("KVBLEND_ENGINE_MODEL"))
    ap.add_argument("--from-json", help="no run: the table and plot of a saved --out file")
    ap.add_argument("--keep", action="store_true",
                    help="keep the servers' logs and data (printed at the end)")
    args = ap.parse_args()
    if args.from_json:
        return from_json(args)
    names = args.configs.split(",")
    if not args.model or names[0] != "plain" or any(config_of(n) is None for n in names):
        print("bench_rag: needs --model (or KVBLEND_ENGINE_MODEL) and --configs starting with "
              f"plain, from {list(CONFIGS)} or blend-METRIC@R (METRIC value, key, attention, "
              "question or anchored; R the ratio, 0 to 1)", file=sys.stderr)
        return 2
    for var in ("KVBLEND_LIB", "KVBLENDD"):
        if not os.environ.get(var):
            print(f"bench_rag: ${var} is not set (run through tests/engine/run.sh)",
                  file=sys.stderr)
            return 2
    t_all = time.monotonic()
    docs = corpus()
    queries = make_queries(docs, args.docs, args.queries, args.zipf, args.seed,
                           args.first_sight_every)
    prompts = [prompt_of(docs, q) for q in queries]
    fresh = first_sight(queries)
    warm = ["Write one sentence about libraries, reading rooms and quiet study. " * 3,
            "Explain what a docstring is in one short paragraph."]
    used = sorted({d for q in queries for d in q[0]})
    print(f"bench_rag: {len(used)} documents used of {len(docs)} "
          f"({min(len(docs[d]) for d in used)}-{max(len(docs[d]) for d in used)} characters; "
          f"Zipf over {args.docs}), {len(queries)} queries of {min(len(q[0]) for q in queries)}-"
          f"{max(len(q[0]) for q in queries)} documents ({len({d for q in queries for d in q[0]})}"
          f" distinct), {len(fresh)} first-sight; rate {args.rate}/s; configs {names}; "
          f"load average {os.getloadavg()}", flush=True)

    sys.path.insert(0, str(ROOT / "eval"))
    from engine_setup import install_package

    tmp = tempfile.mkdtemp(prefix="kvblend-bench-rag.")
    site = Path(tmp) / "site"
    install_package(site)
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    results, rows, failed, meta = {}, [], {}, {}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"args": vars(args), "summary": rows, "failed": failed, "meta": meta,
                 "first_sight": fresh,
                 "queries": [{"docs": q[0], "word": q[1]} for q in queries],
                 "requests": results}, indent=1) + "\n")

    for name in names:
        try:
            recs, lookups, secs, wall = run_config(name, args, prompts, warm, tmp, env)
        except Exception as e:  # noqa: BLE001 (a failed configuration is reported, the rest run)
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"  {name}: FAILED: {failed[name]}; logs in {tmp}/{name}", flush=True)
            if name == "plain":
                break
            continue
        results[name] = recs
        meta[name] = {"lookups": lookups, "server_start_s": secs, "run_s": wall,
                      "loadavg": os.getloadavg()}
        save()
        s = summarize(name, recs, results["plain"], lookups, fresh,
                      seen_before([q[0] for q in queries]))
        s.update(meta[name])
        rows.append(s)
        print(f"  {name}: server up in {secs:.0f} s, {len(recs)} requests in {wall:.0f} s, "
              f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms, load average {s['loadavg']}",
              flush=True)
        save()
    table(rows, print)
    paired(results, print)
    for name, why in failed.items():
        print(f"{name}: FAILED: {why}")
    print(f"\nbench_rag: {time.monotonic() - t_all:.0f} s in all, load average {os.getloadavg()}")
    save()
    if args.plot and rows:
        svg_plot(rows, args.plot, f"bench_rag.py: {len(queries)} queries at {args.rate}/s, "
                 f"{len(used)} documents, SmolLM2-135M on CPU vLLM 0.32")
    if failed or args.keep:
        print(f"bench_rag: logs in {tmp}")
    if failed:
        return 1
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
