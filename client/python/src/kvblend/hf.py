"""CacheBlend over a Hugging Face transformers model, driven by a kvblendd fuse session.

The reference path of kvblend's blending: no serving engine, the model's own decoder layer
modules (``input_layernorm``, ``q_proj``/``k_proj``/``v_proj``, the rotary embedding,
``o_proj``, ``post_attention_layernorm``, ``mlp``) run the node's side of CacheBlend while
kvblendd re-rotates the stored chunks, selects the tokens to recompute at the check layers
and merges. Useful on its own for offline RAG jobs, and to debug the blend loop in seconds.

    import kvblend, kvblend.hf, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)
    with kvblend.Client(endpoint) as c:
        b = kvblend.hf.Blender(model, c)
        h1, h2 = b.store(doc1_ids), b.store(doc2_ids)       # prefilled alone, at position 0
        segs = [("fresh", head), ("chunk", doc1_ids), ("chunk", doc2_ids), ("fresh", q)]
        out = b.generate(segs, max_new_tokens=32, check_layers=(1,), ratios=(0.15,))

Supported: the Llama family, ``LlamaForCausalLM`` (SmolLM2, Llama 2/3, TinyLlama),
``MistralForCausalLM``, ``Qwen2ForCausalLM`` (bias on Q, K and V), ``Qwen3ForCausalLM``
(an RMSNorm per head on Q and K before RoPE) and ``Phi3ForCausalLM`` (Q, K and V in one
projection, a partial rotary factor) and ``Qwen3MoeForCausalLM`` (Qwen3's attention, routed
experts as the MLP), in float32 or float16 with the default RoPE, full attention; and
``Gemma3ForCausalLM`` (Gemma 3's text model: Q and K norms, sandwich norms, a scaled
embedding, a sliding window and a RoPE base of their own on its local layers, which the
daemon re-rotates with the model's local base; :mod:`kvblend.blend.arch`), on any device
(rows cross to the daemon through host memory). Anything else is refused with
:class:`Unsupported`.

This module imports torch and transformers; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import describe as _describe
from .blend import arch as _arch
from .blend import host
from .blend.attention import causal_attention
from .blend import metrics as _metrics
from .blend.driver import Batch, Job, close_after_failure, close_all, node_previews, open_job
from .blend.loop import blend_batch
from .client import Client, chunk_hash
from .errors import KvblendError
from .types import Model

#: Architectures whose decoder layers this module drives (:mod:`kvblend.blend.arch`).
SUPPORTED_ARCHITECTURES = tuple(_arch.ARCHITECTURES)
_DTYPES = {
    torch.float32: ("f32", np.float32),
    torch.float16: ("f16", np.float16),
    torch.bfloat16: ("bf16", np.uint16),  # raw bits (kvblend.blend.host)
}


class Unsupported(ValueError):
    """The model is not one kvblend.hf can blend exactly; the message says why."""


def _sliding(cfg: Any) -> bool:
    """Whether any layer attends through a sliding window.

    Mistral's ``sliding_window``, Qwen's ``use_sliding_window``, or ``layer_types``.
    """
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return True
    if hasattr(cfg, "use_sliding_window"):
        return bool(cfg.use_sliding_window and cfg.sliding_window)
    return bool(getattr(cfg, "sliding_window", None))


def _check_model(model: Any) -> _arch.Arch:
    try:
        arch = _arch.check_config(type(model).__name__, model.config, "kvblend.hf")
        _arch.for_hf(model)
    except _arch.ArchRefused as e:
        raise Unsupported(str(e)) from None
    cfg = model.config
    rs = _describe.rope_scaling(cfg) or {}
    rope_types = [rs.get("rope_type", rs.get("type", "default"))]
    if arch.local_layers:  # and each layer type's (Gemma 3's full layers may scale)
        rope_types += [v.get("rope_type", "default")
                       for v in _describe.rope_by_type(cfg).values()]
    for rope_type in rope_types:
        if rope_type != "default":
            raise Unsupported(
                f"kvblend.hf: RoPE type {rope_type!r}; only the default RoPE is handled")
    if not arch.local_layers and _sliding(cfg):
        raise Unsupported("kvblend.hf: sliding-window attention is not handled")
    if model.dtype not in _DTYPES:
        raise Unsupported(f"kvblend.hf: dtype {model.dtype}; float32, float16 or bfloat16")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise Unsupported("kvblend.hf: attention heads not a multiple of the KV heads")
    return arch


def model_spec(model: Any, name: str | None = None) -> Model:
    """Describe an HF model's KV as a kvblend :class:`Model` (keys after RoPE, neox pairs).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported model (:data:`SUPPORTED_ARCHITECTURES`).
    name : str, optional
        The name in the daemon; default ``hf:<name_or_path's last part>:<dtype>``.

    Raises
    ------
    Unsupported
        The architecture, RoPE, attention or dtype is not one this module handles.
    """
    arch = _check_model(model)
    cfg = model.config
    dtype = _DTYPES[model.dtype][0]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if name is None:
        base = str(getattr(cfg, "_name_or_path", "") or "model").rstrip("/").split("/")[-1]
        name = f"hf:{base}:{dtype}"[:64]
    try:
        spec = _describe.describe(
            cfg,
            name=name,
            dtype=dtype,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
        )
    except _describe.Undescribable as e:
        raise Unsupported(f"kvblend.hf: {e}") from None
    if arch.local_layers:
        _check_local_rope(arch, cfg, spec)
    return spec


def _check_local_rope(arch: _arch.Arch, cfg: Any, spec: Model) -> None:
    """Check that ``spec`` re-rotates each layer with the base the model rotates it with.

    The daemon rotates layer l with ``rope_local_theta`` where :meth:`Model.is_local`
    says so, else with ``rope_theta``; the model rotates the layers its attention modules
    call sliding with ``rope_parameters["sliding_attention"]``'s base and the others with
    ``["full_attention"]``'s. :mod:`kvblend.describe` reads the same config; this holds
    its description to the layers transformers runs.

    Raises
    ------
    Unsupported
        The description says another base for a layer.
    """
    by_type = _describe.rope_by_type(cfg)
    types = ["full_attention" if w is None else "sliding_attention"
             for w in _arch.sliding_windows(arch, cfg, "kvblend.hf")]
    local, every = spec.rope_local_theta, spec.full_every
    for i, t in enumerate(types):
        want = float(by_type.get(t, {}).get("rope_theta", spec.rope_theta))
        got = spec.rope_local_theta if spec.is_local(i) else spec.rope_theta
        if got != want:
            raise Unsupported(
                f"kvblend.hf: {arch.name} layer {i} ({t}) is rotated with base {want:g}; its "
                f"kvblend description re-rotates it with {got:g} (rope_theta {spec.rope_theta:g}"
                f", rope_local_theta {local:g}, full_every {every})"
            )


@dataclass
class Blend:
    """The outcome of :meth:`Blender.blend`.

    Attributes
    ----------
    ids : ndarray
        The prompt's token ids [N] (int64).
    kv : torch.Tensor
        The fused KV [layers, 2, N, kv_heads, head_dim] (K after RoPE, then V) in the
        model's dtype, on the CPU: fresh rows for the recomputed tokens, the stored rows
        re-rotated to their positions for the others.
    logits : torch.Tensor
        The next-token logits after the last prompt token [vocab] (float32).
    selections : list of ndarray
        The recomputed token indices after each check layer (sorted int64).
    checked : dict
        With ``keep_checks``: layer -> the metric plane the node sent at that check layer
        ([rows, kv_heads, head_dim], for the rows :attr:`sent` names).
    sent : dict
        With ``keep_checks``: layer -> the token indices whose plane was sent.
    attention : ndarray or None
        The attention metric's A ([chunk tokens, kv_heads] float32, the question's
        preview, :mod:`kvblend.blend.preview`); None for the other metrics.
    session : str
        ``"landing"`` or ``"classic"``: the kind of fuse session that served it.
    stats : dict
        The daemon's statistics of the session (docs/fuse.md).
    seconds : float
        Wall time of the blend pass (node compute and daemon calls).
    """

    ids: np.ndarray
    kv: torch.Tensor
    logits: torch.Tensor
    selections: list = field(default_factory=list)
    checked: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    attention: np.ndarray | None = None
    session: str = "landing"
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0

    def cache(self, model: Any, tokens: int | None = None) -> Any:
        """Return a ``DynamicCache`` holding the fused KV of the first ``tokens`` (default all)."""
        from transformers import DynamicCache

        n = self.kv.shape[2] if tokens is None else tokens
        dev = next(model.parameters()).device
        cache = DynamicCache(config=model.config)
        for layer in range(self.kv.shape[0]):
            k = self.kv[layer, 0, :n].transpose(0, 1).unsqueeze(0).to(dev)
            v = self.kv[layer, 1, :n].transpose(0, 1).unsqueeze(0).to(dev)
            cache.update(k.contiguous(), v.contiguous(), layer)
        return cache


def _segments(segments: Sequence[tuple[str, Any]]) -> tuple[np.ndarray, list]:
    """Return the prompt's ids and spans (kind, start, ids) from ("chunk" | "fresh", ids)."""
    ids, spans, n = [], [], 0
    for i, seg in enumerate(segments):
        if not (isinstance(seg, (tuple, list)) and len(seg) == 2 and seg[0] in ("chunk", "fresh")):
            raise ValueError(f"segment {i}: expected ('chunk' | 'fresh', token ids)")
        t = np.asarray(seg[1], dtype=np.int64).reshape(-1)
        if t.size == 0:
            raise ValueError(f"segment {i}: no tokens")
        spans.append((seg[0], n, t))
        ids.append(t)
        n += t.size
    if not spans:
        raise ValueError("no segments")
    if spans[-1][0] != "fresh":
        raise ValueError(
            "the last segment must be fresh (the question): its last token is computed"
        )
    return np.concatenate(ids), spans


class _HfOps:
    """Layer operations of a transformers model of :data:`SUPPORTED_ARCHITECTURES`.

    The :class:`kvblend.blend.loop.LayerOps` that :func:`kvblend.blend.loop.blend_batch` drives.
    """

    def __init__(self, model: Any, head_dim: int, arch: _arch.Arch) -> None:
        self.model, self.head_dim, self.arch = model, head_dim, arch
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self.device = next(model.parameters()).device
        self.kv_dtype = model.dtype
        # the modeling module's own RoPE (rotate_half, neox pairs)
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        cfg = model.config
        self.qkv_sizes = [cfg.num_attention_heads * head_dim] + [
            cfg.num_key_value_heads * head_dim
        ] * 2
        #: per layer, its sliding window (None: full attention) and, for a model with
        #: local layers, its type (the rotary embedding's cos and sin are per type)
        self.windows = _arch.sliding_windows(arch, cfg, "kvblend.hf")
        self.types = ([None] * self.num_layers if not arch.local_layers else
                      ["full_attention" if w is None else "sliding_attention"
                       for w in self.windows])
        self.cos_of: dict = {}
        self.sin_of: dict = {}

    def begin(self, n: int) -> None:
        pos = torch.arange(n, device=self.device)[None]
        x = torch.empty(1, dtype=self.model.dtype, device=self.device)
        for t in set(self.types):
            kw = {} if t is None else {"layer_type": t}
            cos, sin = self.model.model.rotary_emb(x, position_ids=pos, **kw)
            self.cos_of[t], self.sin_of[t] = cos[0], sin[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def qkv(self, layer: int, h: torch.Tensor, rows: torch.Tensor) -> tuple:
        mod = self.layers[layer]
        attn, d = mod.self_attn, self.head_dim
        x = mod.input_layernorm(h)
        if self.arch.fused_qkv:  # Phi-3: [Q; K; V] out of one projection
            q, k, v = attn.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            q, k, v = (t.reshape(x.shape[0], -1, d) for t in (q, k, v))
        else:
            q = attn.q_proj(x).view(x.shape[0], -1, d)
            k = attn.k_proj(x).view(x.shape[0], -1, d)
            v = attn.v_proj(x).view(x.shape[0], -1, d)
        q, k = _arch.norm_qk(self.arch, attn, q, k)  # Qwen3's and Gemma's, before RoPE
        t = self.types[layer]
        q, k = self.rope(q, k, self.cos_of[t][rows], self.sin_of[t][rows], unsqueeze_dim=1)
        return q, k, v

    def attend(self, layer: int, h, q, keys, values, rows) -> torch.Tensor:
        attn = self.layers[layer].self_attn
        a = causal_attention(q, keys, values, rows, attn.scaling, self.windows[layer])
        return self.finish(layer, h, a)

    def scaling(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (None: full attention); the previews read it."""
        return self.windows[layer]

    def finish(self, layer: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        mod = self.layers[layer]
        return _arch.finish_hf(self.arch, mod, h, mod.self_attn.o_proj(a))


class Blender:
    """CacheBlend prefill over an HF model's decoder layers, with kvblendd doing the fuse.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported model (:data:`SUPPORTED_ARCHITECTURES`), in eval mode.
    client : kvblend.Client
        The daemon. With an ``ipc://`` endpoint a landing session is used (the daemon
        writes the re-rotated chunk rows straight into a shared region holding the
        request's KV; only the metric plane travels at check layers); elsewhere
        (``tcp://``) a classic session (rows and fused layers travel in messages).
    name : str, optional
        The model's name in the daemon (:func:`model_spec`). Registered at once.
    landing : bool, optional
        Force the session kind (default: landing when the endpoint is ipc://).

    Raises
    ------
    Unsupported
        The model is not one this module can blend exactly.
    """

    def __init__(
        self, model: Any, client: Client, name: str | None = None, landing: bool | None = None
    ) -> None:
        self.spec = model_spec(model, name)
        self.model, self.client = model, client
        self.np_dtype = _DTYPES[model.dtype][1]
        client.model_register(self.spec)
        self.landing = client.endpoint.startswith("ipc://") if landing is None else landing
        self._region: np.ndarray | None = None
        self._ops = _HfOps(model, self.spec.head_dim, _check_model(model))

    @property
    def session_kind(self) -> str:
        """``"landing"`` or ``"classic"``: the fuse session :meth:`blend` opens."""
        return "landing" if self.landing else "classic"

    # --- storing --------------------------------------------------------------

    @torch.no_grad()
    def prefill_kv(self, ids: Sequence[int]) -> np.ndarray:
        """Prefill ids alone at positions 0.. with the model's own forward pass.

        Returns their KV [layers, 2, T, kv_heads, head_dim] in the model's dtype (what
        kvblend stores).
        """
        dev = next(self.model.parameters()).device
        x = torch.as_tensor(np.asarray(ids, np.int64), device=dev)[None]
        kw = {}
        if any(w is not None for w in self._ops.windows):
            # a cache without the config's sliding layers, which keep only their window's
            # last rows: every row of the chunk is stored
            from transformers import DynamicCache

            kw["past_key_values"] = DynamicCache()
        out = self.model(input_ids=x, use_cache=True, **kw)
        pkv = out.past_key_values
        layers = [
            torch.stack([pkv.layers[i].keys[0], pkv.layers[i].values[0]]).transpose(1, 2)
            for i in range(self.spec.num_layers)
        ]
        return host.array(torch.stack(layers).cpu().contiguous())

    def store(self, ids: Sequence[int]) -> bytes:
        """Store chunk ids (prefilled alone at position 0) unless stored; return its hash."""
        h = chunk_hash(np.asarray(ids, np.uint32))
        if not self.client.lookup(self.spec.name, [h])[0].found:
            self.client.put(self.spec.name, h, np.ascontiguousarray(self.prefill_kv(ids)))
        return h

    # --- the blend pass -----------------------------------------------------------

    def _buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(self.np_dtype).itemsize
        if self.landing:
            if self._region is None or self._region.nbytes < n:
                self.close()
                self._region = self.client.region(max(n, 16 << 20))
            return self._region[:n].view(self.np_dtype).reshape(shape)
        return np.zeros(shape, self.np_dtype)

    def close(self) -> None:
        """Free the shared region the landing sessions use (the next blend allocates one)."""
        if self._region is not None:
            self.client.free_region(self._region)
            self._region = None

    @torch.no_grad()
    def blend(
        self,
        segments: Sequence[tuple[str, Any]],
        check_layers: Sequence[int] | None = None,
        ratios: Sequence[float] = (0.15,),
        metric: str | None = None,
        keep_checks: bool = False,
    ) -> Blend:
        """CacheBlend prefill of a prompt made of stored chunks and fresh tokens.

        Every token runs through the layers up to the first check layer; at each check
        layer the daemon compares the fresh metric plane (V, or K for the key metric) of
        the cached tokens with their stored, re-rotated rows and keeps the top ratio of
        them (plus every fresh token); later layers recompute only those, the others keep
        the stored rows. ``check_layers=()`` is full reuse (only fresh tokens computed).

        Parameters
        ----------
        segments : sequence of (str, token ids)
            The prompt in order: ``("chunk", ids)`` for a stored chunk (:meth:`store`),
            ``("fresh", ids)`` for tokens to compute. The last segment must be fresh.
        check_layers, ratios : sequences
            Increasing layers, one ratio in [0, 1] per layer, not increasing. The
            check layers default to ``(1,)``, and to none for the question and
            anchored metrics, which take one ratio: the share of chunk tokens
            recomputed at every layer.
        metric : str, optional
            Default: ``"anchored"`` when ``check_layers`` is not given, else
            ``"value"`` (check layers are the HKVD metrics'; docs/EVAL.md, "The
            default, from bench_rag").
            ``"value"`` (CacheBlend), ``"key"``, ``"attention"`` (question-aware,
            docs/fuse.md): first the question (the last segment) runs alone through
            every layer over the stored chunks re-rotated (a reuse-only session) and
            gives A, where it reads them; the daemon weighs the K and V deviation at
            the check layers by A. Or ``"question"`` (A³-style, no check layer): the
            same preview, then the chunk tokens with the largest A summed over heads
            are recomputed at every layer with the fresh ones, over the landed rows.
            Or ``"anchored"`` (QCFuse-style): as ``"question"`` with a compressed
            preview: the question runs through layers 0 ..
            :func:`kvblend.blend.preview.critical_layer` only, reading one anchor token
            every 32 of each chunk before that layer and every chunk token at it, where
            its attention alone is A.
        keep_checks : bool
            Keep the planes sent at check layers in :attr:`Blend.checked`.

        Raises
        ------
        NotFound
            A chunk is not stored (``err.missing`` lists the hashes).
        BadArgument, ValueError
            Bad segments, check layers, ratios or metric.
        """
        t0 = time.perf_counter()
        if metric is None:
            metric = _metrics.DEFAULT if check_layers is None else "value"
        _metrics.check_name(metric)
        node = _metrics.node_selects(metric)
        if check_layers is None:
            check_layers = _metrics.METRICS[metric].checks
        checks = [int(c) for c in check_layers]
        if node and (checks or len(ratios) != 1):
            raise ValueError(f"the {metric} metric takes no check layers and one ratio")
        nl, nh, d = self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim
        if any(not 0 <= c < nl for c in checks):
            raise ValueError(f"check layers {checks}: each in 0..{nl - 1}")
        ids, spans = _segments(segments)
        n = ids.size
        segs = [
            (chunk_hash(t.astype(np.uint32)), s) if kind == "chunk" else (t.size, s)
            for kind, s, t in spans
        ]
        _, s, t = spans[-1]  # the question: the last segment, fresh
        job = Job(ids, segs, list(ratios), t, np.arange(s, n))
        buf = self._buffer((nl, 2, n, nh, d))
        b = Batch()
        try:
            open_job(
                self._ops, self.client, self.spec.name, job, buf, checks, metric, b,
                landing=self.landing,
            )
            node_previews(self._ops, metric, b)
            # the first token's logits need the last row's final hidden state alone
            r = blend_batch(self._ops, b.prompts, checks, metric, self.landing, keep_checks,
                            outputs="last")[0]
            stats = close_all(b)[0]
        except BaseException:
            close_after_failure(b)  # the first failure is the one to report
            raise
        p = b.prompts[0]
        if p.recompute is not None:
            r.selections.append(p.recompute)
        out = self._finish(r, buf, ids, p.attention)
        stats["phases_ms"] = {k: v * 1000 for k, v in r.phases.items()}  # the pass's
        out.stats, out.session = stats, self.session_kind
        out.seconds = time.perf_counter() - t0
        return out

    def _finish(self, r: Any, buf: np.ndarray, ids: np.ndarray, a: Any) -> Blend:
        """Return the Blend of a finished layer loop: last row's logits, a copy of the KV."""
        if r.rows[-1] != ids.size - 1:
            raise KvblendError(-5, "kvblend.hf: the last prompt token was not recomputed")
        inner = self.model.model
        logits = self.model.lm_head(inner.norm(r.h[-1:]))[0].float().cpu()
        # the buffer is reused by the next blend: the Blend gets a copy
        kv = host.tensor(buf, self.model.dtype).clone()
        return Blend(
            ids=ids,
            kv=kv,
            logits=logits,
            selections=r.selections,
            checked=r.checked,
            sent=r.sent,
            attention=a,
        )

    @torch.no_grad()
    def generate(
        self,
        segments: Sequence[tuple[str, Any]],
        max_new_tokens: int = 32,
        check_layers: Sequence[int] | None = None,
        ratios: Sequence[float] = (0.15,),
        metric: str | None = None,
        blend: Blend | None = None,
        **generate_kwargs: Any,
    ) -> list[int]:
        """Blend the prompt (or take ``blend``), then continue greedily with ``generate()``.

        The fused KV of every prompt token but the last goes into a ``DynamicCache``;
        ``model.generate`` computes the last token against it (as the blend did: the
        last token is always recomputed) and decodes greedily. Returns the new token
        ids. Extra keyword arguments go to ``generate`` (``do_sample`` is False).
        """
        b = blend or self.blend(segments, check_layers, ratios, metric)
        dev = next(self.model.parameters()).device
        x = torch.as_tensor(b.ids, device=dev)[None]
        kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        kw.update(generate_kwargs)
        out = self.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            past_key_values=b.cache(self.model, b.ids.size - 1),
            max_new_tokens=max_new_tokens,
            **kw,
        )
        return out[0, b.ids.size :].tolist()
