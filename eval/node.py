"""A serving node that reuses stored chunks through a real kvblendd.

The node is the NumPy model of model.py; kvblendd is the daemon built from this
checkout, started on a temporary directory and IPC socket; they talk through
the Python client (client/python, ctypes over the build's libkvblend).

* ``Daemon`` starts a kvblendd of its own (eval/harness.py's, with a small config
  file) and stops it with SIGTERM.
* ``ChunkStore`` registers the model (f32 by default, the GGUF's RoPE theta and
  style; optionally f16, or a quantized store codec) and stores chunks the way a
  node does: each prefilled alone at its base position and PUT with its KV; it
  also reads them back (as stored, or re-rotated to a new position by the
  daemon: what full reuse and static selection use). ``ensure_chunk`` prefills
  a chunk once and PUTs it into several stores (one per codec).
* ``DaemonFuse`` is the node's side of a fuse session, the one place that drives
  the daemon during a request (see its docstring for the contract).
* ``fuse_forward`` is the node's forward pass around it: every layer up to and
  including the first check layer for all tokens, then Q/K/V only for the
  selected tokens, attention over the fused KV of all tokens with an exact
  causal mask in prompt order. ``static_forward`` is full reuse or a static
  selection (EPIC) on chunks re-rotated by the daemon.

Both return the logits at the rows asked for, the fused KV of every layer, the
final selection and the time split: node compute (NumPy, here on the CPU),
time inside client calls, and the daemon's own figures for the session.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import harness
from cacheblend import Request, blend_forward

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-135m-instruct"


def build_dir(build=None):
    """The build directory: the argument, else $KVBLEND_BUILD, else the checkout's build/."""
    return Path(build or os.environ.get("KVBLEND_BUILD") or ROOT / "build").resolve()


def daemon_binary(build=None):
    return build_dir(build) / "bin" / "kvblendd"


def import_kvblend(build=None):
    """Import the Python client from client/python/src with the build's libkvblend.

    $KVBLEND_LIB (what the package reads first) is set to BUILD/lib/libkvblend.so unless
    it is set already and no build directory was given.
    """
    if "kvblend" not in sys.modules:
        if build is not None or not os.environ.get("KVBLEND_LIB"):
            os.environ["KVBLEND_LIB"] = str(build_dir(build) / "lib" / "libkvblend.so")
        src = str(ROOT / "client" / "python" / "src")
        if src not in sys.path:
            sys.path.insert(0, src)
    import kvblend

    return kvblend


class Daemon(harness.Daemon):
    """A kvblendd of this build (build: the build directory, see build_dir) on a temporary
    folder of its own (eval/harness.py's Daemon), the Python client imported over the
    build's libkvblend.

    settings: extra config keys (docs/configuration.md), e.g. fuse_ring=4. A context
    manager; stop() sends SIGTERM and returns the exit status (self.problems: the log's
    warning and error lines); version is what its first ping answered.
    """

    def __init__(self, build=None, **settings):
        self.kvblend = import_kvblend(build)
        binary = daemon_binary(build)
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"kvblendd not found at {binary}; build first")
        conf = {"map_size": "16G", "no_sync": "true", "log_level": "info", "fuse_idle": 600}
        conf.update(settings)
        super().__init__(kvblendd=binary, config=conf, workers=None)
        with self.client(timeout_ms=2000) as c:
            self.version = c.ping()

    def stop(self, timeout=60, keep=False):
        return super().stop(timeout, keep)


class ChunkStore:
    """The node's use of the store: the model registered, chunks prefilled alone and PUT.

    A chunk's hash is kvblend.chunk_hash of its token ids (the same ids at another base
    position would collide; this evaluation stores every chunk at one base per hash).
    dtype: the model's dtype, "f32" (the node's own precision) or "f16" (the node's KV
    rounded to f16 when PUT); store: the model's store codec ("dtype" lossless, "fp8",
    "int8", "int4[:G]"; docs/storage.md). Reads come back as float32 either way.
    """

    DTYPES = {"f32": np.float32, "f16": np.float16}

    def __init__(self, client, model, name=MODEL_NAME, dtype="f32", store="dtype"):
        if dtype not in self.DTYPES:
            raise ValueError(f"dtype {dtype!r}: the node handles f32 and f16")
        self.kvblend = sys.modules["kvblend"]
        self.client, self.model, self.name = client, model, name
        self.dtype, self.np_dtype, self.store = dtype, self.DTYPES[dtype], store
        c = model.cfg
        self.spec = self.kvblend.Model(name, c.n_layers, c.n_kv_heads, c.head_dim, dtype=dtype,
                                       rope_theta=c.rope_theta, rope_style=c.rope_style,
                                       store=store)
        client.model_register(self.spec)
        self.seconds_prefill = self.seconds_put = 0.0

    def has(self, h):
        return self.client.lookup(self.name, [h])[0].found

    def prefill(self, ids, base_pos=0):
        """The chunk's KV prefilled alone at base_pos.. (float32)."""
        t0 = time.perf_counter()
        _, kv = self.model.prefill(ids, pos=np.arange(base_pos, base_pos + len(ids)),
                                   logits_for="last")
        self.seconds_prefill += time.perf_counter() - t0
        return kv

    def put(self, h, kv, base_pos=0):
        """PUT float32 KV kv as chunk h, in the model's dtype (the daemon quantizes)."""
        t0 = time.perf_counter()
        self.client.put(self.name, h, np.ascontiguousarray(kv, self.np_dtype), base_pos=base_pos)
        self.seconds_put += time.perf_counter() - t0

    def ensure(self, ids, base_pos=0):
        """Store chunk ids (prefilled alone at base_pos..) unless it is stored; its hash."""
        return ensure_chunk([self], ids, base_pos)

    def get(self, h):
        """The chunk's KV as stored [layers, 2, T, kv_heads, head_dim], float32."""
        return self.client.get(self.name, h).astype(np.float32, copy=False)

    def stored(self):
        """(tokens, bytes in the model's dtype, bytes stored) over this model's chunks, as the
        daemon lists them (stored bytes: payloads, scales and tensor headers)."""
        info = self.client.list(self.name)
        return (sum(i.num_tokens for i in info), sum(i.raw_bytes for i in info),
                sum(i.stored_bytes for i in info))

    def placed(self, req, hashes):
        """The stored KV of req's chunks moved to their places by the daemon (get-rerotated):
        [layers, 2, N, kv_heads, head_dim] float32, zero for fresh tokens; and seconds in
        the calls."""
        c = self.model.cfg
        out = np.zeros((c.n_layers, 2, req.N, c.n_kv_heads, c.head_dim), np.float32)
        chunks = [(s, T) for kind, s, T in req.spans if kind == "chunk"]
        t = 0.0
        for (s, T), h in zip(chunks, hashes):
            buf = np.empty((c.n_layers, 2, T, c.n_kv_heads, c.head_dim), self.np_dtype)
            t0 = time.perf_counter()
            self.client.get_rerotated(self.name, h, s, out=buf)
            t += time.perf_counter() - t0
            out[:, :, s:s + T] = buf
        return out, t


def ensure_chunk(stores, ids, base_pos=0):
    """Chunk ids in every store of stores (ChunkStores of one model layout, e.g. one per
    codec): prefilled once, when some store lacks it, and PUT into those. Its hash."""
    h = sys.modules["kvblend"].chunk_hash(np.asarray(ids, np.uint32))
    missing = [s for s in stores if not s.has(h)]
    if missing:
        kv = missing[0].prefill(ids, base_pos)
        for s in missing:
            s.put(h, kv, base_pos)
    return h


class DaemonFuse:
    """The node's side of fuse sessions: the one place that drives kvblendd during a request.

    Contract (what an engine-style client API must keep):

    open(segments, check_layers, ratios, metric, kv)
        segments: the prompt in order, (hash, pos) for a stored chunk, (count, pos) for
        fresh tokens. kv: the node's own KV buffer of the request, [layers, 2, N, kv_heads,
        head_dim] float32, C-contiguous. Returns the first check layer c1: the node computes
        layers 0 .. c1-1 for all tokens on its own.
    rows() -> the sorted token indices whose fresh K, V the next layer call needs (all N at
        c1, the selection S after).
    layer(l, k, v) -> the new selection (sorted int64) after a check layer, else None.
        Before the call the node has written its fresh rows for rows() into kv[l] and passes
        the same rows as k, v [len(rows), kv_heads, head_dim] (today both planes are sent;
        an engine API needs only the metric plane at check layers). After the call kv[l] is
        the fused layer: fresh rows for S, the stored rows re-rotated for the others (at c1
        it is the node's own layer). Layers come in order, c1 .. layers-1.
    close() -> the daemon's statistics of the session (a dict; see docs/fuse.md).

    seconds: wall time inside client calls of the current session (open, layer calls,
    close), so the node's own compute is the rest.

    dtype: the model's dtype (ChunkStore). For "f16" the node still computes and keeps
    its own rows in float32: rows go to the daemon rounded to f16 and fused rows come
    back as f16, so only what the store holds is rounded.
    """

    def __init__(self, client, name=MODEL_NAME, dtype="f32"):
        self.client, self.name = client, name
        self.np_dtype = ChunkStore.DTYPES[dtype]
        self.session = None

    def open(self, segments, check_layers, ratios, metric, kv, attention=None, recompute=None):
        """attention: A for the attention metric (float32 [chunk tokens, kv_heads]), sent with
        the first check layer. recompute: no check layers; the cached tokens the node
        recomputes at every layer (its own selection; rows() adds the fresh ones)."""
        t0 = time.perf_counter()
        self.kv, self.checks = kv, list(check_layers)
        self.session = self.client.fuse_open(self.name, segments, self.checks, list(ratios),
                                             metric, recompute=recompute)
        if attention is not None:
            self.session.attention(attention)
        self.seconds = time.perf_counter() - t0
        return self.session.next_layer

    def rows(self):
        return self.session.rows().astype(np.int64)

    def layer(self, l, k, v):
        t0 = time.perf_counter()
        s = self.session
        if self.np_dtype == np.float32:
            s.layer(l, k, v, k_out=self.kv[l, 0], v_out=self.kv[l, 1])
        else:  # the fused layer in the model's dtype, then the node's own rows unrounded
            rows = s.rows()
            ko, vo = (np.empty(self.kv.shape[2:], self.np_dtype) for _ in range(2))
            s.layer(l, k.astype(self.np_dtype), v.astype(self.np_dtype), k_out=ko, v_out=vo)
            self.kv[l, 0], self.kv[l, 1] = ko, vo
            self.kv[l, 0, rows], self.kv[l, 1, rows] = k, v
        sel = s.rows().astype(np.int64) if l in self.checks else None
        self.seconds += time.perf_counter() - t0
        return sel

    def close(self):
        t0 = time.perf_counter()
        stats = self.session.close()
        self.session = None
        self.seconds += time.perf_counter() - t0
        return stats


class LandingFuse(DaemonFuse):
    """DaemonFuse's contract through a landing session (docs/fuse.md): the engine's way.

    The request's KV buffer lives in a region of shared memory (``buffer``; pool: a dict
    in which LandingFuses of one client share their region, one per codec), and the
    daemon writes the re-rotated stored rows of every layer after the first check layer
    into it by itself, ahead of the node. At a check layer the node sends only the
    metric's plane (V, or K for the key metric) of its rows; at every later layer it
    waits for the daemon to have landed the layer, then writes its own rows. Fresh rows
    never travel to the daemon; fused rows never travel back.
    """

    def __init__(self, client, name=MODEL_NAME, dtype="f32", pool=None):
        super().__init__(client, name, dtype)
        self.pool = {} if pool is None else pool  # the region, shared with other fuses

    @property
    def region(self):
        return self.pool.get("region")

    def buffer(self, shape):
        """The request's KV buffer [layers, 2, N, kv_heads, head_dim] float32, in a region
        (reused across requests; valid until the next buffer() or close_region()). For an
        f16 model the region holds an f16 buffer of that shape, where the daemon lands, and
        the node works on a float32 copy of its own (``layer`` copies each landed layer)."""
        n = int(np.prod(shape)) * np.dtype(self.np_dtype).itemsize
        if self.region is None or self.region.nbytes < n:
            self.close_region()
            self.pool["region"] = self.client.region(max(n, 64 << 20))
        self.land = self.region[:n].view(self.np_dtype).reshape(shape)
        if self.np_dtype == np.float32:
            return self.land
        m = int(np.prod(shape))
        if self.pool.get("work") is None or self.pool["work"].size < m:
            self.pool["work"] = np.zeros(m, np.float32)  # reused, as the region is
        return self.pool["work"][:m].reshape(shape)

    def close_region(self):
        if self.region is not None:
            self.client.free_region(self.pool.pop("region"))

    def open(self, segments, check_layers, ratios, metric, kv, attention=None, recompute=None):
        t0 = time.perf_counter()
        self.kv, self.checks, self.metric = kv, list(check_layers), metric
        # K and V of every layer: views with the buffer's strides (interleaved per layer)
        land = self.land  # the buffer() of this request: kv itself, or its f16 twin
        self.session = self.client.fuse_open_into(self.name, segments, land[:, 0], land[:, 1],
                                                  self.checks, list(ratios), metric,
                                                  recompute=recompute)
        if attention is not None:
            self.session.attention(attention)
        self.seconds = time.perf_counter() - t0
        # the layers the node computes whole: up to the first check layer (none when the
        # node gave its selection: every layer lands)
        self.own = self.checks[0] if self.checks else -1
        return self.checks[0] if self.checks else 0

    def layer(self, l, k, v):
        t0 = time.perf_counter()
        s = self.session
        rows = s.rows()
        if l > self.own:
            # The daemon writes every cached row of layer l: the node's rows go in after it.
            s.wait(l, timeout=60)
            if self.kv is not self.land:
                self.kv[l] = self.land[l]
            self.kv[l, 0, rows], self.kv[l, 1, rows] = k, v
        sel = None
        if l in self.checks:
            # the metric's plane; the attention metric reads K then V of each row
            x = (np.stack([k, v], axis=1) if self.metric == "attention" else
                 v if self.metric == "value" else k)
            s.check(l, x.astype(self.np_dtype, copy=False))
            sel = s.rows().astype(np.int64)
        self.seconds += time.perf_counter() - t0
        return sel


def segments_of(req, hashes):
    """req's spans as fuse segments: (hash, start) for chunks, (count, start) for fresh."""
    it = iter(hashes)
    return [(next(it), s) if kind == "chunk" else (T, s) for kind, s, T in req.spans]


def fuse_forward(model, req, hashes, fuse, check_layers, ratios, metric, rows,
                 attention=None, cheap=False, recompute=None):
    """CacheBlend with the daemon doing the fuse: the node's forward pass.

    attention: A for the attention metric. cheap: at a check layer only the newly
    selected (and fresh) rows run attention and MLP; the others needed only their Q, K, V
    (the selection is final when the check call returns). recompute: no check layers, the
    node's own selection of cached tokens, recomputed at every layer from layer 0.
    Returns (logits at rows, fused KV [layers, 2, N, kv_heads, d], final selection,
    timing dict: seconds total / node / calls, and the daemon's session stats).
    """
    c = model.cfg
    t0 = time.perf_counter()
    shape = (c.n_layers, 2, req.N, c.n_kv_heads, c.head_dim)
    kv = fuse.buffer(shape) if hasattr(fuse, "buffer") else np.empty(shape, np.float32)
    c1 = fuse.open(segments_of(req, hashes), check_layers, ratios, metric, kv,
                   attention=attention, recompute=recompute)
    S = np.arange(req.N) if recompute is None else fuse.rows()
    h = model.embed(req.ids[S])
    for l in range(c.n_layers):
        q, k, v = model.qkv(l, h, req.pos[S])
        kv[l, 0, S], kv[l, 1, S] = k, v
        new = fuse.layer(l, k, v) if l >= c1 else None
        if new is not None and cheap:
            i = np.searchsorted(S, new)
            h, S = model.attend(l, h[i], q[i], kv[l, 0], kv[l, 1], new), new
            continue
        h = model.attend(l, h, q, kv[l, 0], kv[l, 1], S)
        if new is not None:
            h, S = h[np.searchsorted(S, new)], new
    if not np.isin(rows, S).all():
        raise ValueError("logits asked for a token that was not recomputed")
    logits = model.logits(h[np.searchsorted(S, rows)])
    stats = fuse.close()
    total = time.perf_counter() - t0
    return logits, kv, S, {"total": total, "node": total - fuse.seconds,
                           "calls": fuse.seconds, "stats": stats}


def static_forward(model, store, req, hashes, rows, recompute=None):
    """Full reuse (recompute None) or a static selection (EPIC) on chunks the daemon
    re-rotated: get-rerotated per chunk, then only fresh and recompute tokens computed.
    Returns (logits, fused KV, recomputed indices, timing dict)."""
    t0 = time.perf_counter()
    placed, calls = store.placed(req, hashes)
    r = Request(req.segments, None, model.cfg, placed=placed)
    logits, fused, _ = blend_forward(model, r, rows, recompute=recompute)
    total = time.perf_counter() - t0
    sel = np.union1d(np.flatnonzero(~req.cached),
                     np.empty(0, np.int64) if recompute is None else recompute)
    return logits, fused, sel, {"total": total, "node": total - calls, "calls": calls,
                                "stats": {}}
