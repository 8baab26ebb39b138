"""Question-aware selection (issue 24) against HKVD at an equal recompute budget.

Reads top to bottom: load the model, build docs/EVAL.md's requests (the same seed and
shapes as run_eval.py; or the same chunks with the paraphrased questions of
eval/paraphrased_questions.json), start a kvblendd of this build, and per request and
r run HKVD with the value and the key metric (check layer 1), the attention rule
(preview, attention metric, cheap check) and A alone (no check layer) at HKVD's budget
at r, each against the full prefill; print the table and the per-request wins, draw
the plot. The budget and the rules are eval/qsel.py's.

Issue 35 adds the published field at the same budget (eval/rules.py, eval/RULES.md):
ProphetKV-, InfoFlow- and QCFuse-style previews, EPIC's chunk starts and the oracle
deviation (a ceiling); --rules picks which rules run (HKVD V always: it is the baseline
of the paired intervals, which are also given against the best rule other than the
oracle). "question" and "anchored" are A alone and QCFuse-style as the vLLM connector's
and kvblend.hf's metrics of those names run them: r of the chunk tokens recomputed (not
HKVD's budget at r, so less compute).
--profile-critical N prints, per layer, how much of the all-layer selection (A's
top r n) and of the oracle's the question's attention on that layer finds (N requests
drawn outside the evaluated ones): the profiling behind QCFuse's critical layer.

    eval/run --build DIR --qsel [--requests 50] [--questions paraphrased]
    python eval/run_qsel.py --build DIR [--requests N] [--ratios 0.05,0.15,0.3]
        [--rules "HKVD V,attention,A alone,ProphetKV,InfoFlow,QCFuse,EPIC,oracle"]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import node  # noqa: E402
import qsel  # noqa: E402
import rules as pub  # noqa: E402
from cacheblend import Request, kl_top1, select_count  # noqa: E402
from model import Model  # noqa: E402
from run_eval import (SHAPES, answer_logits, build_request, full_prefill, greedy,  # noqa: E402
                      load_documents, paired_interval)
from tokenizer import SmolTokenizer  # noqa: E402

RULES = ("HKVD V", "HKVD K", "attention", "A alone", "question") + pub.NEW_RULES
RULES += pub.LITERAL_RULES
DEFAULT_RULES = ("HKVD V", "HKVD K", "attention", "A alone")
PROFILE_FIRST = 1000  # --profile-critical draws requests 1000.., never evaluated
PARAPHRASED = HERE / "paraphrased_questions.json"


def paraphrased_request(k, seed, docs, tok, shape, questions):
    """docs/EVAL.md's request k (same chunks, same documents), its question replaced by a
    paraphrased one about the document it names (drawn with default_rng([seed, k, 1]))."""
    segments, info = build_request(k, seed, docs, tok, shape)
    n = len(info["docs"])
    rng = np.random.default_rng([seed, k, 1])
    i = int(rng.integers(1, n + 1))
    pool = questions[info["docs"][i - 1]]
    question = f"In document {i}: {pool[int(rng.integers(len(pool)))]}"
    end = f"\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"
    segments[-1] = ("fresh", tok.encode(end))
    return segments, dict(info, question=question)


def run_rule(rule, r, model, store, fuse, req, hashes, rows, previews=None, oracle=None):
    """(logits at rows, fused KV, selection, timing, budget used) of one rule at r."""
    if rule in pub.NEW_RULES + pub.LITERAL_RULES:
        return pub.run_new_rule(rule, r, model, fuse, req, hashes, rows, previews, oracle)
    b = qsel.Budget(model.cfg, int(req.cached.sum()), len(qsel.question_rows(req)))
    if rule in ("HKVD V", "HKVD K"):
        metric = "value" if rule == "HKVD V" else "key"
        out = node.fuse_forward(model, req, hashes, fuse, (1,), (r,), metric, rows)
        return (*out, b.hkvd(select_count(r, b.n)))
    if rule == "attention":
        return qsel.forward_attention(model, store, fuse, req, hashes, rows, r)
    # "question": A alone as the connector's question metric runs it, r chunk tokens
    return qsel.forward_alone(model, store, fuse, req, hashes, rows, r, rule == "question")


def rules_in(records, ratios):
    """The rules every record has at every r, in RULES' order."""
    return [rule for rule in RULES
            if all(f"{rule} r={r:g}" in rec["modes"] for rec in records for r in ratios)]


def paired(records, a, b, r, rng):
    """Mean of KL a - KL b over the requests, its paired 90% bootstrap interval (2000
    resamples of the requests) and the share of requests where a is below b."""
    d = np.array([rec["modes"][f"{a} r={r:g}"]["kl"] - rec["modes"][f"{b} r={r:g}"]["kl"]
                  for rec in records])
    return (*paired_interval(d, rng), (d < 0).mean())


def table(records, ratios):
    """The equal-budget table and the paired comparisons, as markdown."""
    present = rules_in(records, ratios)
    has_k = "HKVD K" in present
    lines = [("| r | rule | budget used | mean KL | KL 1st token | top-1 | greedy prefix | "
              "greedy exact | KL lower than HKVD V on | than HKVD K on | tokens kept | preview s | "
              "total s |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ratios:
        for rule in present:
            m = [rec["modes"][f"{rule} r={r:g}"] for rec in records]
            v = [rec["modes"][f"HKVD V r={r:g}"]["kl"] for rec in records]
            kl = np.array([x["kl"] for x in m])
            wins_v = "-" if rule == "HKVD V" else f"{(kl < np.array(v)).sum()}/{len(kl)}"
            wins_k = "n/a"
            if has_k:
                kk = [rec["modes"][f"HKVD K r={r:g}"]["kl"] for rec in records]
                wins_k = "-" if rule == "HKVD K" else f"{(kl < np.array(kk)).sum()}/{len(kl)}"
            lines.append(
                f"| {r:g} | {rule} | {np.mean([x['budget'] for x in m]):.3f} | {kl.mean():.4f} "
                f"| {np.mean([x['kl_first'] for x in m]):.4f} "
                f"| {np.mean([x['top1'] for x in m]):.1%} "
                f"| {np.mean([x['prefix'] for x in m]):.1%} "
                f"| {np.mean([x['exact'] for x in m]):.0%} | {wins_v} | {wins_k} "
                f"| {np.mean([x['recomputed'] for x in m]):.1%} "
                f"| {np.mean([x.get('preview', 0.0) for x in m]):.2f} "
                f"| {np.mean([x['total'] for x in m]):.2f} |")
    lines += ["", "| r | A | B | KL A - KL B | 90% CI | requests where A < B |",
              "| --- | --- | --- | --- | --- | --- |"]
    rng = np.random.default_rng(0)
    for r in ratios:
        pairs = [(a, b) for a, b in (("attention", "HKVD V"), ("attention", "HKVD K"),
                                     ("A alone", "HKVD V"), ("attention", "A alone"),
                                     ("question", "HKVD V"), ("question", "A alone"),
                                     ("anchored", "HKVD V"), ("anchored", "QCFuse"))
                 if a in present and b in present]
        pairs += [(a, "HKVD V") for a in present if a in pub.NEW_RULES]
        if any(a in pub.NEW_RULES for a in present):  # and against the best runnable rule
            runnable = [a for a in present if a != "oracle"]
            best = min(runnable, key=lambda a: np.mean(
                [rec["modes"][f"{a} r={r:g}"]["kl"] for rec in records]))
            pairs += [(a, best) for a in runnable if a != best and (a, best) not in pairs]
        for a, b in pairs:
            mean, lo, hi, share = paired(records, a, b, r, rng)
            lines.append(f"| {r:g} | {a} | {b} | {mean:+.4f} | {lo:+.4f} .. {hi:+.4f} "
                         f"| {share:.0%} |")
    reuse = np.mean([rec["modes"]["full reuse"]["kl"] for rec in records])
    lines.append(f"\nfull reuse: mean KL {reuse:.4f}; {len(records)} requests")
    return "\n".join(lines)


def plot(records, ratios, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = ("o-", "s-", "^-", "v--", "<-", ">-", ">:", "D-", "x--", "*:")
    for rule, style in zip(rules_in(records, ratios), styles):
        xs = [np.mean([rec["modes"][f"{rule} r={r:g}"]["budget"] for rec in records])
              for r in ratios]
        ys = [np.mean([rec["modes"][f"{rule} r={r:g}"]["kl"] for rec in records])
              for r in ratios]
        ax.plot(xs, ys, style, label=rule)
    ax.set_xlabel("recompute budget used (token-layers per chunk token / layers)")
    ax.set_ylabel("mean KL to full prefill (nats)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def load_request(k, args, model, tok, docs, paraphrased, shape, store):
    """Request k (paraphrased when given) with its chunks stored: segments, info, hashes, req."""
    if paraphrased:
        segments, info = paraphrased_request(k, args.seed, docs, tok, shape, paraphrased)
    else:
        segments, info = build_request(k, args.seed, docs, tok, shape)
    hashes = [store.ensure(s) for kind, s in segments if kind == "chunk"]
    return segments, info, hashes, Request(segments, None, model.cfg)


def profile_critical(args, model, tok, docs, paraphrased, shape, ratios):
    """QCFuse's critical-layer profiling: on N requests outside the evaluated ones (k =
    1000..), per layer l, the share of a target's top k (k = floor(r n), r the middle ratio)
    that the top k of the question's attention on layer l holds, the question reading only
    the anchors before l ("anchored", QCFuse's compressed preview) or every chunk token
    ("full view"). Targets: the all-layer, full-view selection (the top of A, which the
    compressed view stands in for: the layer is chosen on this one) and the oracle's.
    Prints the table; returns the shares [requests, target, view, layer]."""
    r = ratios[len(ratios) // 2]
    L = model.cfg.n_layers
    shares, a_oracle = [], []
    with node.Daemon(args.build) as daemon, daemon.client() as client:
        store = node.ChunkStore(client, model)
        for k in range(PROFILE_FIRST, PROFILE_FIRST + args.profile_critical):
            _, _, hashes, req = load_request(
                k, args, model, tok, docs, paraphrased, shape, store
            )
            _, kv_full, _, _ = full_prefill(model, req.ids, np.array([req.N - 1]))
            placed, _ = store.placed(req, hashes)
            cached = np.flatnonzero(req.cached)
            n = len(cached)
            kk = select_count(r, n)
            oracle = pub.oracle_score(kv_full, placed, cached)
            del kv_full
            att, _ = qsel.question_pass(model, req, placed)
            targets = [set(pub.top_tokens(att[qsel.PREVIEW_FROM:].sum((0, 2)), req, kk)),
                       set(pub.top_tokens(oracle, req, kk))]
            a_oracle.append(len(targets[0] & targets[1]) / kk)
            x = np.zeros((2, 2, L))
            for l in range(L):
                att_a, _ = qsel.question_pass(model, req, placed, view=pub.anchors(req),
                                             last_layer=l)
                for v, a in enumerate((att_a, att)):
                    got = set(pub.top_tokens(a[l].sum(1), req, kk))
                    for t, want in enumerate(targets):
                        x[t, v, l] = len(want & got) / kk
            shares.append(x)
            print(f"profile req {k} N={req.N} n={n} k={kk}: anchored best layer "
                  f"{int(np.argmax(x[0, 0]))} ({x[0, 0].max():.2f} of A's top k, "
                  f"{x[1, 0, int(np.argmax(x[0, 0]))]:.2f} of the oracle's)", flush=True)
    m = np.mean(shares, axis=0)
    print("\n| layer | of A's top k: anchored | full view | of the oracle's: anchored | "
          "full view |\n| --- | --- | --- | --- | --- |")
    for l in range(L):
        print(f"| {l} | {m[0, 0, l]:.3f} | {m[0, 1, l]:.3f} | {m[1, 0, l]:.3f} "
              f"| {m[1, 1, l]:.3f} |")
    print(f"anchored: best layer {int(np.argmax(m[0, 0]))} (of A's top k) over "
          f"{len(shares)} requests at r = {r:g}; A's top k holds {np.mean(a_oracle):.3f} of "
          f"the oracle's")
    return np.array(shares)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--first", type=int, default=0, help="first request index")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--ratios", default="0.05,0.15,0.3")
    ap.add_argument("--questions", choices=("eval", "paraphrased"), default="eval")
    ap.add_argument("--fuse", choices=("landing", "classic"), default="landing")
    ap.add_argument("--json", help="write every per-request figure here")
    ap.add_argument("--from-json", nargs="+", help="tables (and --plot) from earlier --json "
                    "files, their records together, one per request (a request in several "
                    "files: the last file's record)")
    ap.add_argument("--plot", help="PNG to write")
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES),
                    help=f"comma-separated, of: {', '.join(RULES)} (HKVD V always runs)")
    ap.add_argument("--critical-layer", type=int, default=pub.CRITICAL_LAYER,
                    help="QCFuse's critical layer")
    ap.add_argument("--profile-critical", type=int, metavar="N",
                    help="print the per-layer overlap with the oracle on N requests, no run")
    args = ap.parse_args(argv)
    ratios = [float(x) for x in args.ratios.split(",")]
    chosen = [x.strip() for x in args.rules.split(",") if x.strip()]
    bad = [x for x in chosen if x not in RULES]
    if bad:
        ap.error(f"--rules: unknown {bad}; known: {', '.join(RULES)}")
    chosen = [rule for rule in RULES if rule in chosen or rule == "HKVD V"]
    if args.from_json:
        by_k = {}
        for p in args.from_json:
            for rec in json.loads(Path(p).read_text())["records"]:
                by_k[rec["k"]] = rec
        records = [by_k[k] for k in sorted(by_k)]
        print(table(records, ratios))
        if args.plot:
            plot(records, ratios, args.plot, f"{len(records)} requests")
        return records

    t_start = time.time()
    model = Model.load()
    tok = SmolTokenizer(model.reader)
    docs = load_documents(tok)
    paraphrased = json.loads(PARAPHRASED.read_text()) if args.questions == "paraphrased" else None
    shape = SHAPES["full"]
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; fuse "
          f"{args.fuse}; questions {args.questions}; f_qkv {qsel.f_qkv(model.cfg):.3f}; "
          f"rules {', '.join(chosen)}; critical layer {args.critical_layer}")
    if args.profile_critical:
        return profile_critical(args, model, tok, docs, paraphrased, shape, ratios)
    records = []
    with node.Daemon(args.build) as daemon, daemon.client() as client:
        store = node.ChunkStore(client, model)
        fuse = (node.LandingFuse(client) if args.fuse == "landing" else node.DaemonFuse(client))
        for k in range(args.first, args.first + args.requests):
            segments, info, hashes, req = load_request(
                k, args, model, tok, docs, paraphrased, shape, store
            )
            probe = np.array([req.N - 1])
            last, kv_full, _, _ = full_prefill(model, req.ids, probe)
            answer = greedy(model, kv_full, last, shape["answer"], (tok.eos,))
            ref = answer_logits(model, kv_full, last, answer)
            oracle = None
            if "oracle" in chosen:
                placed, _ = store.placed(req, hashes)
                oracle = pub.oracle_score(kv_full, placed, np.flatnonzero(req.cached))
                del placed
            del kv_full
            previews = pub.Previews(model, store, req, hashes, args.critical_layer)
            rec = {"k": k, "N": req.N, "A": len(answer), "n_cached": int(req.cached.sum()),
                   "q": len(qsel.question_rows(req)), **info, "answer": tok.decode(answer),
                   "modes": {}}
            rows = np.array([req.N - 1])
            runs = [("full reuse", None)] + [(f"{rule} r={r:g}", (rule, r))
                                             for r in ratios for rule in chosen]
            for name, what in runs:
                if what is None:
                    out = node.static_forward(model, store, req, hashes, rows)
                    out = (*out, 0.0)
                else:
                    out = run_rule(what[0], what[1], model, store, fuse, req, hashes, rows,
                                   previews, oracle)
                last_m, kv_m, S, t, budget = out
                logits = answer_logits(model, kv_m, last_m, answer)
                del kv_m
                kl, top1 = kl_top1(ref, logits)
                same = logits.argmax(-1) == answer
                prefix = len(answer) if same.all() else int(np.argmin(same))
                rec["modes"][name] = dict(
                    kl=float(kl.mean()), kl_first=float(kl[0]), top1=float(top1.mean()),
                    prefix=prefix / len(answer), exact=float(prefix == len(answer)),
                    budget=float(budget), recomputed=float(req.cached[S].sum() / rec["n_cached"]),
                    total=t["total"], preview=t.get("preview", 0.0))
            records.append(rec)
            m = rec["modes"]
            mid = f"r={ratios[len(ratios) // 2]:g}"
            print(f"req {k:2d} N={req.N} q={rec['q']} " + " ".join(
                f"{rule} {m[f'{rule} {mid}']['kl']:.4f}" for rule in chosen)
                + f" | reuse {m['full reuse']['kl']:.4f} | {info['question'][:50]!r} "
                f"| {time.time() - t_start:.0f}s", flush=True)
            if args.json:  # after every request: a run stopped early keeps what it did
                Path(args.json).write_text(json.dumps({"args": vars(args), "records": records},
                                                      indent=1))
    print(table(records, ratios))
    if args.plot:
        plot(records, ratios, args.plot, f"{len(records)} requests, {args.questions} questions")
    print(f"total {time.time() - t_start:.0f}s")
    return records


if __name__ == "__main__":
    main()
