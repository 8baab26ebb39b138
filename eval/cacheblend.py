"""CacheBlend in NumPy: the reference for what kvblendd's fuse does, on a real model.

A request is an ordered list of segments, each a stored chunk (prefilled alone
at positions base..base+T-1, usually base 0; its KV is what kvblend stores) or
fresh tokens. This module places the chunks' stored KV at their positions in
the prompt (the exact RoPE delta rotation) and runs the model in these modes:

* full prefill: every token computed; the reference;
* full reuse: stored KV for every chunk token at every layer, only fresh
  tokens computed;
* CacheBlend: layers up to the first check layer fully prefilled; at each
  check layer the deviation of V (or K) between the fresh and the stored row
  narrows the recomputed set to the top r_i of cached tokens (plus every fresh
  token); from the next layer on only those are recomputed and the rest keep
  the re-rotated stored KV (docs/fuse.md, docs/DESIGN.md "Fuse semantics");
* static selection (EPIC, arXiv 2410.15332): a fixed set of cached tokens,
  e.g. the first tokens of each chunk, plus every fresh token is recomputed at
  every layer; no layer is fully prefilled.
"""

import numpy as np
from model import rope_angles, rope_rotate


def rerotate(k, pos_old, pos_new, cfg):
    """Keys k [T, kv_heads, d] rotated at pos_old moved to pos_new: R(pos_new - pos_old) k.

    RoPE rotations compose, so one rotation by the difference of angles is exact;
    angles in float64, arithmetic in float32 (as DESIGN.md says for the daemon).
    """
    ang = (rope_angles(pos_new, cfg.head_dim, cfg.rope_theta)
           - rope_angles(pos_old, cfg.head_dim, cfg.rope_theta))
    return rope_rotate(k, ang, cfg.rope_style)


def select_count(ratio, n_cached):
    """How many cached tokens a ratio keeps: floor(ratio * n_cached), at least 1 when ratio > 0
    (the daemon's hkvd_count)."""
    if not ratio > 0 or n_cached == 0:
        return 0
    return min(max(int(np.floor(ratio * n_cached)), 1), n_cached)


def hkvd_select(dev, cand, k, fresh):
    """Top k of the candidate token indices cand by deviation dev (one per candidate; ties to
    the lower index, NaN as largest) plus every fresh token; sorted prompt indices."""
    dev = np.where(np.isnan(dev), np.inf, dev)
    order = np.lexsort((cand, -dev))  # by deviation descending, then index
    return np.sort(np.concatenate([cand[order[:k]], fresh])).astype(np.int64)


def epic_selection(req, ratio):
    """EPIC's static selection at the budget of a ratio: the first tokens of each chunk,
    select_count(ratio, n_cached) in all, shared out in proportion to the chunks' lengths
    (floor of each share, the remainder one each to the first chunks). Prompt indices."""
    spans = [(s, T) for kind, s, T in req.spans if kind == "chunk"]
    k = select_count(ratio, int(req.cached.sum()))
    n_cached = sum(T for _, T in spans)
    take = [int(np.floor(k * T / n_cached)) for _, T in spans]
    for i in range(k - sum(take)):
        take[i % len(take)] += 1
    return np.concatenate([np.arange(s, s + min(t, T)) for (s, T), t in zip(spans, take)]
                          + [np.empty(0, np.int64)]).astype(np.int64)


class Request:
    """Segments ("chunk", ids) or ("fresh", ids) laid out one after another from position 0.

    stored: one KV [layers, 2, T, kv_heads, d] per chunk segment, in order, rotated at
    base..base+T-1 (bases: one per chunk, default 0). placed: optional, the stored KV as the
    fuse hands it out (each chunk's rows moved to its place), e.g. read from kvblendd with
    get-rerotated; by default computed here with rerotate() (stored None and placed None:
    no placed KV, for a forward pass in which the daemon does the re-rotation).
    """

    def __init__(self, segments, stored, cfg, bases=None, placed=None):
        self.segments = segments
        self.ids = np.concatenate([np.asarray(s, np.int64) for _, s in segments])
        self.N = len(self.ids)
        self.pos = np.arange(self.N)
        self.cached = np.zeros(self.N, bool)
        self.spans = []  # (kind, start, length) per segment
        n = 0
        for kind, s in segments:
            self.spans.append((kind, n, len(s)))
            if kind == "chunk":
                self.cached[n:n + len(s)] = True
            n += len(s)
        if placed is not None or stored is None:
            self.placed = placed  # None: the fuse re-rotates (fuse_forward needs no placed)
            return
        self.placed = np.zeros((cfg.n_layers, 2, self.N, cfg.n_kv_heads, cfg.head_dim),
                               np.float32)
        chunks = [(s, T) for kind, s, T in self.spans if kind == "chunk"]
        bases = [0] * len(chunks) if bases is None else bases
        for (n, T), kv, b in zip(chunks, stored, bases):
            for l in range(cfg.n_layers):
                self.placed[l, 0, n:n + T] = rerotate(kv[l, 0], np.arange(b, b + T),
                                                      self.pos[n:n + T], cfg)
            self.placed[:, 1, n:n + T] = kv[:, 1]


def deviation(fresh, stored):
    """Squared L2 distance per token over heads x head_dim (float64 here; fp32 in the daemon)."""
    d = fresh.astype(np.float64) - stored.astype(np.float64)
    return (d * d).sum(axis=(1, 2))


def head_deviation(fresh, stored):
    """Squared deviation per token and KV head, [n, kv_heads] float32, exactly as the daemon
    computes it (blend/qsel.c): elements to float32, then acc = acc + x * x over head_dim in
    order, every operation rounded to float32 (a loop over d, vectorised over tokens and heads,
    keeps that order; NumPy's sum() would not)."""
    x = fresh.astype(np.float32) - stored.astype(np.float32)
    acc = np.zeros(x.shape[:2], np.float32)
    for d in range(x.shape[2]):
        acc = acc + x[:, :, d] * x[:, :, d]
    return acc


def _head_normalised(d):
    """Each head's deviations divided by the head's mean of its finite ones (float64 sum in
    token order, divided by their count, rounded to float32; a head whose mean is 0 is left
    as it is), as blend/qsel.c does. cumsum adds in order, as the daemon's loop does."""
    fin = np.isfinite(d)
    n = d.shape[0]
    if n == 0:
        return d
    total = np.cumsum(np.where(fin, d, 0).astype(np.float64), axis=0)[-1]
    cnt = fin.sum(axis=0)
    mean = np.where(cnt > 0, total / np.maximum(cnt, 1), 0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, d / np.where(mean > 0, mean, np.float32(1)), d).astype(np.float32)


def attention_score(dk, dv, a):
    """The attention metric's score of each candidate (issue 24, docs/fuse.md): sum over KV
    heads h of a[j, h] * sqrt(dK'[j, h] + dV'[j, h]), dK' and dV' the per-head deviations
    divided by their head's mean over the candidates. dk, dv, a: [n, kv_heads]. Float32,
    heads added in order from 0, bit for bit the daemon's score."""
    nk, nv = _head_normalised(dk), _head_normalised(dv)
    a = a.astype(np.float32)
    acc = np.zeros(dk.shape[0], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for h in range(dk.shape[1]):
            acc = acc + a[:, h] * np.sqrt(nk[:, h] + nv[:, h])
    return acc


def top_select(score, cand, k, fresh):
    """Top k of cand by score (ties to the lower index; NaN above +inf, as the daemon's
    64-bit key orders them) plus every fresh token; sorted prompt indices."""
    nan = np.isnan(score)
    s = np.where(nan, np.inf, score)
    order = np.lexsort((cand, -s, ~nan))  # NaN first, then score descending, then index
    return np.sort(np.concatenate([cand[order[:k]], fresh])).astype(np.int64)


def attention_select(k_new, v_new, k_stored, v_stored, a, cand, cached_ord, k, fresh):
    """The daemon's selection with the attention metric at one check layer: the candidates
    cand (cached prompt indices, increasing) with fresh rows k_new, v_new and re-rotated
    stored rows k_stored, v_stored ([n_cand, kv_heads, d] each), A's rows a (all chunk
    tokens) indexed by cached_ord (each candidate's index among the chunk tokens)."""
    score = attention_score(head_deviation(k_new, k_stored), head_deviation(v_new, v_stored),
                            a[cached_ord])
    return top_select(score, cand, k, fresh)


def blend_forward(model, req, rows, check_layer=None, ratio=0.0, metric="value",
                  recompute=None, force=None):
    """Logits [len(rows), vocab] at prompt rows (fresh tokens), and the fused KV and selection.

    check_layer: None for full reuse or a static selection; an int (one check layer, ratio
    a float) or a sequence of increasing layers (ratio a sequence of non-increasing ratios)
    for CacheBlend with gradual filtering. metric: "value" or "key" deviation.
    recompute: with check_layer None, the cached token indices recomputed at every layer
    (EPIC); None means none (full reuse). force: one selection per check layer to use instead
    of the computed one (to compare the daemon's fused KV on the daemon's selection).
    Returns (logits, fused KV [layers, 2, N, kv_heads, d], the final selection or None).
    """
    cfg = model.cfg
    checks = [] if check_layer is None else list(np.atleast_1d(check_layer))
    ratios = list(np.atleast_1d(ratio)) if checks else []
    if len(ratios) != len(checks):
        raise ValueError("one ratio per check layer")
    fresh = np.flatnonzero(~req.cached)
    if checks:
        S = np.arange(req.N)
    else:
        extra = np.empty(0, np.int64) if recompute is None else np.asarray(recompute)
        S = np.union1d(fresh, extra).astype(np.int64)
    n_cached = int(req.cached.sum())
    m = 1 if metric == "value" else 0
    fused = req.placed.copy()
    h = model.embed(req.ids[S])
    selected = None
    for l in range(cfg.n_layers):
        q, k, v = model.qkv(l, h, req.pos[S])
        fused[l, 0, S], fused[l, 1, S] = k, v  # new rows for S, stored rows for the rest
        h = model.attend(l, h, q, fused[l, 0], fused[l, 1], S)
        if l in checks:
            i = checks.index(l)
            is_cached = req.cached[S]
            dev = deviation((k, v)[m][is_cached], req.placed[l, m, S[is_cached]])
            new = hkvd_select(dev, S[is_cached], select_count(ratios[i], n_cached), fresh)
            if force is not None:
                new = np.asarray(force[i], np.int64)
            h, S = h[np.searchsorted(S, new)], new
            selected = S
    if not np.isin(rows, S).all():
        raise ValueError("logits asked for a token that was not recomputed")
    return model.logits(h[np.searchsorted(S, rows)]), fused, selected


def kl_top1(ref_logits, logits):
    """Per row KL(ref || other) in nats of the next-token distributions, and top-1 agreement."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return kl, ref_logits.argmax(-1) == logits.argmax(-1)
