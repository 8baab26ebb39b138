"""The blend pass's attention: vLLM's CPU kernel and PyTorch's, against a float64 reference.

Run with the engine venv's python (.ci/engine-env); no engine start, no daemon. For the
shapes of the blend pass (SmolLM2's 9 query / 3 KV heads of 64, and a model without
grouped queries) and prompts of a few hundred tokens:
(a) kvblend.blend.attention.runs splits increasing positions into runs of consecutive ones;
(b) kvblend.blend.attention.causal_attention (PyTorch's fused attention) and
    kvblend.vllm.attention.PagedAttention (vLLM's cpu_attention_with_kv_cache over a scratch
    paged cache) both equal a float64 dense reference with an exact causal mask in prompt
    order, for every row in order (a layer before the check), a scattered selection with
    a fresh run at the end (a layer after it), isolated rows, one row, no rows; the paged
    attention object is reused across layers and prompt lengths as the pass reuses it;
(c) kvblend.vllm.attention.VarlenAttention, the pass's attention on a GPU (vLLM's
    FlashAttention varlen kernel over a scratch paged cache), here over fa_reference: the
    kernel's documented contract (flash_attn_varlen_func's docstring: sequences by
    cu_seqlens_q, paged keys by block_table and seqused_k, the causal mask aligned to the
    bottom right, grouped-query heads) written out in float64. Everything but the CUDA
    kernel: the runs, the block table, the key counts and the scratch cache, for the
    selections of (b), and several prompts of other lengths in one call as the batched
    pass makes it; varlen_attention_for gives None off a GPU and for float32;
(d) the question's preview (kvblend.blend.preview.question_attention) over a toy decoder
    with grouped queries, against a float64 reference written out per head: A and the
    layers' outputs (through A of later layers) with the question's rows in blocks of a
    few rows (a small SCORE_ELEMENTS: blocks of 5 rows, the last one short) equal the
    reference and the preview in one block; the compressed (anchored) preview too; and a
    tail of 3000 question tokens over 600 chunk tokens is previewed by its last
    PREVIEW_MAX_QUESTION tokens (A equal to the reference on those alone), no score
    matrix or softmax larger than SCORE_ELEMENTS allocated on the way (torch.bmm and
    torch.softmax, through which every score passes, watched);
(e) a local layer's sliding window: causal_attention with a window (row i reads keys
    rows[i] - window + 1 .. rows[i]) equals the float64 reference with that mask for the
    selections of (b), and so do PagedAttention (vLLM's CPU kernel, told the window) and
    VarlenAttention (FlashAttention's window_size, over fa_reference) with a local and a
    full layer in turn; a window of n or more is the plain attention bit for bit; the
    preview over a toy decoder whose even layers are local equals its float64 reference
    with the window on the keys' positions (chunk rows and the question's own).
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import numpy as np
import torch

from kvblend.blend.attention import causal_attention, runs
from kvblend.vllm.attention import VarlenAttention, paged_attention_for, varlen_attention_for
from kvbtest import fail

# float32 attention against a float64 reference, rows of up to ~700 keys with unit-scale
# random inputs: measured errors are below 1e-6 (float32 accumulation order); 1e-5 leaves
# room for other kernels and thread counts, far below what a wrong mask gives (O(0.1)).
TOL = 1e-5


def reference(q, k, v, rows, scaling, window=None):
    """Dense float64 attention, row i over keys 0..rows[i] (rows[i] - window + 1..rows[i])."""
    rep = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double() for x in (q, k, v))
    k64, v64 = k64.repeat_interleave(rep, dim=1), v64.repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,Nhd->hnN", q64, k64) * scaling
    mask = torch.arange(k.shape[0])[None, :] > torch.as_tensor(rows)[:, None]
    if window is not None:
        mask |= torch.arange(k.shape[0])[None, :] <= torch.as_tensor(rows)[:, None] - window
    p = torch.softmax(s.masked_fill(mask[None], float("-inf")), dim=-1)
    return torch.einsum("hnN,Nhd->nhd", p, v64).reshape(q.shape[0], q.shape[1] * q.shape[2])


def fa_reference(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k,
                 softmax_scale, causal, block_table, window_size=(-1, -1)):
    """flash_attn_varlen_func's contract over a paged cache (its docstring), in float64;
    ``window_size`` (left, right): query i also sees no key before its own position - left."""
    if window_size[1] not in (-1, 0):
        fail(f"VarlenAttention asked for a window to the right {window_size}")
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    if not causal:
        fail("VarlenAttention asked for non-causal attention")
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs = k.shape[1]
    for j in range(seqused_k.numel()):
        a, b, nk = int(cu_seqlens_q[j]), int(cu_seqlens_q[j + 1]), int(seqused_k[j])
        if b - a > max_seqlen_q or nk > max_seqlen_k:
            fail(f"sequence {j}: {b - a} queries, {nk} keys over the maxima given")
        blocks = block_table[j, : -(-nk // bs)].long()
        kk = k[blocks].reshape(-1, *k.shape[2:])[:nk]
        vv = v[blocks].reshape(-1, *v.shape[2:])[:nk]
        # bottom right: query i of nq sees keys 0 .. nk - nq + i
        seen = np.arange(nk - (b - a), nk)
        out[a:b] = reference(q[a:b], kk, vv, seen, softmax_scale,
                             window).reshape(b - a, *q.shape[1:])
    return out.to(q.dtype)


def check_varlen(rng):
    """(c)."""
    for dev, dt in ((torch.device("cpu"), torch.float16), (torch.device("cuda"), torch.float32)):
        if varlen_attention_for(dev, 9, 3, 64, dt) is not None:
            fail(f"varlen_attention_for({dev.type}, {dt}) should be None")
    for heads, kv_heads, d in ((9, 3, 64), (4, 4, 32)):
        att = VarlenAttention(fa_reference, heads, kv_heads, d, torch.float32, "cpu")
        scaling = d**-0.5
        for n, k, v, name, rows, q in cases(rng, heads, kv_heads, d):
            rows_t = torch.as_tensor(rows)
            for layer in range(2):  # the same rows twice: the metadata kept
                kl, vl = k + layer, v - layer
                want = reference(q, kl, vl, rows, scaling)
                got = att(q, kl, vl, rows_t, scaling)
                err = (got.double() - want).abs().max().item() if rows.size else 0.0
                if got.shape != want.shape or not err <= TOL:
                    fail(f"varlen, heads {heads}/{kv_heads}, n={n}, {name}: "
                         f"shape {tuple(got.shape)}, err {err}")
        # several prompts in one call, each over its own keys
        ns = (150, 333, 17)
        ks = [torch.randn(m, kv_heads, d) for m in ns]
        vs = [torch.randn(m, kv_heads, d) for m in ns]
        rs = [np.sort(rng.choice(m, max(1, m // 5), replace=False)) for m in ns]
        qs = [torch.randn(r.size, heads, d) for r in rs]
        got = att.many(qs, ks, vs, [torch.as_tensor(r) for r in rs], scaling)
        want = torch.cat([reference(*x, scaling) for x in zip(qs, ks, vs, rs)])
        err = (got.double() - want).abs().max().item()
        if not err <= TOL:
            fail(f"varlen, {len(ns)} prompts in one call: err {err}")
        print(f"ok: varlen, heads {heads}/{kv_heads}, head size {d}: equals the reference, "
              f"alone and {len(ns)} prompts in one call")


def check_window(rng):
    """(e): causal_attention, the paged (vLLM's CPU kernel, told the window) and the varlen
    attention (FlashAttention's window_size) through a sliding window against the float64
    reference; the paged and varlen objects alternate a local and a full layer over the
    same rows, as the pass over Gemma 3 does (their kept metadata must follow the window)."""
    heads, kv_heads, d, window = 4, 1, 32, 128
    scaling = d**-0.5
    paged = paged_attention_for(torch.device("cpu"), heads, kv_heads, d, torch.float32)
    varlen = VarlenAttention(fa_reference, heads, kv_heads, d, torch.float32, "cpu")
    for n, k, v, name, rows, q in cases(rng, heads, kv_heads, d):
        rows_t = torch.as_tensor(rows)
        got = causal_attention(q, k, v, rows_t, scaling, window)
        want = reference(q, k, v, rows, scaling, window)
        err = (got.double() - want).abs().max().item() if rows.size else 0.0
        if not err <= TOL:
            fail(f"causal_attention, window {window}, n={n}, {name}: err {err}")
        plain = reference(q, k, v, rows, scaling)
        for impl, f in (("paged", paged), ("varlen", varlen)):
            for w, ref in ((window, want), (None, plain), (window, want)):
                got = f(q, k, v, rows_t, scaling, w)
                err = (got.double() - ref).abs().max().item() if rows.size else 0.0
                if not err <= TOL:
                    fail(f"{impl}, window {w}, n={n}, {name}: err {err}")
        if not torch.equal(causal_attention(q, k, v, rows_t, scaling, n),
                           causal_attention(q, k, v, rows_t, scaling)):
            fail(f"causal_attention, a window of n={n}, {name}: not the plain attention")
    print(f"ok: a sliding window of {window} equals the reference in causal_attention, the "
          "paged and the varlen attention (local and full layers in turn); one of n is the "
          "plain attention bit for bit")


def check_runs():
    """(a)."""
    cases = [
        ([], [0], []),
        ([5], [0, 1], [6]),
        ([0, 1, 2, 3], [0, 4], [4]),
        ([1, 2, 5, 7, 8, 9], [0, 2, 3, 6], [3, 6, 10]),
    ]
    for rows, qsl, seq in cases:
        got = runs(np.array(rows, np.int64))
        if got[0].tolist() != qsl or got[1].tolist() != seq:
            fail(f"runs({rows}) = {got}, want {qsl}, {seq}")
    print("ok: runs")


def cases(rng, heads, kv_heads, d):
    """What each attention is checked on: for n keys in (300, 700, 129) (the scratch cache
    grows, then is reused smaller), random K and V, then for each of selections' query rows
    random queries: (n, k, v, name, rows, q)."""
    for n in (300, 700, 129):
        k, v = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        for name, rows in selections(n, rng).items():
            yield n, k, v, name, rows, torch.randn(rows.size, heads, d)


def selections(n, rng):
    """Row sets of a prompt of n tokens, as the blend pass hands them to the attention."""
    fresh = np.arange(n - 20, n)
    sel = np.sort(rng.choice(n - 20, (n - 20) * 15 // 100, replace=False))
    return {
        "every row": np.arange(n),
        "15% + fresh run": np.concatenate([sel, fresh]),
        "isolated rows": np.arange(3, n, 7),
        "first and last": np.array([0, n - 1]),
        "one row": np.array([n // 2]),
        "no rows": np.zeros(0, np.int64),
    }


class ToyOps:
    """A toy decoder for the preview (kvblend.blend.loop.LayerOps): random projections,
    no RoPE, ``finish`` the residual plus the output projection; computes in h's dtype,
    so that the reference runs it in float64."""

    def __init__(self, layers, heads, kv_heads, d, dim=48, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)

        def w(i, o):
            return torch.randn(i, o, generator=g) / i**0.5

        self.device, self.kv_dtype, self.num_layers = torch.device("cpu"), torch.float32, layers
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.emb = torch.randn(vocab, dim, generator=g)
        self.w = [(w(dim, heads * d), w(dim, kv_heads * d), w(dim, kv_heads * d),
                   w(heads * d, dim)) for _ in range(layers)]

    def embed(self, ids):
        return self.emb[ids]

    def qkv(self, layer, h, pos):
        wq, wk, wv, _ = (x.to(h.dtype) for x in self.w[layer])
        n = h.shape[0]
        return ((h @ wq).view(n, self.heads, self.d), (h @ wk).view(n, self.kv_heads, self.d),
                (h @ wv).view(n, self.kv_heads, self.d))

    def scaling(self, layer):
        return self.d**-0.5

    def finish(self, layer, h, a):
        return h + a.to(h.dtype) @ self.w[layer][3].to(h.dtype)


class LocalToyOps(ToyOps):
    """ToyOps whose even layers are local: a sliding window of ``local`` keys (Gemma's)."""

    def __init__(self, *a, local=16, **kw):
        super().__init__(*a, **kw)
        self.local = local

    def window(self, layer):
        return self.local if layer % 2 == 0 else None


def preview_reference(ops, kv, cached, question, first, view=None, last=None, positions=None):
    """The preview's A written out in float64, one query head at a time (no blocks).

    With ``ops.window`` (a local layer's), query i (at ``positions[i]``) reads no key at a
    position <= its own - window: chunk row j is at position rows[j], the question's at
    ``positions``."""
    nq, heads, kvh = len(question), ops.heads, ops.kv_heads
    rep = heads // kvh
    h = ops.embed(torch.as_tensor(question)).double()
    a = torch.zeros(kvh, len(cached), dtype=torch.float64)
    stop = ops.num_layers - 1 if last is None else last
    for layer in range(stop + 1):
        q, k, v = ops.qkv(layer, h, None)
        rows = cached if last is None or layer == stop else view
        m = len(rows)
        keys = torch.cat([kv[layer, 0, rows].double(), k])
        values = torch.cat([kv[layer, 1, rows].double(), v])
        mask = torch.arange(m + nq)[None, :] > (m + torch.arange(nq))[:, None]
        w = ops.window(layer) if hasattr(ops, "window") else None
        if w is not None:
            kpos = torch.cat([torch.as_tensor(rows), torch.as_tensor(positions)])
            mask |= kpos[None, :] <= torch.as_tensor(positions)[:, None] - w
        out = torch.empty(nq, heads, ops.d, dtype=torch.float64)
        for hh in range(heads):
            g = hh // rep
            s = (q[:, hh] @ keys[:, g].T) * ops.scaling(layer)
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
            if layer == stop if last is not None else layer >= first:
                a[g] += p[:, :m].sum(0)
            out[:, hh] = p @ values[:, g]
        if layer == stop:
            break
        h = ops.finish(layer, h, out.reshape(nq, -1))
    return a.T.numpy()


class Watch:
    """The largest tensor torch.bmm returns and torch.softmax takes while entered."""

    def __enter__(self):
        self.most = 0
        self.bmm, self.softmax = torch.bmm, torch.softmax

        def bmm(*a, **kw):
            out = self.bmm(*a, **kw)
            self.most = max(self.most, out.numel())
            return out

        def softmax(x, *a, **kw):
            self.most = max(self.most, x.numel())
            return self.softmax(x, *a, **kw)

        torch.bmm, torch.softmax = bmm, softmax
        return self

    def __exit__(self, *exc):
        torch.bmm, torch.softmax = self.bmm, self.softmax


def rel(a, b):
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def check_preview():
    """(d)."""
    from kvblend.blend import preview

    # float32 preview against float64 over 3-4 toy layers of unit-scale inputs: measured
    # below 1e-6; 1e-5 is far below what a wrong mask, block edge or head order gives
    # (O(0.1) of A). Blocked against one block: float32 rounding of the sums alone.
    tol, tol_blocks = 1e-5, 1e-6
    ops = ToyOps(layers=4, heads=6, kv_heads=2, d=16)
    rng = np.random.default_rng(1)
    n_ctx, nq = 30, 43
    cached = np.sort(rng.choice(n_ctx, 24, replace=False))
    kv = torch.randn(ops.num_layers, 2, n_ctx + nq, ops.kv_heads, ops.d)
    question = rng.integers(0, 64, nq)
    positions = np.arange(n_ctx, n_ctx + nq)
    view, last = cached[::4], 2
    want = preview_reference(ops, kv, cached, question, first=1)
    want_anchored = preview_reference(ops, kv, cached, question, 1, view, last)
    saved = getattr(preview, "SCORE_ELEMENTS", None)
    got = {}
    try:
        for name, budget in (("one block", 1 << 30), ("blocks of 5 rows", 6 * 5 * (24 + nq))):
            preview.SCORE_ELEMENTS = budget
            with Watch() as w:
                a = preview.question_attention(ops, kv, cached, question, positions, first=1)
            b = preview.question_attention(ops, kv, cached, question, positions, view=view,
                                           last=last)
            got[name] = (a, b, w.most)
            if not rel(a, want) <= tol or not rel(b, want_anchored) <= tol:
                fail(f"preview, {name}: A off the reference by {rel(a, want):.3g}, "
                     f"anchored {rel(b, want_anchored):.3g}")
        one, blocks = got["one block"], got["blocks of 5 rows"]
        if not rel(blocks[0], one[0]) <= tol_blocks or not rel(blocks[1], one[1]) <= tol_blocks:
            fail(f"preview: blocks differ from one block by {rel(blocks[0], one[0]):.3g}")
        if blocks[2] > 6 * 5 * (24 + nq):
            fail(f"preview in blocks of 5 rows: a score tensor of {blocks[2]} elements")
        print(f"ok: preview in blocks of 5 question rows (of {nq}) equals the float64 "
              f"reference within {max(rel(blocks[0], want), rel(blocks[1], want_anchored)):.2g} "
              f"and one block within {rel(blocks[0], one[0]):.2g}")

        # a long tail: 3000 question tokens after 600 chunk tokens
        ops = ToyOps(layers=3, heads=6, kv_heads=2, d=16, seed=2)
        n_ctx, nq, cap = 600, 3000, getattr(preview, "PREVIEW_MAX_QUESTION", 0)
        cached = np.arange(n_ctx)
        kv = torch.randn(ops.num_layers, 2, n_ctx + nq, ops.kv_heads, ops.d)
        question = rng.integers(0, 64, nq)
        positions = np.arange(n_ctx, n_ctx + nq)
        budget = 6 * 64 * (n_ctx + 1024)  # blocks of at most 64 rows of 1024 over all keys
        preview.SCORE_ELEMENTS = budget
        with Watch() as w:
            a = preview.question_attention(ops, kv, cached, question, positions, first=1)
        full = 6 * nq * (n_ctx + nq)
        if w.most > budget:
            fail(f"preview of a {nq}-token tail: a score tensor of {w.most} elements "
                 f"(the whole matrix: {full}), over SCORE_ELEMENTS {budget}")
        if not 0 < cap < nq:
            fail(f"preview: no cap on the previewed tail (PREVIEW_MAX_QUESTION {cap})")
        want = preview_reference(ops, kv, cached, question[-cap:], first=1)
        if not rel(a, want) <= tol:
            fail(f"preview of a {nq}-token tail: A is not its last {cap} tokens' "
                 f"({rel(a, want):.3g})")
        print(f"ok: a {nq}-token tail is previewed by its last {cap} tokens in blocks, the "
              f"largest score tensor {w.most} elements (the whole matrix: {full})")

        # (e) local layers: a window of 16 on layers 0 and 2, over 60 chunk tokens
        ops = LocalToyOps(layers=4, heads=6, kv_heads=2, d=16, seed=3)
        n_ctx, nq = 60, 20
        cached = np.sort(rng.choice(n_ctx, 45, replace=False))
        kv = torch.randn(ops.num_layers, 2, n_ctx + nq, ops.kv_heads, ops.d)
        question = rng.integers(0, 64, nq)
        positions = np.arange(n_ctx, n_ctx + nq)
        preview.SCORE_ELEMENTS = 6 * 5 * (45 + nq)  # blocks of 5 rows
        a = preview.question_attention(ops, kv, cached, question, positions, first=1)
        want = preview_reference(ops, kv, cached, question, 1, positions=positions)
        plain = preview_reference(ToyOps(layers=4, heads=6, kv_heads=2, d=16, seed=3), kv,
                                  cached, question, 1)
        if not rel(a, want) <= tol or rel(plain, want) < 100 * tol:
            fail(f"preview over local layers: A off the reference by {rel(a, want):.3g} "
                 f"(without the window: {rel(plain, want):.3g})")
        print(f"ok: the preview over local layers (window 16) equals the float64 reference "
              f"within {rel(a, want):.2g} (without the window A moves by {rel(plain, want):.2g})")
    finally:
        if saved is None:
            delattr(preview, "SCORE_ELEMENTS")
        else:
            preview.SCORE_ELEMENTS = saved


def test_blend_attention():
    check_runs()
    check_preview()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for heads, kv_heads, d in ((9, 3, 64), (4, 4, 32)):
        paged = paged_attention_for(torch.device("cpu"), heads, kv_heads, d, torch.float32)
        if paged is None:
            fail("vLLM's CPU attention ops are not available in the engine venv")
        scaling = d**-0.5
        for n, k, v, name, rows, q in cases(rng, heads, kv_heads, d):
            rows_t = torch.as_tensor(rows)
            ref = reference(q, k, v, rows, scaling)
            for impl, f in (("causal_attention", causal_attention), ("paged", paged)):
                for layer in range(2):  # the same rows twice: cached request metadata
                    kl, vl = k + layer, v - layer
                    want = ref if layer == 0 else reference(q, kl, vl, rows, scaling)
                    got = f(q, kl, vl, rows_t, scaling)
                    if got.shape != want.shape:
                        fail(f"{impl} {name} n={n}: shape {tuple(got.shape)}")
                    err = (got.double() - want).abs().max().item() if rows.size else 0.0
                    if not err <= TOL:
                        fail(f"{impl}, heads {heads}/{kv_heads}, n={n}, {name}: err {err}")
        print(f"ok: heads {heads}/{kv_heads}, head size {d}: both equal the reference")
    check_window(rng)
    check_varlen(rng)
    print("test_blend_attention: all passed")
