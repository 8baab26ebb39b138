#!/usr/bin/env python3
"""End-to-end fuse through the real kvblendd and the kvblend CLI, checked against a
NumPy reference of CacheBlend's fuse (docs/DESIGN.md, "Fuse semantics"): RoPE
re-rotation, HKVD selection with gradual filtering, merge; and get-rerotated. Models
registered with a store codec (int8, fp8, int4) are checked against a NumPy
quantizer written from store/quant.h: GET returns its dequantized KV bit for bit,
within the codec's bound of what was PUT, and the fuse is that KV re-rotated.

usage: python3 -m pytest tests/integration/test_fuse.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import os
import tempfile

import numpy as np

import kvbtest
# The references are eval/'s (tests/pytest.ini puts eval/ on the path): kvref.py (RoPE,
# dtypes, selection, the store's quantizers) and, for the attention metric, cacheblend.py.
from cacheblend import attention_select, select_count
from kvref import (EPS, from_dtype, ref_dequantize, ref_inv_freq, ref_rotate, ref_select,
                   to_dtype)


def test_fuse(kvblendd, kvblend):

    TMP = tempfile.mkdtemp(prefix="kvb-fuse-")
    check = kvbtest.Checks()
    # KVBLEND_TEST_DEVICE (tests/gpu_run.sh): the daemon's --device, for the parity suite.
    DEVICE = ["--device",
              os.environ["KVBLEND_TEST_DEVICE"]] if os.environ.get("KVBLEND_TEST_DEVICE") else []
    daemon = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "1G", "--log-level", "debug",
                            *DEVICE)

    def cli(*args, ok=True):
        return daemon.cli(*args, ok=ok)

    MODELS = [
        # name, layers, kv heads, head_dim, dtype, theta, style, rotary_dim, scaling, keys pre-RoPE
        ("neox-f16", 6, 2, 16, "f16", 10000.0, "neox", 16, "none", False),
        ("gptj-bf16-llama3", 5, 2, 16, "bf16", 500000.0, "gptj", 16, "llama3:8,1,4,64", False),
        ("partial-f32-yarn", 5, 3, 16, "f32", 10000.0, "neox", 8, "yarn:4,64", False),
        ("dyn-f16-prerope", 5, 2, 16, "f16", 10000.0, "neox", 16, "dynamic:2,64", True),
        # An ordinary model shape (issue 7): bf16 rows of 2 KiB, whose small frames of fresh
        # rows the daemon may receive at odd addresses.
        ("wide-bf16", 6, 8, 128, "bf16", 1000000.0, "neox", 128, "none", False),
        # Quantized storage (docs/storage.md): the reference is the dequantized KV.
        ("neox-f16-int8", 5, 2, 16, "f16", 10000.0, "neox", 16, "none", False, "int8"),
        ("gptj-bf16-fp8", 5, 2, 16, "bf16", 500000.0, "gptj", 16, "llama3:8,1,4,64", False, "fp8"),
        ("neox-f32-int4", 5, 3, 16, "f32", 10000.0, "neox", 8, "yarn:4,64", False, "int4:8"),
        ("wide-f16-int4", 6, 8, 128, "f16", 1000000.0, "neox", 128, "none", False, "int4"),
        # Local layers (Gemma 3's): every third layer full, rotated with base 1e6 and its
        # linear scaling; the others with base 1e4 and no scaling (--rope-local-theta,
        # --full-every). Partial rotary, bf16, and an int8 store.
        ("local-bf16", 6, 2, 16, "bf16", 1000000.0, "neox", 8, "linear:8", False, "dtype",
         (10000.0, 3)),
        ("local-f16-int8", 5, 1, 32, "f16", 1000000.0, "neox", 32, "none", False, "int8",
         (10000.0, 2)),
    ]

    # Largest error of a codec relative to the tensor's scale (quant.h bounds, generously).
    BOUND = {"int8": 1 / 127, "fp8": 1 / 16, "int4": 1 / 15}

    class Model:
        def __init__(self, row, rng):
            (self.name, self.L, self.H, self.D, self.dt, self.theta, self.style, self.R,
             self.scaling, self.pre) = row[:10]
            self.store = row[10] if len(row) > 10 else "dtype"
            self.local = row[11] if len(row) > 11 else None  # (local base, full_every)
            args = ["model", "add", self.name, "--layers", self.L, "--kv-heads", self.H,
                    "--head-dim", self.D, "--dtype", self.dt, "--rope-theta", self.theta,
                    "--rope-style", self.style, "--rotary-dim", self.R, "--rope-scaling",
                    self.scaling, "--store", self.store]
            if self.local:
                args += ["--rope-local-theta", self.local[0], "--full-every", self.local[1]]
            cli(*(args + (["--k-pre-rope"] if self.pre else [])))
            # Chunks as a node stores them: prefilled alone, keys rotated at base_pos..
            self.chunks = []
            for ci, (T, base) in enumerate([(23, 0), (17, 5), (31, 0)]):
                k0 = rng.standard_normal((self.L, T, self.H, self.D))
                v = rng.standard_normal((self.L, T, self.H, self.D))
                ks = k0 if self.pre else np.stack(
                    [self.rope(k0[l], l, base, base + T) for l in range(self.L)])
                kv = np.stack([to_dtype(ks, self.dt), to_dtype(v, self.dt)], axis=1)
                np.save(f"{TMP}/c{ci}.npy", kv)
                np.save(f"{TMP}/ids{ci}.npy", np.arange(1000 * (ci + 1), 1000 * (ci + 1) + T))
                h = cli("put", "--model", self.name, "--kv", f"{TMP}/c{ci}.npy", "--tokens",
                        f"{TMP}/ids{ci}.npy", "--pos", base).stdout.split()[0]
                if self.store != "dtype":
                    # what the store holds: the reference below works from it
                    deq = ref_dequantize(kv, self.dt, self.store)
                    cli("get", "--model", self.name, "--hash", h, "--out", f"{TMP}/g.npy")
                    got = np.load(f"{TMP}/g.npy")
                    check(f"{self.name} chunk {ci}: GET is the NumPy dequantized KV",
                          np.array_equal(got, deq),
                          f"{int((got != deq).sum())} of {got.size} elements differ")
                    x, y = from_dtype(kv, self.dt), from_dtype(got, self.dt)
                    span = np.abs(x).max() * 2
                    check(f"{self.name} chunk {ci}: within the codec's bound",
                          np.abs(x - y).max() <= BOUND[self.store.split(":")[0]] * span,
                          f"max error {np.abs(x - y).max():.4g} of range {span:.4g}")
                    kv = deq
                self.chunks.append(dict(T=T, base=base, kv=kv, hash=h))

        def rope_of(self, l):
            """Layer l's RoPE base and scaling: a local layer's is its own base, unscaled."""
            if self.local and (l + 1) % self.local[1]:
                return self.local[0], "none"
            return self.theta, self.scaling

        def rope(self, x, l, pos0, seq_len):
            inv, af = ref_inv_freq(self.R, *self.rope_of(l), seq_len)
            t = np.arange(x.shape[0], dtype=np.float64)[:, None]
            return ref_rotate(x, (pos0 + t) * inv[None, :], af, self.R, self.style)

        def rerotated(self, c, l, pos, seq_len):
            """Chunk c's layer-l stored keys moved to pos.., in float64, from the stored values."""
            sk = from_dtype(c["kv"][l, 0], self.dt)
            inv_o, af_o = ref_inv_freq(self.R, *self.rope_of(l), c["base"] + c["T"])
            inv_n, af_n = ref_inv_freq(self.R, *self.rope_of(l), seq_len)
            t = np.arange(c["T"], dtype=np.float64)[:, None]
            if self.pre:
                return ref_rotate(sk, (pos + t) * inv_n[None, :], af_n, self.R, self.style)
            ang = (pos + t) * inv_n[None, :] - (c["base"] + t) * inv_o[None, :]
            return ref_rotate(sk, ang, af_n / af_o, self.R, self.style)

    class Prompt:
        """A layout: ("c", chunk index, pos) and ("f", count, pos) segments, in token order."""

        def __init__(self, m, layout, rng):
            self.m, self.layout = m, layout
            self.seq_len = max(p + (m.chunks[i]["T"] if k == "c" else i) for k, i, p in layout)
            self.cached, self.fresh, self.spans = [], [], []
            n = 0
            for k, i, p in layout:
                cnt = m.chunks[i]["T"] if k == "c" else i
                (self.cached if k == "c" else self.fresh).extend(range(n, n + cnt))
                if k == "c":
                    self.spans.append((m.chunks[i], n, p))
                n += cnt
            self.N = n
            # The node's fresh KV: stored KV plus noise whose size differs per token, so that
            # deviations lie far apart (no near-ties); fresh tokens random.
            scale = rng.permutation(n).astype(np.float64) * 0.02 + 0.05
            new = np.zeros((m.L, 2, n, m.H, m.D))
            for l in range(m.L):
                K, V = self.stored(l)
                noise = rng.standard_normal((2, n, m.H, m.D)) * scale[None, :, None, None]
                new[l, 0] = K + noise[0]
                new[l, 1] = V + noise[1] * (1.0 + 0.3 * l)
                for j in self.fresh:
                    new[l, :, j] = rng.standard_normal((2, m.H, m.D))
            self.newq = to_dtype(new, m.dt)
            self.new = from_dtype(self.newq, m.dt)

        def stored(self, l):
            m = self.m
            K = np.zeros((self.N, m.H, m.D))
            V = np.zeros((self.N, m.H, m.D))
            for c, off, p in self.spans:
                K[off:off + c["T"]] = m.rerotated(c, l, p, self.seq_len)
                V[off:off + c["T"]] = from_dtype(c["kv"][l, 1], m.dt)
            return K, V

        def args(self):
            a = []
            for k, i, p in self.layout:
                a += ["--chunk", f"{self.m.chunks[i]['hash']}@{p}"] if k == "c" else \
                    ["--fresh", f"{i}@{p}"]
            return a

        def reference(self, checks, ratios, metric):
            m, S, out, sel = self.m, list(range(self.N)), self.new.copy(), None
            for l in range(checks[0], m.L):
                K, V = self.stored(l)
                if l > checks[0]:
                    keep = np.ones(self.N, bool)
                    keep[S] = False
                    out[l, 0, keep] = K[keep]
                    out[l, 1, keep] = V[keep]
                if l in checks:
                    i = checks.index(l)
                    a = self.new[l, 1 if metric == "value" else 0]
                    # the stored side as the daemon holds it: rounded to the dtype
                    b = from_dtype(to_dtype(V if metric == "value" else K, m.dt), m.dt)
                    dev = ((a - b) ** 2).sum(axis=(1, 2))
                    cand = np.array([j for j in S if j not in self.fresh], dtype=np.int64)
                    S = list(ref_select(cand, dev[cand], ratios[i], len(self.cached),
                                        np.array(self.fresh, dtype=np.int64)))
                    sel = S
            return out, np.array(sel, dtype=np.int32)

        def stored_exact(self, l):
            """Layer l's stored K and V of the chunk tokens, [chunk tokens, H, D] in the dtype,
            as the daemon re-rotates them (get-rerotated: the same bits where the rotation does
            not depend on the prompt's length, i.e. not for dynamic NTK)."""
            ks, vs = [], []
            for c, off, p in self.spans:
                cli("get-rerotated", "--model", self.m.name, "--hash", c["hash"], "--pos", p,
                    "--layers", f"{l}:{l + 1}", "--out", f"{TMP}/rr1.npy")
                rr = np.load(f"{TMP}/rr1.npy")
                ks.append(rr[0, 0])
                vs.append(rr[0, 1])
            order = np.argsort([off for _, off, _ in self.spans], kind="stable")
            return (np.concatenate([ks[i] for i in order]), np.concatenate([vs[i] for i in order]))

        def attention_reference(self, checks, ratios, a):
            """The selection of the attention metric (eval/cacheblend.py), check after check."""
            cached = np.zeros(self.N, bool)
            cached[self.cached] = True
            ords = np.cumsum(cached) - 1
            fresh = np.array(self.fresh, dtype=np.int64)
            S = np.arange(self.N)
            for l, r in zip(checks, ratios):
                # exact float32 values of the dtype's elements (bf16 comes as raw bits)
                ks, vs = (from_dtype(x, self.m.dt).astype(np.float32) for x in self.stored_exact(l))
                new = from_dtype(self.newq[l], self.m.dt).astype(np.float32)
                cand = S[cached[S]]
                S = attention_select(new[0, cand], new[1, cand], ks[ords[cand]],
                                     vs[ords[cand]], a, cand, ords[cand],
                                     select_count(r, len(self.cached)), fresh)
            return S.astype(np.int32)

        def fuse_attention(self, checks, ratios, rng):
            """--metric attention through the CLI: the selection is the reference's, exactly."""
            m = self.m
            a = rng.exponential(1.0, (len(self.cached), m.H)).astype(np.float32)
            a[0] = 30
            np.save(f"{TMP}/new.npy", self.newq)
            np.save(f"{TMP}/a.npy", a)
            cli("fuse", "--model", m.name, *self.args(), "--new", f"{TMP}/new.npy", "--ratio",
                ",".join(map(str, ratios)), "--check-layers", ",".join(map(str, checks)),
                "--metric", "attention", "--attention", f"{TMP}/a.npy", "--out",
                f"{TMP}/fused.npy", "--selected", f"{TMP}/sel.npy")
            sel = np.load(f"{TMP}/sel.npy")
            want = self.attention_reference(checks, ratios, a)
            check(f"{m.name} attention metric: selection", np.array_equal(sel, want),
                  f"got {sel.tolist()} want {want.tolist()}")
            r = cli("fuse", "--model", m.name, *self.args(), "--new", f"{TMP}/new.npy", "--ratio",
                    "0.3", "--check-layers", "1", "--metric", "attention", "--out",
                    f"{TMP}/fused.npy", ok=False)
            check(f"{m.name} attention metric without --attention", r.returncode == 2 and
                  "--attention A.npy goes with --metric attention" in r.stderr, r.stderr)
            np.save(f"{TMP}/a.npy", a[1:])
            r = cli("fuse", "--model", m.name, *self.args(), "--new", f"{TMP}/new.npy", "--ratio",
                    "0.3", "--check-layers", "1", "--metric", "attention", "--attention",
                    f"{TMP}/a.npy", "--out", f"{TMP}/fused.npy", ok=False)
            check(f"{m.name} attention metric, A one row short", r.returncode == 1 and
                  "needs" in r.stderr, r.stderr)

        def fuse(self, tag, checks, ratios, metric="value"):
            m = self.m
            np.save(f"{TMP}/new.npy", self.newq)
            r = cli("fuse", "--model", m.name, *self.args(), "--new", f"{TMP}/new.npy", "--ratio",
                    ",".join(map(str, ratios)), "--check-layers", ",".join(map(str, checks)),
                    "--metric", metric, "--out", f"{TMP}/fused.npy", "--selected",
                    f"{TMP}/sel.npy", "--json")
            j = json.loads(r.stdout)
            raw = np.load(f"{TMP}/fused.npy")
            got, sel = from_dtype(raw, m.dt), np.load(f"{TMP}/sel.npy")
            want, want_sel = self.reference(checks, ratios, metric)
            name = f"{m.name} {tag}"
            check(f"{name}: selection", np.array_equal(sel, want_sel),
                  f"got {sel.tolist()} want {want_sel.tolist()}")
            check(f"{name}: --json", j["tokens"] == self.N and j["selected"] == len(want_sel) and
                  j["daemon"]["layers_served"] == m.L - checks[0], r.stdout)
            check(f"{name}: layers to the first check layer are NEW",
                  np.array_equal(raw[:checks[0] + 1], self.newq[:checks[0] + 1]))
            # Rows taken from NEW are exact; re-rotated rows are within the dtype's rounding.
            tol = 2 * EPS[m.dt] * (np.abs(want) + 1) + 1e-6
            bad = np.abs(got - want) > tol
            check(f"{name}: fused KV", not bad.any(),
                  f"{bad.sum()} elements off, worst {np.max(np.abs(got - want) / tol):.3g}")
            return raw, sel

    def run_model(m, rng):
        p = Prompt(m, [("c", 1, 3), ("f", 4, 20), ("c", 0, 24), ("c", 2, 47), ("f", 6, 78)], rng)
        p.fuse("two check layers", [2, 3], [0.3, 0.15])
        p.fuse("key metric", [1], [0.25], "key")
        if not m.scaling.startswith("dynamic"):
            p.fuse_attention([1, 3], [0.4, 0.2], rng)
        raw, _ = p.fuse("r = 1", [2], [1.0])
        check(f"{m.name} r = 1: fused equals NEW", np.array_equal(raw, p.newq))
        # r = 0 and no fresh tokens: every layer after the check layer is the stored KV.
        q = Prompt(m, [("c", 2, 0), ("c", 0, 31), ("c", 1, 54)], rng)
        raw, sel = q.fuse("r = 0", [1], [0.0])
        got = from_dtype(raw, m.dt)
        ok = len(sel) == 0
        for l in range(2, m.L):
            K, V = q.stored(l)
            tol = 2 * EPS[m.dt] * (np.abs(K) + 1)
            ok = ok and np.all(np.abs(got[l, 0] - K) <= tol) and np.array_equal(
                raw[l, 1], to_dtype(V, m.dt))
        check(f"{m.name} r = 0: fused is the re-rotated stored KV", ok)
        # get-rerotated: chunk 2's keys moved to position 400; values untouched.
        c = m.chunks[2]
        cli("get-rerotated", "--model", m.name, "--hash", c["hash"], "--pos", 400, "--out",
            f"{TMP}/rr.npy")
        rr = np.load(f"{TMP}/rr.npy")
        ok = True
        for l in range(m.L):
            want = m.rerotated(c, l, 400, 400 + c["T"])
            ok = ok and np.all(np.abs(from_dtype(rr[l, 0], m.dt) - want) <=
                               2 * EPS[m.dt] * (np.abs(want) + 1))
            ok = ok and np.array_equal(rr[l, 1], c["kv"][l, 1])
        check(f"{m.name} get-rerotated", ok)
        if m.H * m.D >= 1024:
            # Three check layers narrowing to a few rows: the later layers' fresh KV comes in
            # frames of a few KiB.
            q = Prompt(m, [("c", 0, 0), ("c", 2, 23), ("c", 1, 54), ("f", 2, 71)], rng)
            q.fuse("three check layers, few rows", [1, 2, 3], [0.15, 0.05, 0.02])

    daemon.start()
    try:
        rng = np.random.default_rng(11)
        for row in MODELS:
            run_model(Model(row, rng), rng)
        # What each store codec holds, and what it saves (raw and stored bytes per codec).
        st = json.loads(cli("stats", "--json").stdout)
        # (tiny tensors: scales and headers weigh)
        for codec, most in (("int8", 0.7), ("fp8", 0.7), ("int4", 0.5)):
            raw = st.get(f"store_{codec}_raw_bytes", 0)
            stored = st.get(f"store_{codec}_stored_bytes")
            check(f"stats: {codec} chunks stored smaller", stored and raw and stored < most * raw,
                  f"raw {raw} stored {stored}")
        check("stats: lossless models counted apart", st.get("store_dtype_chunks", 0) == 3 * 6,
              str(st.get("store_dtype_chunks")))
        if DEVICE:
            # The sessions above kept their rings on the device, which keeps the blocks.
            dev = "cuda" if DEVICE[1].startswith("cuda") else DEVICE[1]
            check(f"stats: sessions ran on the {dev} device", st.get(f"device_{dev}") == 1 and
                  st.get("device_memory_bytes", 0) > 0,
                  str({k: v for k, v in st.items() if k.startswith("device")}))
        # Errors the CLI reports in one line: a missing chunk, a NEW of the wrong shape.
        # (new.npy is the last model's)
        r = cli("fuse", "--model", MODELS[-1][0], "--chunk", "ab" * 32 + "@0", "--new",
                f"{TMP}/new.npy", "--ratio", "0.2", "--check-layers", "1", "--out",
                f"{TMP}/x.npy", ok=False)
        check("fuse of a missing chunk", r.returncode == 1 and "not stored" in r.stderr and
              r.stderr.count("\n") == 1, r.stderr)
    finally:
        rc = daemon.stop()
        check("daemon exits 0", rc == 0, f"status {rc}")
        if check.failed:
            print(daemon.log_text()[-3000:])
        kvbtest.remove(TMP)
    check.done()
