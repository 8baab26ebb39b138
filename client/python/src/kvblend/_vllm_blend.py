"""CacheBlend's blend pass over vLLM's own layer modules, in vLLM's worker process.

The building block of blending inside vLLM: given the model vLLM runs (reached through
kvblend's plugin, :mod:`kvblend._vllm_plugin`), a daemon and a prompt of stored chunks and
fresh tokens, :func:`blend_prompt` runs the node's side of CacheBlend with the model's
decoder layer modules (``input_layernorm``, ``self_attn.qkv_proj``, Qwen3's ``self_attn.
q_norm``/``k_norm``, ``self_attn.rotary_emb``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp``; Llama, Mistral, Qwen2, Qwen3: :mod:`kvblend.
_blend_arch`) and attention
over the whole context with an exact causal mask in prompt order, the loop
:mod:`kvblend._blend_loop` shares with :mod:`kvblend.hf`, and returns the fused KV.

The connector's side (docs/vllm.md, "CacheBlend"): :func:`config_from_extra` reads
``kv_connector_extra_config["blend"]``, :func:`plan_blend` is the scheduler's claim (the
context up to the end of the last stored chunk found), :func:`worker_model` and
:func:`load_blend` are the worker's (blend, then write the fused rows into vLLM's paged
cache). Tested in real engines by tests/engine/test_vllm_model_hook.py and
test_vllm_blend.py against kvblend.hf's blend of the same prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _blend_arch as _arch
from . import _vllm_plan as _plan
from ._blend_loop import blend_layers, causal_attention
from ._blend_preview import land_chunks, question_attention
from ._vllm_attn import paged_attention_for
from .client import Client, Model, chunk_hash

# Under "vllm." so that vLLM's logging configuration applies (as kvblend.vllm's lines).
logger = logging.getLogger(f"vllm.{__name__}")

#: Architectures (and vLLM model classes of the same name) whose decoder layers this pass
#: drives: the Llama family (:mod:`kvblend._blend_arch`).
SUPPORTED_MODELS = tuple(_arch.ARCHITECTURES)
_NP = {torch.float32: np.float32, torch.float16: np.float16}
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("qkv_proj", "rotary_emb", "o_proj", "q_size", "kv_size", "head_dim", "scaling")


class BlendRefused(RuntimeError):
    """The model cannot be blended by this pass; the message says why."""


class VllmLlamaOps:
    """The layer operations of vLLM's Llama-family models (:class:`_blend_loop.LayerOps`).

    Raises
    ------
    BlendRefused
        A model class other than :data:`SUPPORTED_MODELS` or an option of it the pass
        does not reproduce (:func:`_blend_arch.for_vllm`), tensor parallelism (a sharded
        projection), or a layer without the parts this pass calls.
    """

    def __init__(self, model: Any) -> None:
        try:
            self.arch = _arch.for_vllm(model)
        except _arch.ArchRefused as e:
            raise BlendRefused(str(e)) from None
        self.layers = model.model.layers
        for i, layer in enumerate(self.layers):
            missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
            missing += [f"self_attn.{p}" for p in _ATTN_PARTS if not hasattr(layer.self_attn, p)]
            if missing:
                raise BlendRefused(f"kvblend: decoder layer {i} has no {', '.join(missing)}")
            if layer.self_attn.num_heads != layer.self_attn.total_num_heads:
                raise BlendRefused("kvblend: tensor-parallel attention is not blended")
        self.model = model
        self.num_layers = len(self.layers)
        self.device = next(model.parameters()).device
        self.kv_dtype = next(model.parameters()).dtype
        if self.kv_dtype not in _NP:
            raise BlendRefused(f"kvblend: dtype {self.kv_dtype}; float32 or float16")
        a = self.layers[0].self_attn
        # vLLM's CPU attention kernel where it applies (several times faster than PyTorch's)
        self.attention = (
            paged_attention_for(self.device, a.num_heads, a.num_kv_heads, a.head_dim, self.kv_dtype)
            or causal_attention
        )

    def begin(self, n: int) -> None:
        pass

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def qkv(self, layer: int, h: torch.Tensor, rows: torch.Tensor) -> tuple:
        mod = self.layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(h)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        d = attn.head_dim
        n = x.shape[0]
        if self.arch.qk_norm:  # Qwen3: per head, before RoPE (as Qwen3Attention.forward)
            q, k = _arch.norm_qk(self.arch, attn, q.reshape(n, -1, d), k.reshape(n, -1, d))
            q, k = q.reshape(n, -1), k.reshape(n, -1)
        q, k = attn.rotary_emb(rows, q.contiguous(), k.contiguous())
        return q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)

    def attend(self, layer: int, h, q, keys, values, rows) -> torch.Tensor:
        mod = self.layers[layer]
        attn = mod.self_attn
        o, _ = attn.o_proj(self.attention(q, keys, values, rows, attn.scaling))
        h = h + o
        return h + mod.mlp(mod.post_attention_layernorm(h))


@torch.no_grad()
def blend_prompt(
    model: Any,
    client: Client,
    spec: Model,
    ids: Sequence[int],
    segments: Sequence[tuple],
    check_layers: Sequence[int],
    ratios: Sequence[float],
    metric: str = "value",
    question: Sequence[int] = (),
) -> tuple[torch.Tensor, list[np.ndarray], dict]:
    """Blend a prompt over vLLM's model with a landing session; return the fused KV.

    Parameters
    ----------
    model : torch.nn.Module
        The model vLLM runs (``_vllm_plugin.loaded_model``).
    client : Client
        The daemon, on an ``ipc://`` endpoint (the request's KV lands in a region).
    spec : Model
        The model as registered in the daemon (its chunks are stored under that name).
    ids : sequence of int
        The prompt's tokens (the context to blend: up to the last fresh span).
    segments : sequence of tuple
        The fuse segments in prompt order, one after another from position 0: ``(hash,
        pos)`` for a stored chunk, ``(count, pos)`` for fresh tokens.
    check_layers, ratios, metric
        As :meth:`Client.fuse_open_into`.
    question : sequence of int
        The attention metric's question: the prompt's tokens right after ``ids`` (what
        vLLM computes after the blend). Before the pass they run alone through every
        layer over the stored chunks re-rotated (landed by a reuse-only session first)
        and give A (:func:`kvblend._blend_preview.question_attention`), which goes to
        the daemon with the first check layer.

    Returns
    -------
    (kv, selections, stats)
        The fused KV [layers, 2, N, kv_heads, head_dim] (CPU, the model's dtype), the
        selection after each check layer, the daemon's session statistics; with the
        attention metric also ``stats["attention"]`` (A, [chunk tokens, kv_heads]) and
        ``stats["preview_ms"]`` (landing and preview).

    Raises
    ------
    ValueError
        The attention metric with check layers and no question tokens.
    """
    ops = VllmLlamaOps(model)
    ids = np.asarray(ids, np.int64)
    n = ids.size
    cached = np.zeros(n, bool)
    starts = [int(seg[1]) for seg in segments] + [n]
    for i, seg in enumerate(segments):  # a chunk runs up to the next segment
        if not isinstance(seg[0], int):
            cached[starts[i] : starts[i + 1]] = True
    shape = spec.kv_shape(n)
    np_dtype = _NP[ops.kv_dtype]
    nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
    region = client.region(nbytes)
    try:
        buf = region[:nbytes].view(np_dtype).reshape(shape)
        a, t_pre = None, time.perf_counter()
        if metric == "attention" and check_layers:
            land_chunks(client, spec.name, segments, buf, True)
            q = np.asarray(question, np.int64)
            rows = np.flatnonzero(cached)
            a = question_attention(ops, torch.from_numpy(buf), rows, q, n + np.arange(q.size))
        t_pre = time.perf_counter() - t_pre
        sess = client.fuse_open_into(
            spec.name, segments, buf[:, 0], buf[:, 1], list(check_layers), list(ratios), metric
        )
        try:
            checks = list(check_layers)
            r = blend_layers(ops, sess, buf, ids, cached, checks, metric, True, False, a)
        finally:
            stats = sess.close()
        if a is not None:
            stats.update(attention=a, preview_ms=t_pre * 1000)
        kv = torch.from_numpy(buf).clone()
    finally:
        client.free_region(region)
    return kv, r.selections, stats


# --- the connector's use: configuration, the scheduler's claim, the worker's load ---------


@dataclass(frozen=True)
class BlendConfig:
    """``kv_connector_extra_config["blend"]``: check layers, ratios and metric."""

    check_layers: tuple[int, ...]
    ratios: tuple[float, ...]
    metric: str


@dataclass
class BlendLoad:
    """One request's blend: its context and fuse segments.

    The context runs up to the end of the request's last stored chunk found; segments
    are ``(hash, pos)`` for a chunk and ``(count, pos)`` for fresh tokens. ``question``:
    the prompt's tokens after the context (the attention metric's preview runs them).
    """

    ids: list[int]
    segments: list[tuple]
    config: BlendConfig
    question: list[int] = field(default_factory=list)


DEFAULT_CONFIG = BlendConfig((1,), (0.15,), "value")
#: The selection metrics (docs/fuse.md): HKVD on V or K, or question-aware ("attention").
METRICS = ("value", "key", "attention")


def _settings(raw: Any, num_layers: int, base: BlendConfig, where: str) -> BlendConfig:
    """Check blend settings ``raw`` (a dict); keys it lacks keep ``base``'s values."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a dict, got {type(raw).__name__}")
    unknown = set(raw) - {"check_layers", "ratios", "metric"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))}")
    checks = raw.get("check_layers", base.check_layers)
    ratios = raw.get("ratios", base.ratios)
    if not isinstance(checks, (list, tuple)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in checks
    ):
        raise ValueError(f"{where}.check_layers must be a list of ints")
    if not isinstance(ratios, (list, tuple)) or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios
    ):
        raise ValueError(f"{where}.ratios must be a list of numbers")
    checks, ratios = tuple(checks), tuple(float(r) for r in ratios)
    metric = raw.get("metric", base.metric)
    if metric not in METRICS:
        raise ValueError(f"{where}.metric {metric!r}: 'value', 'key' or 'attention'")
    # no check layers (and no ratios): full reuse through the pass, every stored chunk
    # re-rotated in place and every fresh token computed, wherever the chunks sit
    if len(checks) != len(ratios):
        raise ValueError(f"{where}: one ratio per check layer")
    if any(not 0 <= c < num_layers for c in checks) or list(checks) != sorted(set(checks)):
        raise ValueError(f"{where}.check_layers {list(checks)}: increasing, in 0..{num_layers - 1}")
    if any(not 0.0 <= r <= 1.0 for r in ratios) or list(ratios) != sorted(ratios, reverse=True):
        raise ValueError(f"{where}.ratios {list(ratios)}: in [0, 1], not increasing")
    return BlendConfig(checks, ratios, metric)


def config_from_extra(
    extra: dict, architecture: str | None, num_layers: int, hf_config: Any = None
) -> BlendConfig | None:
    """Parse ``extra["blend"]`` (absent or None: no blending).

    ``{"check_layers": [1], "ratios": [0.15], "metric": "value"}`` (the defaults); ``{}``
    takes all defaults. Returns None, with the reason in the log, for a model whose
    architecture (or an option of it in ``hf_config``, the model's Hugging Face config)
    this pass does not drive (:func:`_blend_arch.check_config`): its requests are served
    as plain reuse.

    Raises
    ------
    ValueError
        Malformed settings; the message names the key.
    """
    raw = extra.get("blend")
    if raw is None:
        return None
    config = _settings(raw, num_layers, DEFAULT_CONFIG, "blend")
    try:
        _arch.check_config(architecture, hf_config, "kvblend: blending refused")
    except _arch.ArchRefused as e:
        logger.warning("%s; its requests are served as plain reuse", e)
        return None
    return config


def split_override(kv_transfer_params: Any) -> tuple[Any, Any]:
    """Return ``(kv_transfer_params without kvblend.blend, that value or None)``.

    A request may carry ``{"kvblend": {..., "blend": {...} | false}}``: settings that
    override the connector's for it (keys it lacks keep the connector's), or false for
    full reuse. The rest goes to the reuse planner, which knows no ``blend`` key.
    """
    kvp = kv_transfer_params
    if isinstance(kvp, dict) and isinstance(kvp.get("kvblend"), dict) and "blend" in kvp["kvblend"]:
        inner = dict(kvp["kvblend"])
        override = inner.pop("blend")
        return {**kvp, "kvblend": inner}, override
    return kvp, None


def plan_blend(
    client: Client,
    model_name: str,
    num_layers: int,
    kv_transfer_params: Any,
    prompt_ids: Sequence[int],
    num_computed: int,
    config: BlendConfig,
) -> tuple[int, BlendLoad] | None:
    """Claim a blend for the scheduler: every token up to the end of the last stored chunk.

    Returns None when the request is not one to blend (no kvblend parameters, a store
    request, ``"blend": false`` in its parameters, tokens already computed, no chunk
    found, or a found chunk that ends the prompt: vLLM must compute the last token) and
    the caller plans plain reuse. Chunks not found become fresh tokens of the session.
    The request's ``kvblend.blend`` settings, if any, override ``config``
    (:func:`split_override`). Side-effect free (a lookup).

    Raises
    ------
    ParamError
        Malformed parameters (its blend settings included).
    KvblendError
        The lookup failed.
    """
    ids = list(prompt_ids)
    kvp, override = split_override(kv_transfer_params)
    params = _plan.parse_params(kvp, len(ids))
    if params is None or params.store or num_computed != 0 or override is False:
        return None
    if override is not None:
        try:
            config = _settings(override, num_layers, config, "kvblend.blend")
        except ValueError as e:
            raise _plan.ParamError(str(e)) from None
    segs = _plan.chunk_segments(params)
    if not segs:
        return None
    hashes = [chunk_hash(ids[s.start : s.end]) for s in segs]
    infos = client.lookup(model_name, hashes)
    found = [
        (s, h)
        for s, h, i in zip(segs, hashes, infos)
        if i.found and i.num_tokens == s.length and i.num_layers == num_layers
    ]
    if not found or found[-1][0].end >= len(ids):
        return None
    fuse, pos = [], 0
    for s, h in found:
        if s.start > pos:
            fuse.append((s.start - pos, pos))
        fuse.append((h, s.start))
        pos = s.end
    return pos, BlendLoad(ids[:pos], fuse, config, ids[pos:])


def _fresh(seg: tuple) -> bool:
    """Whether a fuse segment is fresh tokens ``(count, pos)`` rather than ``(hash, pos)``."""
    return isinstance(seg[0], int)


def worker_model(vllm_config: Any) -> Any:
    """Return the model vLLM runs in this worker, checked for the blend pass.

    Raises
    ------
    ModelUnreachable, BlendRefused
        With the message to refuse the start with.
    """
    from ._vllm_plugin import loaded_model

    model = loaded_model(vllm_config)
    VllmLlamaOps(model)  # refuses what the pass cannot drive
    return model


def load_blend(
    model: Any,
    client: Client,
    spec: Model,
    load: BlendLoad,
    block_ids: Sequence[int],
    block_size: int,
    k_cache: Sequence[torch.Tensor],
    v_cache: Sequence[torch.Tensor],
) -> tuple[list[np.ndarray], dict]:
    """Blend a request's context and write the fused rows into vLLM's paged cache.

    k_cache[layer] is ``[blocks, kv_heads, head_dim, block_size]`` (the CPU "vec" layout's
    transposed K) and v_cache[layer] ``[blocks, kv_heads, block_size, head_dim]``, as
    KvblendConnector keeps them. Returns the selections and the daemon's statistics.
    """
    c = load.config
    t0 = time.perf_counter()
    kv, sels, stats = blend_prompt(
        model,
        client,
        spec,
        load.ids,
        load.segments,
        c.check_layers,
        c.ratios,
        c.metric,
        load.question,
    )
    t1 = time.perf_counter()
    pos = torch.arange(len(load.ids))
    table = torch.tensor(list(block_ids), dtype=torch.long)
    blk, off = table[pos // block_size], pos % block_size
    for layer in range(kv.shape[0]):
        k_cache[layer][blk, :, :, off] = kv[layer, 0]
        v_cache[layer][blk, :, off, :] = kv[layer, 1]
    logger.info(
        "kvblend: blend of %d tokens (%d recomputed after layer %d): pass %.3f s (daemon: "
        "session %.0f ms, load %.1f ms, landing %.1f ms, compute %.2f ms), cache write %.3f s; "
        "metric %s, preview %.0f ms",
        len(load.ids),
        sels[-1].size if sels else int(sum(s[0] for s in load.segments if _fresh(s))),
        c.check_layers[-1] if c.check_layers else -1,
        t1 - t0,
        stats.get("lifetime_ms", float("nan")),
        stats.get("load_ms", float("nan")),
        stats.get("land_ms", float("nan")),
        stats.get("compute_ms", float("nan")),
        time.perf_counter() - t1,
        c.metric,
        stats.get("preview_ms", 0.0),
    )
    return sels, stats
