"""CacheBlend's quality and time to first token on SmolLM2-135M-Instruct, through kvblendd.

Reads top to bottom: load the model, build RAG requests from real text, start a
kvblendd of this build, store the chunks, run every mode against a full
prefill, print the tables, draw the plot.

    eval/run [--build DIR] [options]           (sets up the venv; eval/README.md)
    python eval/run_eval.py --build DIR [--requests 50] [--seed 11] [--smoke]

Text (nothing written by this project): the license texts Debian ships in
/usr/share/common-licenses (package base-files) and the topics of the Python
Language and Library Reference that pydoc carries (pydoc_data/topics.py of
Debian's python3.11, package libpython3.11-stdlib), topics of at least 700
tokens. A request: the chat template around an instruction, 3-8 chunks of
128-512 tokens from different documents (each after a fresh "Document i:"
line), a question about them; the answer is the full prefill's own greedy
continuation (up to 32 tokens, to EOS), teacher-forced in every mode.

Modes, each against the full prefill: full reuse (the daemon's get-rerotated,
fresh tokens computed), CacheBlend through a fuse session (value and key
metric, check layer 1, several r; gradual filtering over two check layers),
EPIC's static selection of the first tokens of each chunk at the budget of r
(also on get-rerotated chunks). The measures are defined in docs/EVAL.md.

With --codecs, the same chunks are stored once per store codec (a model of its
own per codec, same layout; the chunks prefilled once and PUT into each), and
full reuse and CacheBlend (value metric, each --ratios r, default 0.15) run on
every codec against the same full prefill: bytes per token as the daemon
stores them, quality per codec, docs/eval_codecs.png.
"""

import argparse
import ast
import glob
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cacheblend import Request, epic_selection, kl_top1  # noqa: E402
from model import Model  # noqa: E402
from tokenizer import SmolTokenizer  # noqa: E402
import node  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
LICENSE_DOCS = ["Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1",
                "LGPL-3", "MPL-1.1", "MPL-2.0"]
TOPICS_GLOB = "/usr/lib/python3*/pydoc_data/topics.py"
MIN_DOC_TOKENS = 700
SPARSITY_TOP = 0.15


# --- 1. Text and requests ---------------------------------------------------

def collapse(text):
    """Whitespace inside paragraphs collapsed; paragraphs kept."""
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(p for p in paras if p)


def load_documents(tok):
    """name -> token ids: the licenses, then the pydoc topics of >= MIN_DOC_TOKENS tokens."""
    docs = {}
    for name in LICENSE_DOCS:
        path = LICENSES / name
        if path.exists():
            docs[f"license:{name}"] = tok.encode(collapse(path.read_text(errors="replace")))
    files = sorted(glob.glob(TOPICS_GLOB))
    if files:
        tree = ast.parse(Path(files[-1]).read_text(errors="replace"))
        for stmt in tree.body:
            if (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
                    and stmt.targets[0].id == "topics"):
                for key, text in sorted(ast.literal_eval(stmt.value).items()):
                    ids = tok.encode(collapse(text))
                    if len(ids) >= MIN_DOC_TOKENS:
                        docs[f"pydoc:{key}"] = ids
    if len(docs) < 8:
        raise SystemExit(f"only {len(docs)} documents found under {LICENSES} and {TOPICS_GLOB}")
    return docs


SHAPES = {
    # chunks per request, chunk lengths to draw from, most chunk tokens in a request, answer
    "full": dict(n_chunks=(3, 8), lengths=(128, 192, 256, 320, 384, 448, 512), cap=1280,
                 answer=32),
    "smoke": dict(n_chunks=(3, 3), lengths=(24, 32, 40), cap=96, answer=4),
}

QUESTIONS = [
    "Summarize document {i} in one sentence.",
    "What does document {i} say? Answer in two sentences.",
    "Which document mentions \"{word}\", and what does it say about it?",
    "Continue document {i} with the next sentence.",
    "What is the main topic of the last document?",
    "List three important terms from document {i} and explain one of them.",
]


#: Stands for the user's text in the chat template (no whitespace: a template may trim it).
USER_MARK = "USER-TEXT-HERE"


def build_request(k, seed, docs, tok, shape, separators=True, questions=QUESTIONS):
    """Request k: (segments, info). Draws with numpy's default_rng([seed, k]).

    separators False: no "Document i:" lines, the chunks follow one another directly
    (investigate.py); questions: the templates to draw from."""
    rng = np.random.default_rng([seed, k])
    names = sorted(docs)
    n = int(rng.integers(shape["n_chunks"][0], shape["n_chunks"][1] + 1))
    lengths = [int(x) for x in rng.choice(shape["lengths"], n)]
    step = min(shape["lengths"])
    while sum(lengths) > shape["cap"]:  # shrink the longest until the request fits
        i = int(np.argmax(lengths))
        lengths[i] -= step // 2
    picked = [names[i] for i in rng.choice(len(names), n, replace=False)]
    chunks = []
    for name, T in zip(picked, lengths):
        ids = docs[name]
        start = int(rng.integers(0, (len(ids) - T) // 64 + 1)) * 64
        chunks.append(ids[start:start + T])
    q = questions[int(rng.integers(len(questions)))]
    i = int(rng.integers(1, n + 1))
    words = [w.strip(".,;:()\"'") for w in tok.decode(chunks[i - 1]).split()]
    words = [w for w in words if w.isalpha() and len(w) >= 6] or ["license"]
    question = q.format(i=i, word=words[int(rng.integers(len(words)))])
    instruction = f"Answer the question using the {n} documents below.\n\n"
    # the user turn around the text, from the tokenizer's chat template: SmolLM2's
    # "<|im_start|>system...user\n" .. "<|im_end|>\n<|im_start|>assistant\n"
    head, tail = tok.chat(USER_MARK).split(USER_MARK)
    end = f"\n\nQuestion: {question}{tail}"
    if not separators:
        return ([("fresh", tok.encode(head + instruction))] + [("chunk", c) for c in chunks]
                + [("fresh", tok.encode(end))]), {"docs": picked, "lengths": lengths,
                                                  "question": question}
    segments = [("fresh", tok.encode(f"{head}{instruction}Document 1:\n"))]
    for j, c in enumerate(chunks):
        segments.append(("chunk", c))
        tail = f"\n\nDocument {j + 2}:\n" if j + 1 < n else end
        segments.append(("fresh", tok.encode(tail)))
    return segments, {"docs": picked, "lengths": lengths, "question": question}


# --- 2. Modes -----------------------------------------------------------------

def make_modes(ratios, check_layer, gradual):
    """(name, spec) pairs; spec kind "fuse" (through a fuse session) or "static"."""
    modes = [("full reuse", dict(kind="static", ratio=0.0))]
    for metric, tag in (("value", "V"), ("key", "K")):
        for r in ratios:
            modes.append((f"CacheBlend {tag} r={r:g}",
                          dict(kind="fuse", checks=(check_layer,), ratios=(r,), metric=metric,
                               ratio=r)))
    if gradual:
        checks, rs = gradual
        modes.append((f"gradual V L{checks[0]},{checks[1]} r={rs[0]:g}>{rs[1]:g}",
                      dict(kind="fuse", checks=checks, ratios=rs, metric="value",
                           ratio=rs[-1])))
    for r in ratios:
        modes.append((f"EPIC r={r:g}", dict(kind="static", ratio=r)))
    return modes


def codec_modes(ratios, check_layer):
    """The modes of a --codecs run: full reuse and CacheBlend (value metric) at each r."""
    return [("full reuse", dict(kind="static", ratio=0.0))] + [
        (f"CacheBlend V r={r:g}", dict(kind="fuse", checks=(check_layer,), ratios=(r,),
                                       metric="value", ratio=r)) for r in ratios]


# Store codecs (docs/storage.md "Quantized storage"), each a model of its own: f32 is the
# node's own precision stored losslessly (the default run's model), f16 the node's KV
# rounded to f16 and stored losslessly, the others quantized by the daemon and decoded
# back to f32 on every read (fuse landing, get-rerotated).
def codec_model(codec):
    """(model name, dtype, store) of a codec: f32, f16, fp8, int8, int4 or int4:G."""
    if codec in ("f32", "f16"):
        name = node.MODEL_NAME if codec == "f32" else f"{node.MODEL_NAME}-{codec}"
        return name, codec, "dtype"
    if codec in ("fp8", "int8") or re.fullmatch(r"int4(:[0-9]+)?", codec):
        return f"{node.MODEL_NAME}-{codec.replace(':', '-g')}", "f32", codec
    raise SystemExit(f"codec {codec!r}: f32, f16, fp8, int8, int4 or int4:G")


# --- 3. The node's passes -------------------------------------------------------

def top_mass(q, K, rows, cfg, top):
    """Mean over heads and rows of the attention mass on the top ceil(top * keys) keys."""
    rep = cfg.n_heads // cfg.n_kv_heads
    Kh = np.repeat(K, rep, axis=1)  # [N, heads, d]
    s = np.einsum("qhd,khd->hqk", q, Kh) / np.float32(np.sqrt(cfg.head_dim))
    s = np.where(np.arange(K.shape[0])[None, None, :] > rows[None, :, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    cs = np.cumsum(-np.sort(-p, axis=-1), axis=-1)
    kk = np.ceil(top * (rows + 1)).astype(int) - 1
    return float(np.take_along_axis(cs, np.broadcast_to(kk[None, :, None], cs.shape[:2] + (1,)),
                                    axis=-1).mean())


def full_prefill(model, ids, probe):
    """Every token computed: logits at the last row, the KV, seconds (without the sparsity
    probe), and per layer the attention mass share on the top 15% of keys at rows probe."""
    c = model.cfg
    t0 = time.perf_counter()
    t_probe = 0.0
    pos = np.arange(len(ids))
    kv = np.empty((c.n_layers, 2, len(ids), c.n_kv_heads, c.head_dim), np.float32)
    sparsity = np.zeros(c.n_layers)
    h = model.embed(ids)
    for l in range(c.n_layers):
        q, k, v = model.qkv(l, h, pos)
        kv[l, 0], kv[l, 1] = k, v
        h = model.attend(l, h, q, k, v, pos)
        t1 = time.perf_counter()
        sparsity[l] = top_mass(q[probe], k, probe, c, SPARSITY_TOP)
        t_probe += time.perf_counter() - t1
    logits = model.logits(h[-1:])
    return logits, kv, time.perf_counter() - t0 - t_probe, sparsity


def greedy(model, kv, last_logits, n, stop):
    """Greedy continuation of up to n tokens (stopping after a stop token) on prompt KV kv."""
    out, logits = [], last_logits
    while len(out) < n:
        t = int(np.argmax(logits[-1]))
        out.append(t)
        if t in stop:
            break
        logits, new = model.prefill([t], past=kv)
        kv = np.concatenate([kv, new], axis=2)
    return np.array(out, np.int64)


def answer_logits(model, kv, last_logits, answer):
    """Next-token logits at each answer position, the answer teacher-forced on prompt KV kv:
    row 0 from the prompt's last token, row i from answer[i-1]."""
    if len(answer) <= 1:
        return last_logits
    return np.concatenate([last_logits, model.prefill(answer[:-1], past=kv)[0]])


def run_mode(model, store, fuse, req, hashes, spec):
    rows = np.array([req.N - 1])
    if spec["kind"] == "fuse":
        return node.fuse_forward(model, req, hashes, fuse, spec["checks"], spec["ratios"],
                                 spec["metric"], rows)
    recompute = epic_selection(req, spec["ratio"]) if spec["ratio"] > 0 else None
    return node.static_forward(model, store, req, hashes, rows, recompute)


# --- 4. Tables and plot ---------------------------------------------------------

def bootstrap(a, b, n=2000, seed=0):
    """5th and 95th percentile of mean(a) / mean(b) over requests drawn with replacement."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    idx = rng.integers(0, len(a), (n, len(a)))
    return np.percentile(a[idx].mean(1) / b[idx].mean(1), [5, 95])


def paired_interval(d, rng, n=2000):
    """Mean of per-request differences d and its paired 90% bootstrap interval (n
    resamples of the requests drawn from rng): (mean, lo, hi)."""
    d = np.asarray(d, np.float64)
    boot = d[rng.integers(0, len(d), (n, len(d)))].mean(1)
    lo, hi = np.percentile(boot, [5, 95])
    return d.mean(), lo, hi


def summarize(records, modes):
    """Per mode: means over requests."""
    out = {}
    for name, spec in [("full prefill", None)] + modes:
        rs = [r["modes"][name] for r in records]
        keys = rs[0].keys()
        out[name] = {k: float(np.mean([x[k] for x in rs])) for k in keys
                     if isinstance(rs[0][k], (int, float, bool))}
        if spec is not None:
            out[name]["ratio"] = spec["ratio"]
    return out


def print_tables(summary, records, modes, args):
    n = len(records)
    base = summary["full reuse"]["kl"]
    print(f"\n## Quality over {n} requests (mean over requests; KL in nats, answer positions)\n")
    print("| mode | recomputed | mean KL | KL reuse / KL mode (90% CI) | KL 1st token | top-1 "
          "| greedy prefix | greedy exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    reuse = [r["modes"]["full reuse"]["kl"] for r in records]
    for name, _ in [("full prefill", None)] + modes:
        s = summary[name]
        gain = "-"
        if s["kl"] > 1e-12:
            lo, hi = bootstrap(reuse, [r["modes"][name]["kl"] for r in records])
            gain = f"{base / s['kl']:.2f}x ({lo:.1f}-{hi:.1f})"
        print(f"| {name} | {s['recomputed']:.1%} | {s['kl']:.4f} | {gain} | {s['kl_first']:.4f} "
              f"| {s['top1']:.1%} | {s['prefix']:.1%} | {s['exact']:.0%} |")
    print("\n## Time to first token (ms, mean over requests; node = NumPy on this CPU)\n")
    print("| mode | TTFT | node compute | in client calls | daemon compute | rest of calls "
          "(transfer, waits) | daemon load, land (background) | TTFT median |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, _ in [("full prefill", None)] + modes:
        s = summary[name]
        rest = s["calls"] * 1e3 - s["compute_ms"]
        med = np.median([r["modes"][name]["total"] for r in records])
        print(f"| {name} | {s['total'] * 1e3:.0f} | {s['node'] * 1e3:.0f} | {s['calls'] * 1e3:.1f} "
              f"| {s['compute_ms']:.2f} | {rest:.1f} | {s['load_ms'] + s.get('land_ms', 0):.1f} "
              f"| {med * 1e3:.0f} |")
    print("\n## Paired differences of mean KL (A - B; 90% bootstrap CI over requests)\n")
    print("| A | B | KL A - KL B | 90% CI | requests where A < B |")
    print("| --- | --- | --- | --- | --- |")
    names = dict(modes)
    pairs = []
    for r in args.ratios:
        pairs += [(f"CacheBlend V r={r:g}", f"CacheBlend K r={r:g}"),
                  (f"CacheBlend V r={r:g}", f"EPIC r={r:g}")]
    pairs += [(n, f"CacheBlend V r={s['ratio']:g}") for n, s in modes if n.startswith("gradual")]
    rng = np.random.default_rng(0)
    for a, b in pairs:
        if a not in names or b not in names:
            continue
        d = np.array([r["modes"][a]["kl"] - r["modes"][b]["kl"] for r in records])
        boot = d[rng.integers(0, len(d), (2000, len(d)))].mean(1)
        lo, hi = np.percentile(boot, [5, 95])
        print(f"| {a} | {b} | {d.mean():+.4f} | {lo:+.4f} .. {hi:+.4f} | {(d < 0).mean():.0%} |")
    sp = np.mean([r["sparsity"] for r in records], axis=0)
    print(f"\n## Attention sparsity (full prefill): mass on the top {SPARSITY_TOP:.0%} of keys, "
          "per layer\n")
    print(" ".join(f"L{l}:{x:.2f}" for l, x in enumerate(sp)))
    print(f"mean over layers {sp.mean():.3f}, layers 0-1 {sp[:2].mean():.3f}, "
          f"2-29 {sp[2:].mean():.3f}")
    N = [r["N"] for r in records]
    A = [r["A"] for r in records]
    print(f"\nrequests: {n}; prompt tokens {np.mean(N):.0f} mean ({min(N)}-{max(N)}); "
          f"chunks {np.mean([len(r['lengths']) for r in records]):.1f} mean; "
          f"cached share {np.mean([r['n_cached'] / r['N'] for r in records]):.1%}; "
          f"answer tokens {np.mean(A):.1f} mean")
    for name in [m for m, s in modes if s["kind"] == "fuse"]:
        print(f"{name}: chunk-first tokens selected {summary[name]['first_selected']:.0%}")
    kr = [r["modes"]["full reuse"]["kl"] / max(r["modes"][m]["kl"], 1e-12)
          for r in records for m in [f"CacheBlend V r={args.ratios[len(args.ratios) // 2]:g}"]]
    print(f"per-request KL(reuse)/KL(CacheBlend V r={args.ratios[len(args.ratios) // 2]:g}): "
          f"median {np.median(kr):.2f}x, range {min(kr):.2f}x-{max(kr):.2f}x")
    mid = f"CacheBlend V r={args.ratios[len(args.ratios) // 2]:g}"
    groups = [(f"{a}-{b} chunks", lambda r, a=a, b=b: a <= len(r["lengths"]) <= b)
              for a, b in ((3, 4), (5, 6), (7, 8))]
    groups += [(f"question \"{q[:28]}...\"", lambda r, q=q: r["question"].startswith(q[:12]))
               for q in QUESTIONS]
    groups += [("first chunk from a license", lambda r: r["docs"][0].startswith("license:")),
               ("first chunk from pydoc", lambda r: r["docs"][0].startswith("pydoc:"))]
    print(f"\n## KL(full reuse) / KL({mid}) by kind of request\n")
    print("| requests | n | KL reuse | KL CacheBlend | ratio of means |")
    print("| --- | --- | --- | --- | --- |")
    for label, keep in groups:
        sub = [r for r in records if keep(r)]
        if sub:
            a = np.mean([r["modes"]["full reuse"]["kl"] for r in sub])
            b = np.mean([r["modes"][mid]["kl"] for r in sub])
            print(f"| {label} | {len(sub)} | {a:.4f} | {b:.4f} | {a / b:.2f}x |")


def median_ttft(records, name):
    return float(np.median([r["modes"][name]["total"] for r in records]))


def plot(summary, modes, records, path, note=""):
    """Quality and TTFT against r, KL against TTFT, attention sparsity per layer (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(16, 8.5))
    series = [("CacheBlend V", "C0", "o"), ("CacheBlend K", "C1", "s"), ("EPIC", "C2", "^")]
    for prefix, color, marker in series:
        names = [n for n, s in modes if n.startswith(prefix + " r=")]
        rs = [0.0] + [dict(modes)[n]["ratio"] for n in names]
        names = ["full reuse"] + names
        style = dict(marker=marker, color=color, label=prefix)
        for a, key in ((ax[0, 0], "kl"), (ax[0, 1], "top1"), (ax[0, 2], "prefix")):
            a.plot(rs, [summary[n][key] for n in names], **style)
        ax[1, 0].plot(rs, [median_ttft(records, n) for n in names], **style)
        ax[1, 1].plot([median_ttft(records, n) for n in names], [summary[n]["kl"] for n in names],
                      **style)
        if prefix == "CacheBlend V":
            for key, ls, what in (("node", ":", "node compute"), ("calls", "--", "in client calls")):
                ax[1, 0].plot(rs, [np.median([r["modes"][n][key] for r in records]) for n in names],
                              ls=ls, color=color, label=f"{prefix}: {what}")
    for n, s in modes:
        if n.startswith("gradual"):
            star = dict(marker="*", color="k", ms=12, ls="", label=n)
            for a, key in ((ax[0, 0], "kl"), (ax[0, 1], "top1"), (ax[0, 2], "prefix")):
                a.plot([s["ratio"]], [summary[n][key]], **star)
            ax[1, 0].plot([s["ratio"]], [median_ttft(records, n)], **star)
            ax[1, 1].plot([median_ttft(records, n)], [summary[n]["kl"]], **star)
    full = median_ttft(records, "full prefill")
    ax[1, 0].axhline(full, color="k", ls="-.", label="full prefill")
    ax[1, 1].axvline(full, color="k", ls="-.", label="full prefill (KL 0)")
    ax[0, 0].set(yscale="log", xlabel="recompute ratio r (0 = full reuse)",
                 ylabel="mean KL to full prefill (nats)", title="KL divergence, answer positions")
    ax[0, 1].set(xlabel="recompute ratio r", ylabel="share of answer positions",
                 title="top-1 agreement with full prefill")
    ax[0, 2].set(xlabel="recompute ratio r", ylabel="mean share before the first divergence",
                 title="greedy continuation equal to full prefill's")
    ax[1, 0].set(xlabel="recompute ratio r", ylabel="seconds (median over requests)",
                 title="time to first token (NumPy node on this CPU)", ylim=(0, None))
    ax[1, 1].set(yscale="log", xlabel="median TTFT (s)", ylabel="mean KL (nats)", xlim=(0, None),
                 title="quality against time to first token")
    sp = np.mean([r["sparsity"] for r in records], axis=0)
    ax[1, 2].bar(np.arange(len(sp)), sp, color="C7")
    ax[1, 2].set(xlabel="layer", ylabel=f"attention mass on top {SPARSITY_TOP:.0%} of keys",
                 title="attention sparsity (full prefill)", ylim=(0, 1))
    for a in ax.flat[:5]:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct through kvblendd: {len(records)} RAG requests "
                 f"(mean {np.mean([r['N'] for r in records]):.0f} prompt tokens){note}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def codec_baseline(codecs):
    """The codec the others are compared with: f16 when run, else the first."""
    return "f16" if "f16" in codecs else codecs[0]


def summarize_codecs(records, modes, codecs, storage):
    """Per codec: what the daemon stores (bytes per token = stored bytes / tokens over the
    model's chunks, from its chunk list) and, per mode, means over requests, the ratio of
    mean KL to the baseline codec's (with a 90% bootstrap interval over requests), and the
    daemon's load + land + compute time per session (median)."""
    base = codec_baseline(codecs)
    out = {}
    for c in codecs:
        name, dtype, store = codec_model(c)
        st = storage[c]
        e = dict(model=name, dtype=dtype, store=store, **st,
                 bytes_per_token=st["stored_bytes"] / st["tokens"], modes={})
        for m, spec in modes:
            rs = [r["codecs"][c][m] for r in records]
            e["modes"][m] = {k: float(np.mean([x[k] for x in rs])) for k in rs[0]}
            a = [x["kl"] for x in rs]
            b = [r["codecs"][base][m]["kl"] for r in records]
            lo, hi = bootstrap(a, b)
            e["modes"][m].update(ratio=spec["ratio"], kl_vs_base=float(np.mean(a) / np.mean(b)),
                                 kl_vs_base_ci=[float(lo), float(hi)],
                                 ttft_median=float(np.median([x["total"] for x in rs])),
                                 daemon_ms_median=float(np.median(
                                     [x["load_ms"] + x["land_ms"] + x["compute_ms"] for x in rs])))
        out[c] = e
    return {"baseline": base, "codecs": out}


def print_codec_tables(csum, records, modes):
    base = csum["baseline"]
    codecs = csum["codecs"]
    bpt = codecs[base]["bytes_per_token"]
    ref = next((c for c in ("f32", "f16") if c in codecs), None)
    N = [r["N"] for r in records]
    print(f"\n## Store codecs: {len(records)} requests (prompt tokens {np.mean(N):.0f} mean, "
          f"cached share {np.mean([r['n_cached'] / r['N'] for r in records]):.1%}); mean KL to "
          "full prefill in nats over the answer positions, top-1 agreement\n")
    head = "| codec | stored as | bytes / token | bytes vs " + base
    sep = "| --- | --- | --- | ---"
    for m, _ in modes:
        head += f" | KL {m} | top-1 | KL / KL at {base} (90% CI)"
        sep += " | --- | --- | ---"
    print(head + " |")
    print(sep + " |")
    for c, e in codecs.items():
        line = (f"| {c} | {e['dtype']}, {e['store']} | {e['bytes_per_token']:.0f} "
                f"| {e['bytes_per_token'] / bpt:.3f}")
        for m, _ in modes:
            x = e["modes"][m]
            lo, hi = x["kl_vs_base_ci"]
            line += (f" | {x['kl']:.4f} | {x['top1']:.1%} "
                     f"| {x['kl_vs_base']:.3f} ({lo:.3f}-{hi:.3f})")
        print(line + " |")
    if ref:
        print(f"\n## The codec's own error: KL({ref} stored, same mode || codec), mean over "
              "answer positions and requests; top-1 against the same mode on the "
              f"{ref} store; the daemon's load + land + compute per session (median)\n")
        head, sep = "| codec", "| ---"
        for m, spec in modes:
            head += f" | {m}: KL to {ref} | top-1 to {ref}"
            sep += " | --- | ---"
            if spec["kind"] == "fuse":
                head += " | daemon ms"
                sep += " | ---"
        print(head + " |")
        print(sep + " |")
        for c, e in codecs.items():
            line = f"| {c}"
            for m, spec in modes:
                x = e["modes"][m]
                line += f" | {x['kl_lossless']:.2e} | {x['top1_lossless']:.1%}"
                if spec["kind"] == "fuse":
                    line += f" | {x['daemon_ms_median']:.1f}"
            print(line + " |")
    print()
    for c, e in codecs.items():
        print(f"{c}: model {e['model']} ({e['dtype']}, store {e['store']}): {e['chunks']} chunks, "
              f"{e['tokens']} tokens, {e['stored_bytes']} bytes stored "
              f"({e['raw_bytes']} in {e['dtype']})")


def plot_codecs(csum, modes, records, path):
    """Against stored bytes per token, one line per mode: mean KL to full prefill (log), top-1
    agreement, and the codec's own error (KL to the same mode on lossless f32 storage; PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = sorted(csum["codecs"].items(), key=lambda ce: ce[1]["bytes_per_token"])
    x = [e["bytes_per_token"] for _, e in codecs]
    own = "kl_lossless" in codecs[0][1]["modes"][modes[0][0]]
    fig, ax = plt.subplots(1, 3 if own else 2, figsize=(18 if own else 12, 5.5))
    panels = [(ax[0], "kl"), (ax[1], "top1")] + ([(ax[2], "kl_lossless")] if own else [])
    for (m, _), (color, marker) in zip(modes, [("C3", "s"), ("C0", "o"), ("C1", "^"),
                                               ("C2", "v")]):
        for a, key in panels:
            # the lossless reference has no error of its own: left out of that panel
            pts = [(c, xi, e["modes"][m][key]) for (c, e), xi in zip(codecs, x)
                   if key != "kl_lossless" or e["modes"][m][key] > 0]
            a.plot([p[1] for p in pts], [p[2] for p in pts], marker=marker, color=color,
                   label=m)
            if key == "top1" or m != modes[-1][0]:
                continue  # one set of labels per panel, on the last mode's line
            offsets = [(-4, 22), (-34, -26), (10, 16), (12, 14), (12, -20), (0, 16), (-16, 16)]
            for i, (c, xi, yi) in enumerate(pts):
                a.annotate(c, (xi, yi), textcoords="offset points", fontsize=8,
                           xytext=offsets[i % len(offsets)],
                           arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5"))
    ax[0].set(yscale="log", ylabel="mean KL to full prefill (nats)",
              title="quality: KL divergence to full prefill, answer positions")
    ax[1].set(ylabel="share of answer positions", title="top-1 agreement with full prefill")
    if own:
        ax[2].set(yscale="log", ylabel="mean KL (nats)",
                  title="the codec's own error: KL to the same mode, lossless")
    for a, key in panels:
        a.set(xscale="log", xlabel="bytes per token stored (daemon's chunk list)")
        if key != "top1":  # room for the labels above the highest point
            a.set_ylim(top=a.get_ylim()[1] * 2)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct through kvblendd, store codecs: {len(records)} RAG "
                 f"requests (mean {np.mean([r['N'] for r in records]):.0f} prompt tokens), "
                 "landing fuse sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


# --- 5. The run -----------------------------------------------------------------

def parse_gradual(s):
    if not s:
        return None
    layers, ratios = s.split(":")
    return (tuple(int(x) for x in layers.split(",")), tuple(float(x) for x in ratios.split(",")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", help="build directory with bin/kvblendd and lib/libkvblend.so "
                    "(default $KVBLEND_BUILD, else build/)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--ratios", help="comma-separated r (default 0.05,0.15,0.3; with "
                    "--codecs 0.15)")
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--gradual", default="1,2:0.3,0.15",
                    help="two check layers and ratios, LAYERS:RATIOS ('' for none)")
    ap.add_argument("--codecs", help="comma-separated store codecs, each a model of its own "
                    "(f32, f16, fp8, int8, int4, int4:G): full reuse and CacheBlend V per codec "
                    "against the same full prefill, plot docs/eval_codecs.png")
    ap.add_argument("--smoke", action="store_true",
                    help="2 requests of 3 short chunks, 4 answer tokens, no plot")
    ap.add_argument("--plot", help="PNG to write (default docs/eval_quality.png, with --codecs "
                    "docs/eval_codecs.png; none in smoke)")
    ap.add_argument("--json", help="write every per-request figure here")
    ap.add_argument("--fuse", choices=("landing", "classic"), default="landing",
                    help="landing sessions (the daemon writes into the node's KV buffer; "
                    "default) or classic layer calls")
    ap.add_argument("--from-json", help="print the tables and draw the plot from a --json file "
                    "of an earlier run (its modes and ratios), running nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for key in ("ratios", "check_layer", "gradual", "codecs"):
            setattr(args, key, saved["args"].get(key))
        if args.codecs:
            modes = codec_modes(args.ratios, args.check_layer)
            csum = summarize_codecs(saved["records"], modes, args.codecs, saved["storage"])
            print_codec_tables(csum, saved["records"], modes)
            if args.plot:
                plot_codecs(csum, modes, saved["records"], args.plot)
            return csum, saved["records"]
        modes = make_modes(args.ratios, args.check_layer, parse_gradual(args.gradual))
        summary = summarize(saved["records"], modes)
        print_tables(summary, saved["records"], modes, args)
        if args.plot:
            plot(summary, modes, saved["records"], args.plot,
                 f", {saved['args'].get('fuse', 'classic')} fuse sessions")
        return summary, saved["records"]
    if args.codecs:
        args.codecs = args.codecs.split(",")
        [codec_model(c) for c in args.codecs]  # refuse an unknown codec before any work
    codecs = args.codecs or ["f32"]
    # the lossless reference for the codec's own error runs first
    ref = next((c for c in ("f32", "f16") if c in codecs), None) if args.codecs else None
    order = ([ref] if ref else []) + [c for c in codecs if c != ref]
    args.ratios = [float(r) for r in (args.ratios or ("0.15" if args.codecs else
                                                      "0.05,0.15,0.3")).split(",")]
    shape = SHAPES["smoke" if args.smoke else "full"]
    if args.smoke and "--requests" not in (argv if argv is not None else sys.argv):
        args.requests = 2
    default_plot = "eval_codecs.png" if args.codecs else "eval_quality.png"
    plot_path = args.plot or (None if args.smoke else str(node.ROOT / "docs" / default_plot))
    modes = (codec_modes(args.ratios, args.check_layer) if args.codecs else
             make_modes(args.ratios, args.check_layer, parse_gradual(args.gradual)))
    mid = f"r={args.ratios[len(args.ratios) // 2]:g}"

    t_start = time.time()
    model = Model.load()
    tok = SmolTokenizer(model.reader)
    docs = load_documents(tok)
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; "
          f"fuse path: {args.fuse}" + (f"; codecs {','.join(codecs)}" if args.codecs else ""))
    print(f"model loaded in {time.time() - t_start:.1f}s; {len(docs)} documents: "
          f"{sum(d.startswith('license:') for d in docs)} licenses, "
          f"{sum(d.startswith('pydoc:') for d in docs)} pydoc topics")

    records = []
    with node.Daemon(args.build) as daemon, daemon.client() as client:
        print(f"kvblendd {daemon.version} at {daemon.endpoint}")
        stores, fuses, pool = {}, {}, {}
        for c in codecs:
            name, dtype, store_codec = codec_model(c)
            stores[c] = node.ChunkStore(client, model, name, dtype, store_codec)
            # the engine's way by default: fused layers land in the node's own KV buffer
            fuses[c] = (node.LandingFuse(client, name, dtype, pool) if args.fuse == "landing"
                        else node.DaemonFuse(client, name, dtype))
        for k in range(args.requests):
            segments, info = build_request(k, args.seed, docs, tok, shape)
            # each chunk prefilled once, PUT into every codec's model
            hashes = [node.ensure_chunk([stores[c] for c in codecs], s)
                      for kind, s in segments if kind == "chunk"]
            req = Request(segments, None, model.cfg)
            P = req.N
            probe = np.unique(np.append(np.arange(min(127, P - 1), P, 16), P - 1))

            # The reference: full prefill, its greedy answer, its logits on the answer.
            last, kv_full, t_full, sparsity = full_prefill(model, req.ids, probe)
            answer = greedy(model, kv_full, last, shape["answer"], (tok.eos,))
            ref_logits = answer_logits(model, kv_full, last, answer)
            rec = {"k": k, "N": P, "A": len(answer), "n_cached": int(req.cached.sum()),
                   **info, "answer": tok.decode(answer), "sparsity": sparsity.tolist(),
                   "modes": {"full prefill": dict(
                       kl=0.0, kl_first=0.0, top1=1.0, prefix=1.0, exact=1.0, recomputed=1.0,
                       total=t_full, node=t_full, calls=0.0, compute_ms=0.0, load_ms=0.0,
                       land_ms=0.0, first_selected=1.0)}}
            del kv_full
            chunk_starts = np.array([s for kind, s, _ in req.spans if kind == "chunk"])
            lossless = {}
            for c in order:
                out = rec.setdefault("codecs", {}).setdefault(c, {}) if args.codecs else \
                    rec["modes"]
                for name, spec in modes:
                    last_m, kv_m, S, t = run_mode(model, stores[c], fuses[c], req, hashes, spec)
                    logits = answer_logits(model, kv_m, last_m, answer)
                    del kv_m
                    kl, top1 = kl_top1(ref_logits, logits)
                    same = logits.argmax(-1) == answer
                    prefix = len(answer) if same.all() else int(np.argmin(same))
                    out[name] = dict(
                        kl=float(kl.mean()), kl_first=float(kl[0]), top1=float(top1.mean()),
                        prefix=prefix / len(answer), exact=float(prefix == len(answer)),
                        recomputed=float(req.cached[S].sum() / rec["n_cached"]),
                        first_selected=float(np.isin(chunk_starts, S).mean()),
                        total=t["total"], node=t["node"], calls=t["calls"],
                        compute_ms=t["stats"].get("compute_ms", 0.0),
                        load_ms=t["stats"].get("load_ms", 0.0),
                        land_ms=t["stats"].get("land_ms", 0.0))
                    if ref:  # the codec's own error: against the same mode on the reference
                        lossless.setdefault(name, logits)
                        kl_l, top1_l = kl_top1(lossless[name], logits)
                        out[name].update(kl_lossless=float(kl_l.mean()),
                                         top1_lossless=float(top1_l.mean()))
            records.append(rec)
            if args.codecs:
                print(f"req {k:2d} N={P:4d} chunks={len(info['lengths'])} A={len(answer):2d} "
                      f"KL reuse/V {mid}: " + " ".join(
                          f"{c} {rec['codecs'][c]['full reuse']['kl']:.4f}/"
                          f"{rec['codecs'][c]['CacheBlend V ' + mid]['kl']:.4f}"
                          for c in codecs), flush=True)
                continue
            m = rec["modes"]
            print(f"req {k:2d} N={P:4d} chunks={len(info['lengths'])} A={len(answer):2d} "
                  f"KL reuse {m['full reuse']['kl']:.4f} V {m['CacheBlend V ' + mid]['kl']:.4f} "
                  f"K {m['CacheBlend K ' + mid]['kl']:.4f} EPIC {m['EPIC ' + mid]['kl']:.4f} | "
                  f"TTFT full {t_full:.2f}s V {m['CacheBlend V ' + mid]['total']:.2f}s | "
                  f"{info['question'][:40]!r} -> {rec['answer'][:40]!r}", flush=True)
        storage = {}
        for c in codecs:
            tokens, raw, stored = stores[c].stored()
            storage[c] = dict(chunks=len(client.list(stores[c].name)), tokens=tokens,
                              raw_bytes=raw, stored_bytes=stored)
        print(f"chunks: {storage[codecs[0]]['chunks']} stored per model, prefilled in "
              f"{sum(x.seconds_prefill for x in stores.values()):.1f}s, PUT in "
              f"{sum(x.seconds_put for x in stores.values()):.2f}s "
              f"({len(codecs)} model{'s' if len(codecs) > 1 else ''})")
    rc = daemon.proc.returncode
    print(f"kvblendd exited with {rc}; {len(daemon.problems)} warning or error lines in its log"
          + "".join(f"\n  {line}" for line in daemon.problems[:10]))
    if rc != 0:
        raise SystemExit(f"kvblendd exited with {rc}")

    if args.codecs:
        summary = summarize_codecs(records, modes, codecs, storage)
        print_codec_tables(summary, records, modes)
    else:
        summary = summarize(records, modes)
        print_tables(summary, records, modes, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                               "storage": storage, "records": records},
                                              indent=1))
        print(f"figures: {args.json}")
    if plot_path:
        if args.codecs:
            plot_codecs(summary, modes, records, plot_path)
        else:
            plot(summary, modes, records, plot_path, f", {args.fuse} fuse sessions")
    print(f"total {time.time() - t_start:.0f}s")
    return summary, records


if __name__ == "__main__":
    main()
