"""Selection rules from the published field (issue 35), at HKVD's budget, beside qsel.py's.

Each rule here chooses the cached tokens to recompute before the blend pass starts and
hands them to a fuse session opened with the node's own selection (``recompute``, as
qsel.py's "A alone" does): the chosen tokens are recomputed on every layer, the others
keep the stored KV the daemon re-rotated. What differs is the score, and the pass that
produces it, which the budget charges (eval/RULES.md says where each idea comes from and
what was chosen where the paper is silent):

* ``prophet`` (ProphetKV, arXiv 2602.02579): the question's attention on the chunk tokens
  in every layer, each layer's scores made a distribution over the chunk tokens and the
  layers averaged (layer-fused), from a question pass over the stale cache (stage one)
  before the selected tokens are recomputed (stage two);
* ``infoflow`` (InfoFlow KV, arXiv 2603.05353): the question's attention weighted by the
  norm of the value it reads (an attention-norm), with the chunk keys re-rotated to where
  the chunk sits in the prompt; ``infoflow local`` the same with the keys left where the
  chunk was prefilled (an ablation of the geometry);
* ``qcfuse`` (QCFuse, arXiv 2606.05875): a compressed preview: the question runs over a
  few anchor tokens per chunk up to one critical layer, where it reads every chunk token
  once; its attention there is the score;
* ``oracle``: the true deviation of the stale KV from a full prefill's, summed over the
  layers (each layer scaled by its mean); needs the full prefill, so a ceiling only;
* ``EPIC`` (arXiv 2410.15332): the first tokens of each chunk (cacheblend.epic_selection),
  at the same budget.

The scores are plain NumPy functions of the question pass's per-layer attention
(``question_pass``), testable without the model or a daemon.
"""

import time

import numpy as np

from cacheblend import epic_selection, top_select
from node import fuse_forward
from qsel import PREVIEW_FROM, Budget, question_pass, question_rows

ANCHOR_EVERY = 32  # qcfuse: one anchor every 32 chunk tokens, the chunk's first included
CRITICAL_LAYER = 6  # qcfuse: profiled (run_qsel.py --profile-critical 3; RULES.md)


# --- the question pass (qsel.question_pass) and the stale KV it reads ------------------


def local_placed(model, req, store, hashes):
    """The stored KV of req's chunks at their places in the prompt but with the keys as
    stored (rotated where each chunk was prefilled, not re-rotated): [layers, 2, N,
    kv_heads, d], zero for fresh tokens; and seconds in the calls."""
    c = model.cfg
    out = np.zeros((c.n_layers, 2, req.N, c.n_kv_heads, c.head_dim), np.float32)
    t0 = time.perf_counter()
    for (kind, s, T), h in zip([sp for sp in req.spans if sp[0] == "chunk"], hashes):
        out[:, :, s:s + T] = store.get(h)
    return out, time.perf_counter() - t0


# --- the scores (pure NumPy) ------------------------------------------------------

def prophet_score(att, first=PREVIEW_FROM):
    """Layer-fused question attention: each layer's attention (summed over KV heads) as a
    distribution over the chunk tokens, averaged over layers first .. L-1 with equal
    weights. att: [layers, n, kv_heads]. Returns [n]."""
    per = att[first:].sum(axis=2)
    tot = per.sum(axis=1, keepdims=True)
    per = np.divide(per, tot, out=np.zeros_like(per), where=tot > 0)
    return per.mean(axis=0)


def infoflow_score(att, v, first=PREVIEW_FROM):
    """Attention-norm: sum over layers first .. L-1 and KV heads of the question's attention
    on token j times the norm of the value it reads there, ||v[l, j, h]||.
    att: [layers, n, kv_heads]; v: the chunk tokens' stale values [layers, n, kv_heads, d].
    Returns [n]."""
    vn = np.linalg.norm(v.astype(np.float64), axis=-1)
    return (att[first:] * vn[first:]).sum(axis=(0, 2))


def qcfuse_score(att, layer):
    """The question's attention on each chunk token at the critical layer, summed over KV
    heads. Returns [n]."""
    return att[layer].sum(axis=1)


def anchors(req, every=ANCHOR_EVERY):
    """Prompt indices of the anchor tokens: in each chunk its first token and one every
    `every` tokens after it."""
    return np.concatenate([np.arange(s, s + T, every) for kind, s, T in req.spans
                           if kind == "chunk"] + [np.empty(0, np.int64)]).astype(np.int64)


def oracle_score(full, placed, cached):
    """The true deviation of the stale KV from the full prefill's: per layer, the squared
    distance of K and V over heads x head_dim, divided by the layer's mean over the chunk
    tokens (so that no layer's scale decides), summed over layers. full, placed: [layers, 2,
    N, kv_heads, d]; cached: prompt indices of the chunk tokens. Returns [n]."""
    d = full[:, :, cached].astype(np.float64) - placed[:, :, cached].astype(np.float64)
    dev = (d * d).sum(axis=(1, 3, 4))  # [layers, n]
    mean = dev.mean(axis=1, keepdims=True)
    return np.divide(dev, mean, out=np.zeros_like(dev), where=mean > 0).sum(axis=0)


def top_tokens(score, req, k):
    """The top k chunk tokens by score (one per chunk token; ties to the lower index), as
    sorted prompt indices."""
    return top_select(np.asarray(score, np.float64), np.flatnonzero(req.cached), k,
                      np.empty(0, np.int64))


# --- budget and the forward pass ------------------------------------------------------

def selected_budget(b, k, preview_rows):
    """k tokens recomputed on every layer, plus preview_rows token-layers of previews and
    checks: recomputed token-layers per chunk token / L."""
    return (k * b.L + preview_rows) / (b.n * b.L)


def solve_k(b, target, preview_rows):
    """The largest k whose selected_budget does not exceed target."""
    return b.solve(lambda k: selected_budget(b, k, preview_rows), target)


def forward_selected(model, fuse, req, hashes, rows, sel, t_pass):
    """A session given the node's selection sel (recomputed on every layer); fuse_forward's
    tuple with t_pass, the seconds of the pass that chose sel, added as the preview."""
    out = fuse_forward(model, req, hashes, fuse, (), (), "value", rows, recompute=sel)
    t = dict(out[3])
    t.update(total=t["total"] + t_pass, node=t["node"] + t_pass, preview=t_pass)
    return out[0], out[1], out[2], t


class Previews:
    """One request's question passes, run once and shared by the rules and ratios that use
    them (each rule is charged its pass in rows and in seconds all the same)."""

    def __init__(self, model, store, req, hashes, critical_layer=CRITICAL_LAYER):
        self.model, self.store, self.req, self.hashes = model, store, req, hashes
        self.critical = critical_layer
        self.cache = {}

    def get(self, kind):
        """(att, seconds, placed values of the chunk tokens) of 'full', 'local' or
        'anchored'."""
        if kind not in self.cache:
            m, req = self.model, self.req
            t0 = time.perf_counter()
            if kind == "local":
                placed, _ = local_placed(m, req, self.store, self.hashes)
            else:
                placed, _ = self.store.placed(req, self.hashes)
            if kind == "anchored":
                att, _ = question_pass(m, req, placed, view=anchors(req),
                                       last_layer=self.critical)
            else:
                att, _ = question_pass(m, req, placed)
            v = placed[:, 1, np.flatnonzero(req.cached)]
            self.cache[kind] = (att, time.perf_counter() - t0, v)
        return self.cache[kind]


NEW_RULES = ("ProphetKV", "InfoFlow", "InfoFlow local", "QCFuse", "EPIC", "oracle")
#: QCFuse-style as the vLLM connector's "anchored" metric runs it: r of the chunk tokens
#: recomputed, not HKVD's budget at r (less compute at the same r).
LITERAL_RULES = ("anchored",)


def run_new_rule(rule, r_hkvd, model, fuse, req, hashes, rows, previews, oracle=None):
    """One of NEW_RULES at HKVD's budget at r_hkvd, or of LITERAL_RULES at r_hkvd
    itself: (logits at rows, fused KV, selection, timing, budget used). oracle:
    oracle_score of the request (for "oracle")."""
    from cacheblend import select_count

    b = Budget(model.cfg, int(req.cached.sum()), len(question_rows(req)))
    target = b.hkvd(select_count(r_hkvd, b.n))
    q, L = b.q, b.L
    if rule == "EPIC":
        k = solve_k(b, target, 0)
        sel = epic_selection(req, b.ratio_for(k)) if k else np.empty(0, np.int64)
        return (*forward_selected(model, fuse, req, hashes, rows, sel, 0.0),
                selected_budget(b, k, 0))
    if rule == "oracle":  # a ceiling: its pass (the full prefill) is not charged
        k = solve_k(b, target, 0)
        return (*forward_selected(model, fuse, req, hashes, rows, top_tokens(oracle, req, k),
                                  0.0), selected_budget(b, k, 0))
    if rule in ("QCFuse", "anchored"):
        att, secs, _ = previews.get("anchored")
        charge = q * (previews.critical + 1)
        score = qcfuse_score(att, previews.critical)
    else:
        att, secs, v = previews.get("local" if rule == "InfoFlow local" else "full")
        charge = q * L
        score = prophet_score(att) if rule == "ProphetKV" else infoflow_score(att, v)
    k = select_count(r_hkvd, b.n) if rule == "anchored" else solve_k(b, target, charge)
    sel = top_tokens(score, req, k)
    return (*forward_selected(model, fuse, req, hashes, rows, sel, secs),
            selected_budget(b, k, charge))
