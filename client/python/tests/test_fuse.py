"""Fuse sessions through the Python binding, checked on invariants of the fuse (DESIGN.md,
"Fuse semantics"); the full NumPy reference lives in tests/integration/test_fuse.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvblend

M = kvblend.Model("fuse-neox", num_layers=5, num_kv_heads=2, head_dim=16, dtype="f16")
TA, TB, NF = 8, 6, 3  # chunk A, chunk B, fresh tokens


@pytest.fixture(scope="module")
def chunks(daemon):
    """Two chunks, each prefilled alone at positions 0.., stored."""
    rng = np.random.default_rng(5)
    with kvblend.Client(daemon.endpoint) as c:
        c.model_register(M)
        out = []
        for t, ids in ((TA, range(10, 10 + TA)), (TB, range(50, 50 + TB))):
            kv = rng.standard_normal(M.kv_shape(t)).astype(np.float16)
            h = kvblend.chunk_hash(ids)
            c.put(M.name, h, kv, base_pos=0)
            out.append((h, kv))
    return out


def stored_at(c, chunks, positions, layer):
    """Stored K and V of the chunks moved to their new positions, by get_rerotated."""
    ks, vs = [], []
    for (h, _), pos in zip(chunks, positions):
        kv = c.get_rerotated(M.name, h, pos, layers=(layer, layer + 1))
        ks.append(kv[0, 0])
        vs.append(kv[0, 1])
    return np.concatenate(ks), np.concatenate(vs)


def landing_prompt(chunks, seed):
    """Chunk A at 0, NF fresh tokens, chunk B: the segments, the prompt's length, and the
    node's K and V of every token [layers, 2, n, heads, head_dim] (f16, from seed)."""
    (ha, _), (hb, _) = chunks
    n = TA + NF + TB
    segs = [(ha, 0), (NF, TA), (hb, TA + NF)]
    new = np.random.default_rng(seed).standard_normal((M.num_layers, 2, n, 2, 16))
    return segs, n, new.astype(np.float16)


def run(session, new, use_out=True, reuse=False):
    """Drive a session over every layer from its first check layer; fused layers by index."""
    fused = {}
    first = session.next_layer
    while not session.done:
        layer = session.next_layer
        rows = session.rows()
        k_out = np.empty((session.tokens, M.num_kv_heads, M.head_dim), np.float16)
        v_out = np.empty_like(k_out)
        got = session.layer(
            layer,
            new[layer, 0, rows],
            new[layer, 1, rows],
            k_out if use_out else None,
            v_out if use_out else None,
        )
        assert got == (reuse or layer > first), f"layer {layer}: fused {got}"
        if got:
            view = session.output()
            if view is not None:
                kv_ring, vv_ring = view
                assert not kv_ring.flags.writeable
                if use_out:
                    assert np.array_equal(kv_ring, k_out) and np.array_equal(vv_ring, v_out)
                k_out, v_out = kv_ring.copy(), vv_ring.copy()
            fused[layer] = (k_out, v_out)
    return fused


def test_ratio_one_gives_new_everywhere(client, chunks):
    (ha, _), (hb, _) = chunks
    segs = [
        kvblend.Segment.chunk(ha, 0),
        kvblend.Segment.chunk(hb, TA),
        kvblend.Segment.fresh(NF, TA + TB),
    ]
    n = TA + TB + NF
    new = np.random.default_rng(1).standard_normal((M.num_layers, 2, n, 2, 16))
    new = new.astype(np.float16)
    with client.fuse_open(M.name, segs, [1], [1.0]) as s:
        assert s.tokens == n and s.next_layer == 1
        assert np.array_equal(s.rows(), np.arange(n))
        fused = run(s, new)
        assert sorted(fused) == [2, 3, 4]
        for layer, (k, v) in fused.items():
            assert np.array_equal(k, new[layer, 0]) and np.array_equal(v, new[layer, 1]), layer
    assert isinstance(s.stats, dict) and s.stats


def test_ratio_zero_without_fresh_gives_stored_rerotated(client, chunks):
    (ha, _), (hb, _) = chunks
    pa, pb = 4, 30  # away from where they were stored: the keys must turn
    n = TA + TB
    new = np.random.default_rng(2).standard_normal((M.num_layers, 2, n, 2, 16))
    new = new.astype(np.float16)
    with client.fuse_open(M.name, [(ha, pa), (hb, pb)], [1], [0.0]) as s:
        fused = run(s, new)
        assert len(s.rows()) == 0
    for layer, (k, v) in fused.items():
        ks, vs = stored_at(client, chunks, (pa, pb), layer)
        assert k.tobytes() == ks.tobytes(), f"layer {layer} K"
        assert v.tobytes() == vs.tobytes(), f"layer {layer} V"
        assert not np.array_equal(k[:TA], chunks[0][1][layer, 0])  # really re-rotated


def test_selection_is_top_deviation_and_merge(client, frames_client, chunks):
    """Ratio 0.5 at layer 2: the HKVD tokens are the 7 cached tokens whose V moved most,
    plus the fresh ones; fused rows are NEW for those and stored re-rotated for the rest.
    Run over shared memory (ring views) and over frames (k_out, v_out): same bytes."""
    (ha, _), (hb, _) = chunks
    pos = (0, TA)
    n, ncached = TA + TB + NF, TA + TB
    rng = np.random.default_rng(3)
    new = np.empty((M.num_layers, 2, n, 2, 16), np.float16)
    for layer in range(M.num_layers):
        ks, vs = stored_at(client, chunks, pos, layer)
        # Deviation grows with a per-token scale far apart between tokens: no near-ties.
        scale = rng.permutation(ncached)[:, None, None] * 0.05 + 0.05
        new[layer, 0, :ncached] = ks + rng.standard_normal(ks.shape) * scale
        new[layer, 1, :ncached] = vs + rng.standard_normal(vs.shape) * scale
        new[layer, :, ncached:] = rng.standard_normal((2, NF, 2, 16))
    _, vs2 = stored_at(client, chunks, pos, 2)
    dev = ((new[2, 1, :ncached].astype(np.float64) - vs2.astype(np.float64)) ** 2).sum((1, 2))
    k = int(0.5 * ncached)
    want = np.sort(
        np.concatenate([np.argsort(-dev, kind="stable")[:k], np.arange(ncached, n)])
    ).astype(np.int32)
    segs = [(ha, 0), (hb, TA), (NF, TA + TB)]
    results = []
    for c, use_out in ((client, False), (frames_client, True)):
        with c.fuse_open(M.name, segs, [2], [0.5], metric="value") as s:
            assert s.next_layer == 2
            fused = run(s, new, use_out=use_out)
            assert np.array_equal(s.rows(), want)
            if c is frames_client:
                assert s.output() is None  # no shared ring without shared memory
        results.append(fused)
        for layer in (3, 4):
            fk, fv = fused[layer]
            ks, vs = stored_at(client, chunks, pos, layer)
            rest = np.setdiff1d(np.arange(n), want)
            assert np.array_equal(fk[want], new[layer, 0, want])
            assert np.array_equal(fv[want], new[layer, 1, want])
            assert fk[rest].tobytes() == ks[rest].tobytes()
            assert fv[rest].tobytes() == vs[rest].tobytes()
    for layer in (3, 4):
        assert all(np.array_equal(a, b) for a, b in zip(results[0][layer], results[1][layer]))


def test_fuse_device_where_there_is_no_gpu(daemon, chunks):
    """Fused layers on the GPU need a driver here and a daemon on a CUDA device; short of
    either, fuse_device() says why or the session stays in host memory, fusing as before."""
    segs, _, new = landing_prompt(chunks, 8)
    with kvblend.Client(daemon.endpoint, timeout_ms=10000) as c:
        with kvblend.Client(daemon.endpoint, timeout_ms=10000) as ref:
            want = run(ref.fuse_open(M.name, segs, [1], [0.3]), new)
        try:
            c.fuse_device()
        except kvblend.KvblendError as e:
            assert e.name == "ENODEV" and "fused layers on the GPU" in str(e), e
        s = c.fuse_open(M.name, segs, [1], [0.3])
        assert not s.on_device  # this daemon fuses on its CPU
        got = run(s, new, use_out=False)
        assert s.output_device() is None
        assert sorted(got) == sorted(want)
        for layer, (k, v) in want.items():
            assert np.array_equal(got[layer][0], k) and np.array_equal(got[layer][1], v)


def test_session_errors(client, chunks):
    (ha, _), (hb, _) = chunks
    absent = os.urandom(32)
    with pytest.raises(kvblend.NotFound) as e:
        client.fuse_open(M.name, [(ha, 0), (absent, TA)], [1], [0.2])
    assert e.value.missing == [absent] and e.value.name == "not_found"
    with pytest.raises(kvblend.UnknownModel):
        client.fuse_open("no-model", [(ha, 0)], [1], [0.2])
    with pytest.raises(kvblend.BadArgument):
        client.fuse_open(M.name, [(ha, 0)], [1, 2], [0.2])
    s = client.fuse_open(M.name, [(ha, 0), (hb, TA)], [1], [0.2])
    n = s.tokens
    kv = np.zeros((n, 2, 16), np.float16)
    # Wrong layer: the daemon's error, and the session is as it was.
    with pytest.raises(kvblend.KvblendError) as e:
        s.layer(3, kv, kv)
    assert e.value.code < -1000 and e.value.message
    with pytest.raises(kvblend.BadArgument, match="must be"):
        s.layer(1, kv[:-1], kv[:-1])
    # Same byte count, wrong element type or wrong shape: refused, not reinterpreted.
    with pytest.raises(kvblend.BadArgument, match="of f16, got .* int16"):
        s.layer(1, kv.view(np.int16), kv)
    with pytest.raises(kvblend.BadArgument, match=r"got \(\d+, 2, 16\) of float32"):
        s.layer(1, np.zeros((n // 2, 2, 16), np.float32), kv)
    with pytest.raises(kvblend.BadArgument, match="must be"):
        s.layer(1, kv.reshape(n, 16, 2), kv)
    s.layer(1, kv.reshape(n, 32), kv)  # [rows, heads * dim] is the same rows
    s.close()
    s = client.fuse_open(M.name, [(ha, 0), (hb, TA)], [1], [0.2])
    # The chunk is in use: it cannot be deleted under the session.
    with pytest.raises(kvblend.Busy) as e:
        client.delete(M.name, ha)
    assert e.value.name == "busy"
    assert s.layer(1, kv, kv) is False
    assert s.output() is None  # no fused layer at the first check layer
    stats = s.close()
    assert s.close() == stats  # idempotent
    with pytest.raises(kvblend.BadArgument, match="closed"):
        s.layer(2, kv, kv)
    assert client.lookup(M.name, [ha])[0].found


def test_client_close_closes_sessions(daemon, chunks):
    (ha, _), _ = chunks
    c = kvblend.Client(daemon.endpoint)
    s = c.fuse_open(M.name, [(ha, 0)], [1], [0.5])
    c.close()
    with pytest.raises(kvblend.BadArgument):
        s.rows()
    with kvblend.Client(daemon.endpoint) as c2:  # the chunk is free again
        assert c2.lookup(M.name, [ha])[0].found


def landing_run(c, session, new, k, v, strided=None):
    """Drive a landing session as an engine does; k, v are its cache (views in a region)."""
    n = session.tokens
    first = session.check_layers[0] if session.check_layers else -1
    plane = 0 if session.metric == "key" else 1
    for layer in range(M.num_layers):
        rows = session.rows()
        if layer <= first:
            k[layer, :n], v[layer, :n] = new[layer, 0], new[layer, 1]
            session.wait(layer, timeout=0)
        else:
            session.wait(layer, timeout=10)
            k[layer, rows], v[layer, rows] = new[layer, 0, rows], new[layer, 1, rows]
        if layer in session.check_layers:
            if strided is not None:
                # a fused QKV output [rows, q | k | v] in the region: the V slice is strided
                qkv = strided[: len(rows) * 3 * M.row_bytes].view(np.float16)
                qkv = qkv.reshape(len(rows), 3, M.num_kv_heads, M.head_dim)
                qkv[:, 2 if plane else 1] = new[layer, plane, rows]
                metric_rows = qkv[:, 2 if plane else 1]
            else:
                metric_rows = new[layer, plane, rows]
            dropped = session.check(layer, metric_rows)
            after = session.rows()
            assert np.array_equal(dropped, np.setdiff1d(rows, after))
    return session.close()


@pytest.mark.parametrize("metric", ["value", "key"])
def test_landing_matches_classic(client, chunks, metric):
    """The node's cache after a landing session == the classic session's fused layers."""
    segs, n, new = landing_prompt(chunks, 7)
    with client.fuse_open(M.name, segs, [1, 3], [0.5, 0.25], metric) as s:
        fused = run(s, new)
    region = client.region(2 * M.num_layers * n * M.row_bytes + 3 * n * M.row_bytes)
    cache = region[: 2 * M.num_layers * n * M.row_bytes].view(np.float16)
    cache = cache.reshape(2, M.num_layers, n, M.num_kv_heads, M.head_dim)
    qkv = region[2 * M.num_layers * n * M.row_bytes :]
    for strided in (None, qkv):
        cache[:] = 0
        s = client.fuse_open_into(M.name, segs, cache[0], cache[1], [1, 3], [0.5, 0.25], metric)
        assert isinstance(s, kvblend.LandingSession)
        stats = landing_run(client, s, new, cache[0], cache[1], strided)
        assert stats["layers_landed"] == M.num_layers - 2
        for layer in range(2):
            assert np.array_equal(cache[0, layer], new[layer, 0])
        for layer, (kf, vf) in fused.items():
            assert np.array_equal(cache[0, layer], kf), f"layer {layer} K"
            assert np.array_equal(cache[1, layer], vf), f"layer {layer} V"
    client.free_region(region)


def test_landing_paged_and_reuse_only(client, chunks):
    """A paged cache (K and V interleaved per block, blocks shuffled) and reuse-only."""
    segs, n, new = landing_prompt(chunks, 8)
    page, blocks = 4, 8
    pages = np.array([5, 2, 7, 0, 3, 1], np.uint32)[: -(-n // page)]
    shape = (M.num_layers, blocks, 2, page, M.num_kv_heads, M.head_dim)
    region = client.region(int(np.prod(shape)) * 2)
    cache = region.view(np.float16).reshape(shape)
    k, v = cache[:, :, 0], cache[:, :, 1]

    def flat(x, layer):  # the prompt's tokens of one layer of a paged view
        return np.concatenate([x[layer, b] for b in pages])[:n]

    class Flat:
        def __init__(self, x):
            self.x = x

        def __getitem__(self, key):
            layer, idx = key
            return flat(self.x, layer)[idx]

        def __setitem__(self, key, val):
            layer, idx = key
            t = np.arange(n)[idx]
            for i, tok in enumerate(np.atleast_1d(t)):
                row = np.asarray(val).reshape(-1, 2, 16)[i]
                self.x[layer, pages[tok // page], tok % page] = row

    with client.fuse_open(M.name, segs, [1, 3], [0.5, 0.25]) as s:
        fused = run(s, new)
    s = client.fuse_open_into(M.name, segs, k, v, [1, 3], [0.5, 0.25], pages=pages)
    landing_run(client, s, new, Flat(k), Flat(v))
    for layer, (kf, vf) in fused.items():
        assert np.array_equal(flat(k, layer), kf) and np.array_equal(flat(v, layer), vf)
    # reuse only: every layer lands; the node computes the fresh tokens, from layer 0
    with client.fuse_open(M.name, segs, [], []) as s:
        assert s.next_layer == 0 and list(s.rows()) == list(range(TA, TA + NF))
        fused = run(s, new, reuse=True)
    cache[:] = 0
    s = client.fuse_open_into(M.name, segs, k, v, pages=pages)
    assert list(s.rows()) == list(range(TA, TA + NF))
    with pytest.raises(kvblend.BadArgument, match="layer"):
        s.layer(0, None, None)
    landing_run(client, s, new, Flat(k), Flat(v))
    for layer in range(M.num_layers):
        kf, vf = fused[layer]
        assert np.array_equal(flat(k, layer), kf) and np.array_equal(flat(v, layer), vf)
    client.free_region(region)


def test_landing_transposed_k(client, chunks):
    """vLLM's CPU layout: per block and head, K transposed [head_dim, page], then V rows."""
    segs, n, new = landing_prompt(chunks, 9)
    page, blocks, hd, h = 8, 4, M.head_dim, M.num_kv_heads
    pages = np.array([2, 0, 3], np.uint32)
    raw_shape = (M.num_layers, blocks, h, 2, page * hd)
    region = client.region(int(np.prod(raw_shape)) * 2)
    raw = region.view(np.float16).reshape(raw_shape)
    e, ls, bs_ = 2, raw.strides[0], raw.strides[1]
    view = (M.num_layers, blocks, page, h, hd)
    k = np.lib.stride_tricks.as_strided(
        raw[..., 0, :], view, (ls, bs_, e, raw.strides[2], page * e)
    )
    v = np.lib.stride_tricks.as_strided(raw[..., 1, :], view, (ls, bs_, hd * e, raw.strides[2], e))

    def flat(x, layer):
        return np.concatenate([x[layer, b] for b in pages])[:n]

    with client.fuse_open(M.name, segs, [], []) as s:
        fused = run(s, new, reuse=True)
    s = client.fuse_open_into(M.name, segs, k, v, pages=pages)
    for layer in range(M.num_layers):
        s.wait(layer, timeout=10)
        for t in s.rows():
            k[layer, pages[t // page], t % page] = new[layer, 0, t]
            v[layer, pages[t // page], t % page] = new[layer, 1, t]
    assert s.close()["layers_landed"] == M.num_layers
    for layer in range(M.num_layers):
        kf, vf = fused[layer]
        assert np.array_equal(flat(k, layer), kf), f"layer {layer} K"
        assert np.array_equal(flat(v, layer), vf), f"layer {layer} V"
    # K is where vLLM reads it: element d of token s of a block at d * page + s
    kf = fused[2][0]
    assert np.array_equal(raw[2, pages[0], 1, 0, 3 * page + 5], kf[5, 1, 3])
    client.free_region(region)


def test_landing_layout_errors(client, chunks):
    (ha, _), _ = chunks
    region = client.region(2 * M.num_layers * TA * M.row_bytes)
    cache = region.view(np.float16).reshape(2, M.num_layers, TA, 2, 16)
    heap = np.zeros_like(cache)
    with pytest.raises(kvblend.BadArgument, match="region"):
        client.fuse_open_into(M.name, [(ha, 0)], heap[0], heap[1], [1], [0.5])
    with pytest.raises(kvblend.BadArgument, match="shape"):
        client.fuse_open_into(M.name, [(ha, 0)], cache[0, 1:], cache[1, 1:], [1], [0.5])
    ints = region.view(np.int16).reshape(cache.shape)
    with pytest.raises(kvblend.BadArgument, match="elements of f16 .got int16"):
        client.fuse_open_into(M.name, [(ha, 0)], ints[0], ints[1], [1], [0.5])
    s = client.fuse_open_into(M.name, [(ha, 0)], cache[0], cache[1], [1], [0.5])
    s.wait(0)
    rows = s.rows()
    plane = np.zeros((len(rows), 2, 16), np.float16)
    with pytest.raises(kvblend.BadArgument, match="rows must be .* got .* int16"):
        s.check(1, plane.view(np.int16))
    with pytest.raises(kvblend.BadArgument, match="rows must be"):
        s.check(1, plane.reshape(len(rows), 16, 2))
    s.close()
    client.free_region(region)
