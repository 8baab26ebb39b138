"""The attention metric (question-aware selection, issue 24) and node-given selections
(recompute) through the Python binding and a real kvblendd, against the NumPy reference
in eval/cacheblend.py (attention_select): the daemon's selection must be the reference's,
index for index, in classic and landing sessions; bad A is refused by name and the
session goes on.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvblend
from cacheblend import attention_select, select_count  # eval/, on the path (pyproject.toml)

M = kvblend.Model("attn-neox", num_layers=5, num_kv_heads=3, head_dim=16, dtype="f16")
MF = kvblend.Model("attn-f32", num_layers=4, num_kv_heads=2, head_dim=8, dtype="f32")
TA, TB, NF = 11, 9, 3  # chunk A, fresh tokens between, chunk B


@pytest.fixture(scope="module")
def chunks(daemon):
    """Per model: two chunks prefilled alone at positions 0.., stored."""
    rng = np.random.default_rng(24)
    out = {}
    with kvblend.Client(daemon.endpoint) as c:
        for m in (M, MF):
            c.model_register(m)
            got = []
            for t, ids in ((TA, range(70, 70 + TA)), (TB, range(90, 90 + TB))):
                kv = rng.standard_normal(m.kv_shape(t)).astype(m.np_dtype)
                h = kvblend.chunk_hash([i + 1000 * m.num_kv_heads for i in ids])
                c.put(m.name, h, kv, base_pos=0)
                got.append(h)
            out[m.name] = got
    return out


def layout(m, chunks):
    """Chunk A at 0, NF fresh tokens, chunk B after them: (segments, n, cached mask)."""
    ha, hb = chunks[m.name]
    segs = [(ha, 0), (NF, TA), (hb, TA + NF)]
    n = TA + NF + TB
    cached = np.ones(n, bool)
    cached[TA : TA + NF] = False
    return segs, n, cached


def placed(c, m, chunks, layer):
    """The stored K and V of the prompt's chunk tokens at their new positions (the daemon's
    re-rotation, by get_rerotated), [chunk tokens, heads, d] each, in prompt order."""
    ha, hb = chunks[m.name]
    kv = [
        c.get_rerotated(m.name, h, p, layers=(layer, layer + 1))
        for h, p in ((ha, 0), (hb, TA + NF))
    ]
    return np.concatenate([x[0, 0] for x in kv]), np.concatenate([x[0, 1] for x in kv])


def new_kv(m, n, seed, c, chunks, ties=False):
    """Fresh K and V of every layer: stored + noise of a per-token, per-head scale (or, with
    ties, exactly the stored rows for half the tokens, so that many scores are equal)."""
    rng = np.random.default_rng(seed)
    segs, n, cached = layout(m, chunks)
    new = np.empty((m.num_layers, 2, n, m.num_kv_heads, m.head_dim), m.np_dtype)
    for layer in range(m.num_layers):
        ks, vs = placed(c, m, chunks, layer)
        scale = rng.uniform(0.01, 1.0, (len(ks), 1, 1))
        if ties:
            scale[::2] = 0
        # heads and K against V on scales far apart, as in a real model: the per-head
        # normalisation then changes the order
        head = np.array([1.0, 6.0, 0.3, 2.0])[: m.num_kv_heads, None]
        new[layer, 0, cached] = ks + rng.standard_normal(ks.shape) * scale * head * 5
        new[layer, 1, cached] = vs + rng.standard_normal(vs.shape) * scale * head[::-1]
        new[layer, 0, ~cached] = rng.standard_normal((NF, m.num_kv_heads, m.head_dim))
        new[layer, 1, ~cached] = rng.standard_normal((NF, m.num_kv_heads, m.head_dim))
    return new


def reference(c, m, chunks, new, a, checks, ratios):
    """The selections the daemon must make at each check layer (gradual filtering)."""
    _, n, cached = layout(m, chunks)
    fresh = np.flatnonzero(~cached)
    ords = np.cumsum(cached) - 1  # each token's index among the chunk tokens
    sel = np.arange(n)
    out = []
    for layer, r in zip(checks, ratios):
        ks, vs = placed(c, m, chunks, layer)
        cand = sel[cached[sel]]
        sel = attention_select(
            new[layer, 0, cand],
            new[layer, 1, cand],
            ks[ords[cand]],
            vs[ords[cand]],
            a,
            cand,
            ords[cand],
            select_count(r, int(cached.sum())),
            fresh,
        )
        out.append(sel.astype(np.int32))
    return out


def attention_rows(m, n_cached, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "zero":
        return np.zeros((n_cached, m.num_kv_heads), np.float32)
    if kind == "equal":
        return np.ones((n_cached, m.num_kv_heads), np.float32)
    a = rng.exponential(1.0, (n_cached, m.num_kv_heads)).astype(np.float32)
    a[0] = 40  # a stale attention sink on the first token, as the preview finds
    a[rng.integers(0, n_cached, 4)] = 0
    return a


CASES = [
    # model, check layers, ratios, A, ties in the deviations
    (M, [1], [0.3], "random", False),
    (M, [1, 3], [0.5, 0.25], "random", False),
    (M, [2], [0.4], "equal", True),
    (M, [1], [0.5], "zero", False),
    (MF, [1, 2], [0.6, 0.15], "random", True),
]


@pytest.mark.parametrize("m, checks, ratios, akind, ties", CASES)
def test_attention_selection_is_the_reference(client, chunks, m, checks, ratios, akind, ties):
    segs, n, cached = layout(m, chunks)
    new = new_kv(m, n, 31 + len(checks), client, chunks, ties)
    a = attention_rows(m, int(cached.sum()), 5, akind)
    want = reference(client, m, chunks, new, a, checks, ratios)
    # classic: A with the first check layer's request, kept for the second
    got = []
    with client.fuse_open(m.name, segs, checks, ratios, metric="attention") as s:
        s.attention(a)
        while not s.done:
            layer = s.next_layer
            rows = s.rows()
            s.layer(layer, new[layer, 0, rows], new[layer, 1, rows])
            if layer in checks:
                got.append(s.rows())
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"check layer {checks[i]}: {g} != reference {w}"
    # landing: K then V of each row, packed and as a strided slice of a fused QKV output
    region = kvblend_region(client, m, n)
    cache = region[: 2 * m.num_layers * n * m.row_bytes].view(m.np_dtype)
    cache = cache.reshape(2, m.num_layers, n, m.num_kv_heads, m.head_dim)
    qkv_mem = region[2 * m.num_layers * n * m.row_bytes :]
    for strided in (False, True):
        s = client.fuse_open_into(m.name, segs, cache[0], cache[1], checks, ratios, "attention")
        s.attention(a)
        landed = []
        for layer in range(m.num_layers):
            rows = s.rows()
            if layer in checks:
                kv = np.stack([new[layer, 0, rows], new[layer, 1, rows]], axis=1)
                if strided:
                    q = qkv_mem[: len(rows) * 3 * m.row_bytes].view(m.np_dtype)
                    q = q.reshape(len(rows), 3, m.num_kv_heads, m.head_dim)
                    q[:, 1:] = kv
                    kv = q[:, 1:]
                dropped = s.check(layer, kv)
                assert np.array_equal(dropped, np.setdiff1d(rows, s.rows()))
                landed.append(s.rows())
        s.close()
        for i, (g, w) in enumerate(zip(landed, want)):
            assert np.array_equal(g, w), (
                f"landing ({'strided' if strided else 'packed'}) "
                f"check layer {checks[i]}: {g} != reference {w}"
            )
    client.free_region(region)


def kvblend_region(client, m, n):
    return client.region(2 * m.num_layers * n * m.row_bytes + 3 * n * m.row_bytes)


def test_attention_bad_input(client, chunks):
    """Wrong size, NaN, inf, negative A; A for another metric; a check without A: each
    refused by name, and the session serves the next, right request."""
    segs, n, cached = layout(M, chunks)
    nc = int(cached.sum())
    new = new_kv(M, n, 3, client, chunks)
    good = attention_rows(M, nc, 9, "random")
    with client.fuse_open(M.name, segs, [1], [0.3], metric="attention") as s:
        with pytest.raises(kvblend.BadArgument, match="needs 60"):
            s.attention(np.ones((nc + 1, M.num_kv_heads), np.float32))
        with pytest.raises(kvblend.BadArgument, match=r"A must be \[chunk tokens, 3\]"):
            s.attention(np.ones((nc, 2), np.float32))
        rows = s.rows()
        # no A yet: the check layer refuses
        with pytest.raises(kvblend.BadArgument, match="the attention metric needs A"):
            s.layer(1, new[1, 0, rows], new[1, 1, rows])
        for bad, what in ((np.nan, "nan"), (np.inf, "inf"), (-1.0, "-1")):
            a = good.copy()
            a[7, 2] = bad
            s.attention(a)
            with pytest.raises(kvblend.BadArgument, match=rf"A\[token 7, head 2\] is {what}"):
                s.layer(1, new[1, 0, rows], new[1, 1, rows])
            assert s.next_layer == 1
        s.attention(good)
        s.layer(1, new[1, 0, rows], new[1, 1, rows])
        want = reference(client, M, chunks, new, good, [1], [0.3])[0]
        assert np.array_equal(s.rows(), want)
    with client.fuse_open(M.name, segs, [1], [0.3], metric="value") as s:
        with pytest.raises(kvblend.BadArgument, match="not attention"):
            s.attention(good)


@pytest.mark.parametrize("landing", [False, True])
def test_recompute_is_the_nodes_selection(client, chunks, landing):
    """A session without check layers in which the node recomputes its own tokens: the rows
    are those plus the fresh ones from layer 0, and the fused layers hold them."""
    segs, n, cached = layout(M, chunks)
    new = new_kv(M, n, 4, client, chunks)
    pick = np.array([0, 5, TA + NF + 2, n - 1], np.int32)
    want = np.union1d(pick, np.flatnonzero(~cached)).astype(np.int32)
    if not landing:
        with client.fuse_open(M.name, segs, [], [], recompute=pick) as s:
            assert s.next_layer == 0 and np.array_equal(s.rows(), want)
            for layer in range(M.num_layers):
                k_out = np.empty((n, M.num_kv_heads, M.head_dim), np.float16)
                v_out = np.empty_like(k_out)
                assert s.layer(layer, new[layer, 0, want], new[layer, 1, want], k_out, v_out)
                ks, vs = placed(client, M, chunks, layer)
                rest = np.setdiff1d(np.flatnonzero(cached), pick)
                assert np.array_equal(k_out[want], new[layer, 0, want])
                assert np.array_equal(v_out[want], new[layer, 1, want])
                ords = np.cumsum(cached) - 1
                assert k_out[rest].tobytes() == ks[ords[rest]].tobytes()
                assert v_out[rest].tobytes() == vs[ords[rest]].tobytes()
        return
    region = client.region(2 * M.num_layers * n * M.row_bytes)
    cache = region.view(np.float16).reshape(2, M.num_layers, n, M.num_kv_heads, M.head_dim)
    with client.fuse_open_into(M.name, segs, cache[0], cache[1], recompute=pick) as s:
        assert np.array_equal(s.rows(), want)
        for layer in range(M.num_layers):
            s.wait(layer, timeout=30)
            cache[0, layer, want] = new[layer, 0, want]
            cache[1, layer, want] = new[layer, 1, want]
    for layer in range(M.num_layers):
        ks, vs = placed(client, M, chunks, layer)
        ords = np.cumsum(cached) - 1
        rest = np.setdiff1d(np.flatnonzero(cached), pick)
        assert np.array_equal(cache[0, layer, want], new[layer, 0, want])
        assert cache[0, layer, rest].tobytes() == ks[ords[rest]].tobytes()
        assert cache[1, layer, rest].tobytes() == vs[ords[rest]].tobytes()
    client.free_region(region)


def test_recompute_bad_input(client, chunks):
    segs, n, cached = layout(M, chunks)
    for pick, what in (
        ([TA], "is a fresh token"),
        ([3, 2], "must increase"),
        ([n], "not a token of the"),
        ([-1], "not a token of the"),
    ):
        with pytest.raises(kvblend.BadArgument, match=what):
            client.fuse_open(M.name, segs, [], [], recompute=pick)
    with pytest.raises(kvblend.BadArgument, match="without check layers"):
        client.fuse_open(M.name, segs, [1], [0.5], recompute=[0])
    # the daemon serves the next request
    with client.fuse_open(M.name, segs, [], [], recompute=[1]) as s:
        assert np.array_equal(s.rows(), np.union1d([1], np.flatnonzero(~cached)))
