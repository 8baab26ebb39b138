"""Independent NumPy reference of kvblend's blend computations, in float64: RoPE inverse
frequencies for every scaling type (from the papers and the Hugging Face transformers
formulas), rotation, dtype rounding, and HKVD selection. Shared by the blend and fuse tests
(tests/blend/test_blend.py, tests/integration/test_fuse.py) and eval/outliers.py; it lives in
eval/ because tests may import eval/, never the reverse.
"""
import math

import numpy as np

# ---------- reference RoPE ----------

def parse_scaling(spec):
    kind, _, rest = spec.partition(":")
    vals = [float(v) for v in rest.split(",")] if rest else []
    return kind, vals


def ref_inv_freq(dim, theta, spec, seq_len):
    """inv_freq over rotary dim `dim`, and the attention factor."""
    kind, v = parse_scaling(spec)
    j = np.arange(0, dim, 2, dtype=np.float64)
    base = theta
    if kind == "dynamic":
        factor, max_pos = v
        L = max(seq_len, max_pos)
        base = theta * ((factor * L / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** (j / dim))
    af = 1.0
    if kind == "linear":
        inv = inv / v[0]
    elif kind == "llama3":
        factor, low, high, old = v
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        out = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, out)
    elif kind == "yarn":
        factor, orig = v[0], v[1]
        beta_fast, beta_slow = (v[2], v[3]) if len(v) == 4 else (32.0, 1.0)

        def corr(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        inv = (inv / factor) * (1 - extra) + inv * extra
        af = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv, af


def pair_index(D, R, style):
    half = R // 2
    if style == "neox":
        return np.arange(half), np.arange(half) + half
    return np.arange(half) * 2, np.arange(half) * 2 + 1


def ref_rotate(x, angles, scale, R, style):
    """x: [T, H, D] float64; angles: [T, R/2]. Rotate pairs by angle, times scale."""
    i1, i2 = pair_index(x.shape[2], R, style)
    out = x.copy()
    c = np.cos(angles)[:, None, :]
    s = np.sin(angles)[:, None, :]
    a, b = x[:, :, i1], x[:, :, i2]
    out[:, :, i1] = (a * c - b * s) * scale
    out[:, :, i2] = (b * c + a * s) * scale
    return out


# ---------- dtypes ----------

EPS = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7, "f32": 2.0 ** -23}


def to_dtype(x, dt):
    x32 = np.asarray(x, dtype=np.float32)
    if dt == "f16":
        return x32.astype("<f2")
    if dt == "f32":
        return x32.astype("<f4")
    bits = x32.view("<u4").astype(np.uint64)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return r


def from_dtype(a, dt):
    if dt == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def ref_select(cand, dev, ratio, n_cached, always):
    k = 0
    if ratio > 0 and n_cached > 0:
        k = max(1, math.floor(ratio * n_cached))
        k = min(k, n_cached)
    k = min(k, len(cand))
    order = sorted(range(len(cand)), key=lambda i: (-dev[i], cand[i]))
    return np.array(sorted([int(cand[i]) for i in order[:k]] + [int(a) for a in always]),
                    dtype=np.int32)




# ---------- quantized storage (store/quant.h), written from its specification ----------

def _f32(x):
    return np.asarray(x, dtype=np.float32)


def _fp8_round(a):
    """|y| (float32, <= 448 after saturation) to the nearest e4m3 value, ties to even."""
    a = np.minimum(_f32(a), np.float32(448))
    out = np.empty_like(a)
    sub = a < np.float32(2.0 ** -6)
    out[sub] = np.rint(a[sub] * np.float32(512)) / np.float32(512)
    f, e = np.frexp(a[~sub])  # a = f * 2^e, f in [0.5, 1)
    p = np.ldexp(np.float32(1), e - 1).astype(np.float32)
    m = np.rint((a[~sub] / p - np.float32(1)) * np.float32(8))
    out[~sub] = np.minimum((np.float32(1) + m / np.float32(8)) * p, np.float32(448))
    return out


def _sym(x2, axis, top, codec):
    """int8 / fp8 on [T, C] float32 with scales along axis (0: per channel)."""
    amax = np.abs(x2).max(axis=axis, keepdims=True).astype(np.float32)
    s = (amax / np.float32(top)).astype(np.float32)
    s = np.where((amax > 0) & (s == 0), np.float32(2.0 ** -149), s)
    safe = np.where(s > 0, s, np.float32(1))
    y = (x2 / safe).astype(np.float32)
    if codec == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.float32)
    else:
        q = np.copysign(_fp8_round(np.abs(y)), y).astype(np.float32)
    return np.where(s > 0, (q * s).astype(np.float32), np.float32(0))


def _int4(x2, axis, G):
    """int4 on [T, C] float32: groups of G tokens per channel (axis 0) or G channels."""
    T, C = x2.shape
    out = np.empty_like(x2)
    if axis == 0:
        groups = [(slice(t, min(t + G, T)), slice(c, c + 1))
                  for t in range(0, T, G) for c in range(C)]
    else:
        groups = [(slice(t, t + 1), slice(c, min(c + G, C)))
                  for t in range(T) for c in range(0, C, G)]
    for rs, cs in groups:
        x = x2[rs, cs]
        mn, mx = np.float32(x.min()), np.float32(x.max())
        zh = np.float16(mn)
        if np.float32(zh) > mn:
            zh = np.nextafter(zh, np.float16(-np.inf))
        z = np.float32(zh)
        need = np.float32((mx - z) / np.float32(15))
        sh = np.float16(need)
        if np.float32(sh) < need:
            sh = np.nextafter(sh, np.float16(np.inf))
        s = np.float32(sh)
        q = np.clip(np.rint((x - z) / s), 0, 15).astype(np.float32) if s > 0 else \
            np.zeros_like(x)
        out[rs, cs] = (q * s).astype(np.float32) + z
    return out


def ref_dequantize(kv, dt, store):
    """The KV a quantized store returns: kv is [layers, 2, T, H, D] in dtype dt (raw
    arrays as to_dtype gives), store "int8", "fp8", "int4:G" or "dtype"."""
    if store in ("dtype", ""):
        return kv
    codec, _, g = store.partition(":")
    out = np.empty_like(kv)
    L, _, T, H, D = kv.shape
    for l in range(L):
        for p in range(2):
            x2 = from_dtype(kv[l, p], dt).astype(np.float32).reshape(T, H * D)
            axis = 0 if p == 0 else 1  # keys per channel, values per token
            y = _int4(x2, axis, int(g or 32)) if codec == "int4" else \
                _sym(x2, axis, 127 if codec == "int8" else 448, codec)
            out[l, p] = to_dtype(y.reshape(T, H, D), dt)
    return out
