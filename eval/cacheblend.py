"""CacheBlend in NumPy: the reference for what kvblendd's fuse does, on a real model.

A request is an ordered list of segments, each a stored chunk (prefilled alone
at positions 0..T-1; its KV is what kvblend stores) or fresh tokens. This
module places the chunks' stored KV at their positions in the prompt (the
exact RoPE delta rotation) and runs the model three ways:

* full prefill: every token computed; the reference;
* full reuse: stored KV for every chunk token at every layer, only fresh
  tokens computed;
* CacheBlend: layers up to the check layer fully prefilled; at the check layer
  the value deviation picks the top r of cached tokens (plus every fresh
  token); from the next layer on only those are recomputed and the rest keep
  the re-rotated stored KV (docs: shared/DESIGN.md, "Fuse semantics", with one
  check layer).
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


def hkvd_select(dev, cached, ratio):
    """Top floor(ratio * n_cached) cached tokens by deviation (at least 1 when ratio > 0;
    ties to the lower index) plus every fresh token; sorted prompt indices."""
    cand = np.flatnonzero(cached)
    k = int(np.floor(ratio * len(cand)))
    if ratio > 0 and len(cand) > 0:
        k = max(k, 1)
    order = np.lexsort((cand, -dev[cand]))  # by deviation descending, then index
    return np.sort(np.concatenate([cand[order[:k]], np.flatnonzero(~cached)]))


class Request:
    """Segments ("chunk", ids) or ("fresh", ids) laid out one after another from position 0.

    stored: one KV [layers, 2, T, kv_heads, d] per chunk segment, in order, rotated at 0..T-1.
    """

    def __init__(self, segments, stored, cfg):
        self.ids = np.concatenate([np.asarray(s, np.int64) for _, s in segments])
        self.N = len(self.ids)
        self.pos = np.arange(self.N)
        self.cached = np.zeros(self.N, bool)
        # The stored KV as the fuse hands it out: each chunk's rows moved to its position.
        self.placed = np.zeros((cfg.n_layers, 2, self.N, cfg.n_kv_heads, cfg.head_dim),
                               np.float32)
        it, n = iter(stored), 0
        for kind, s in segments:
            T = len(s)
            if kind == "chunk":
                kv = next(it)
                self.cached[n:n + T] = True
                for l in range(cfg.n_layers):
                    self.placed[l, 0, n:n + T] = rerotate(kv[l, 0], np.arange(T),
                                                          self.pos[n:n + T], cfg)
                self.placed[:, 1, n:n + T] = kv[:, 1]
            n += T


def blend_forward(model, req, rows, check_layer=None, ratio=0.0):
    """Logits [len(rows), vocab] at prompt rows (fresh tokens), and the fused KV and selection.

    check_layer None: full reuse (only fresh tokens are ever computed). Otherwise
    CacheBlend with one check layer and recompute ratio ratio.
    Returns (logits, fused KV [layers, 2, N, kv_heads, d], selected indices or None).
    """
    cfg = model.cfg
    S = np.arange(req.N) if check_layer is not None else np.flatnonzero(~req.cached)
    fused = req.placed.copy()
    h = model.embed(req.ids[S])
    selected = None
    for l in range(cfg.n_layers):
        q, k, v = model.qkv(l, h, req.pos[S])
        fused[l, 0, S], fused[l, 1, S] = k, v  # new rows for S, stored rows for the rest
        h = model.attend(l, h, q, fused[l, 0], fused[l, 1], S)
        if l == check_layer:  # S is every token here: deviation of V per token
            dev = ((v - req.placed[l, 1]) ** 2).sum(axis=(1, 2))
            selected = hkvd_select(dev, req.cached, ratio)
            h, S = h[selected], selected
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
