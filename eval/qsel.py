"""Question-aware token selection (issue 24): the node's side, at an equal budget.

* ``preview``: before the blend pass the node runs only the question tokens (the last
  fresh span) through every layer over the stored, re-rotated chunk KV (plain reuse for
  the question) and accumulates A[j, h]: the question's softmax attention on chunk token
  j, summed over its queries, over layers 2 .. L-1 and over the query heads of KV head h.
  The other fresh tokens (chat template, instruction, "Document i:" lines) are not
  computed in the preview, so its queries see the chunk tokens and the question only.
* ``Budget``: recomputed token-layers per chunk token, over L layers. HKVD with check
  layer 1: layers 0 and 1 whole, k = floor(r n) tokens on layers 2 .. L-1. The attention
  rule ("cheap check"): layer 0 whole; at the check layer the k' selected rows whole and
  the others only their Q, K, V (a share f_qkv of a row's work); k' rows on the later
  layers; plus the preview, q question tokens x L layers. "A alone": the k'' tokens of
  the top of A (summed over heads) on every layer, plus the preview, no check layer. The
  r of each is solved per request so that its budget equals HKVD's at r.
* ``forward_attention`` and ``forward_alone``: the two modes through a real kvblendd
  (fuse_forward with the attention metric and the cheap check; a session opened with the
  node's own selection, ``recompute``).

The score and selection the daemon makes are eval/cacheblend.py's attention_select (the
tests hold the daemon to it bit for bit); here only A and the budget are the node's.
"""

import time

import numpy as np

from cacheblend import select_count, top_select
from model import rms_norm
from node import fuse_forward

PREVIEW_FROM = 2  # layers 0 and 1 attend broadly; A sums layers 2 .. L-1


def question_rows(req):
    """Prompt indices of the question: the last fresh span."""
    _, s, T = [sp for sp in req.spans if sp[0] == "fresh"][-1]
    return np.arange(s, s + T)


def question_pass(model, req, placed, view=None, last_layer=None):
    """The question tokens (the last fresh span) through layers 0 .. last_layer (default
    every layer) over placed ([layers, 2, N, kv_heads, d]: the chunk tokens' stale KV, at
    whatever positions the caller rotated them to) and their own KV.

    view: prompt indices of the chunk tokens the question reads on the layers before
    last_layer (default every chunk token); on last_layer it reads every chunk token.
    Returns att [layers, chunk tokens, kv_heads] float64: per layer, the question's softmax
    attention on each chunk token summed over its queries and the query heads of each KV
    head (zero on layers not run, and on tokens outside the view), and the seconds."""
    c = model.cfg
    t0 = time.perf_counter()
    rows = question_rows(req)
    cached = np.flatnonzero(req.cached)
    last = c.n_layers - 1 if last_layer is None else last_layer
    view_ord = (np.arange(len(cached)) if view is None
                else np.searchsorted(cached, np.asarray(view, np.int64)))
    rep = c.n_heads // c.n_kv_heads
    att = np.zeros((c.n_layers, len(cached), c.n_kv_heads))
    h = model.embed(req.ids[rows])
    t = model.t
    for l in range(last + 1):
        ords = np.arange(len(cached)) if l == last else view_ord
        q, k, v = model.qkv(l, h, req.pos[rows])
        keys = np.concatenate([cached[ords], rows])
        K = np.concatenate([placed[l, 0, cached[ords]], k])
        V = np.concatenate([placed[l, 1, cached[ords]], v])
        Kh = np.repeat(K, rep, axis=1).transpose(1, 2, 0)
        Vh = np.repeat(V, rep, axis=1).transpose(1, 0, 2)
        s = np.matmul(q.transpose(1, 0, 2), Kh) / np.float32(np.sqrt(c.head_dim))
        s = np.where((keys[None, :] > rows[:, None])[None], np.float32(-np.inf), s)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)  # [heads, q, keys]
        on = s[:, :, : len(ords)].sum(axis=1)  # [heads, view tokens]
        att[l, ords] = on.reshape(c.n_kv_heads, rep, -1).sum(axis=1).T
        if l == last:
            break
        o = np.matmul(s, Vh).transpose(1, 0, 2).reshape(len(rows), c.dim)
        h = h + o @ t[f"blk.{l}.attn_output.weight"].T
        x = rms_norm(h, t[f"blk.{l}.ffn_norm.weight"], c.rms_eps)
        g = x @ t[f"blk.{l}.ffn_gate.weight"].T
        u = x @ t[f"blk.{l}.ffn_up.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ t[f"blk.{l}.ffn_down.weight"].T
    return att, time.perf_counter() - t0


def preview(model, req, placed):
    """A [chunk tokens, kv_heads] float32 from the question's pass over placed, the stored
    KV re-rotated to the prompt ([layers, 2, N, kv_heads, d]); and its seconds: the
    question's attention on the chunk tokens summed over layers PREVIEW_FROM .. L-1
    (:func:`question_pass`)."""
    att, secs = question_pass(model, req, placed)
    return att[PREVIEW_FROM:].sum(axis=0).astype(np.float32), secs


def f_qkv(cfg):
    """The share of a token-layer's matrix work that Q, K and V are (projections and MLP;
    the attention scores, which also shrink for rows not run, left out: conservative)."""
    qkv = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return qkv / (qkv + cfg.dim * cfg.n_heads * cfg.head_dim + 3 * cfg.dim * cfg.ffn_dim)


class Budget:
    """Recomputed token-layers per chunk token / L, for one request (see the module doc)."""

    def __init__(self, cfg, n_cached, n_question, check_layer=1):
        self.L, self.n, self.q, self.c1 = cfg.n_layers, n_cached, n_question, check_layer
        self.f = f_qkv(cfg)

    def hkvd(self, k):
        """HKVD with k tokens kept: layers 0 .. c1 whole, k rows after."""
        return ((self.c1 + 1) * self.n + k * (self.L - self.c1 - 1)) / (self.n * self.L)

    def attention(self, k):
        """The attention rule with k tokens kept and the cheap check, preview included."""
        L, n, c1 = self.L, self.n, self.c1
        rows = c1 * n + k + self.f * (n - k) + k * (L - c1 - 1) + self.q * L
        return rows / (n * L)

    def alone(self, k):
        """k tokens from A alone at every layer, preview included."""
        return (k * self.L + self.q * self.L) / (self.n * self.L)

    def solve(self, cost, target):
        """The largest k with cost(k) <= target (0 if none), as a ratio for the daemon."""
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= target + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def ratio_for(self, k):
        """A ratio whose select_count is exactly k (floor of r n, at least 1 when r > 0)."""
        if k == 0:
            return 0.0
        r = (k + 0.5) / self.n
        assert select_count(r, self.n) == k
        return r


def alone_selection(a, req, k):
    """The node's own selection from A alone: the top k chunk tokens by A summed over heads
    (ties to the lower index), as prompt indices."""
    cand = np.flatnonzero(req.cached)
    return top_select(a.sum(axis=1), cand, k, np.empty(0, np.int64))


def forward_attention(model, store, fuse, req, hashes, rows, r_hkvd, check_layer=1):
    """The attention rule at HKVD's budget at r_hkvd: preview, then a fuse session with the
    attention metric and the cheap check. Returns fuse_forward's tuple, the timing dict
    with the preview's seconds added, plus the budget used."""
    t0 = time.perf_counter()
    placed, t_get = store.placed(req, hashes)
    a, _ = preview(model, req, placed)
    del placed
    t_pre = time.perf_counter() - t0
    b = Budget(model.cfg, int(req.cached.sum()), len(question_rows(req)), check_layer)
    target = b.hkvd(select_count(r_hkvd, b.n))
    k = b.solve(b.attention, target)
    out = fuse_forward(model, req, hashes, fuse, (check_layer,), (b.ratio_for(k),),
                       "attention", rows, attention=a, cheap=True)
    t = out[3]
    t.update(total=t["total"] + t_pre, node=t["node"] + t_pre - t_get,
             calls=t["calls"] + t_get, preview=t_pre)
    return out[0], out[1], out[2], t, b.attention(k)


def forward_alone(model, store, fuse, req, hashes, rows, r_hkvd, literal=False):
    """The top of A alone at HKVD's budget at r_hkvd, no check layer: the node's selection
    given at open (recompute). Same returns as forward_attention. ``literal``: r_hkvd is
    the share of chunk tokens recomputed (select_count), as the vLLM connector's and
    kvblend.hf's "question" metric reads its ratio, not HKVD's budget."""
    t0 = time.perf_counter()
    placed, t_get = store.placed(req, hashes)
    a, _ = preview(model, req, placed)
    del placed
    t_pre = time.perf_counter() - t0
    b = Budget(model.cfg, int(req.cached.sum()), len(question_rows(req)))
    k = select_count(r_hkvd, b.n)
    if not literal:
        k = b.solve(b.alone, b.hkvd(k))
    sel = alone_selection(a, req, k)
    out = fuse_forward(model, req, hashes, fuse, (), (), "value", rows, recompute=sel)
    t = out[3]
    t.update(total=t["total"] + t_pre, node=t["node"] + t_pre - t_get,
             calls=t["calls"] + t_get, preview=t_pre)
    return out[0], out[1], out[2], t, b.alone(k)
