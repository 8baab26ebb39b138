"""CacheBlend's blend pass over vLLM's own layer modules, in vLLM's worker process.

The building block of blending inside vLLM: given the model vLLM runs (reached through
kvblend's plugin, :mod:`kvblend.vllm.plugin`), a daemon and a prompt of stored chunks and
fresh tokens, :func:`blend_prompt` runs the node's side of CacheBlend with the model's
decoder layer modules (``input_layernorm``, ``self_attn.qkv_proj``, Qwen3's ``self_attn.
q_norm``/``k_norm``, ``self_attn.rotary_emb``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp``; Llama, Mistral, Qwen2, Qwen3:
:mod:`kvblend.blend.arch`) and attention over the whole context with an exact causal mask
in prompt order, the loop :mod:`kvblend.blend.loop` shares with :mod:`kvblend.hf`, and
returns the fused KV.

The connector's side (docs/vllm.md, "CacheBlend"): the blend settings are read by
:mod:`kvblend.vllm.config`, the scheduler's claim (the context up to the end of the last
stored chunk found) is the planner's (:mod:`kvblend.vllm.plan`); :func:`worker_model` and
:func:`load_blend` are the worker's (blend, then write the fused rows into vLLM's paged
cache). Tested in real engines by tests/engine/test_vllm_model_hook.py and
test_vllm_blend.py against kvblend.hf's blend of the same prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..blend import arch as _arch
from ..blend.attention import causal_attention
from ..blend.loop import blend_layers
from ..blend.preview import land_chunks, question_attention
from ..client import Client
from ..errors import KvblendError, Unavailable
from ..types import Model
from .attention import paged_attention_for
from .daemon import CLOSE_TIMEOUT_MS, wait_layer
from .layout import PagedCache
from .plan import BlendLoad
from .plugin import loaded_model

# Under "vllm." so that vLLM's logging configuration applies (as kvblend.vllm's lines).
logger = logging.getLogger(f"vllm.{__name__}")

#: Architectures (and vLLM model classes of the same name) whose decoder layers this pass
#: drives: the Llama family (:mod:`kvblend.blend.arch`).
SUPPORTED_MODELS = tuple(_arch.ARCHITECTURES)
_NP = {torch.float32: np.float32, torch.float16: np.float16}
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("qkv_proj", "rotary_emb", "o_proj", "q_size", "kv_size", "head_dim", "scaling")


class BlendRefused(RuntimeError):
    """The model cannot be blended by this pass; the message says why."""


class VllmLlamaOps:
    """The layer operations of vLLM's Llama-family models (:class:`kvblend.blend.loop.LayerOps`).

    Raises
    ------
    BlendRefused
        A model class other than :data:`SUPPORTED_MODELS` or an option of it the pass
        does not reproduce (:func:`kvblend.blend.arch.for_vllm`), tensor parallelism (a sharded
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
    wait_s: float = 120.0,
) -> tuple[torch.Tensor, list[np.ndarray], dict]:
    """Blend a prompt over vLLM's model with a landing session; return the fused KV.

    Parameters
    ----------
    model : torch.nn.Module
        The model vLLM runs (``kvblend.vllm.plugin.loaded_model``).
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
        and give A (:func:`kvblend.blend.preview.question_attention`), which goes to
        the daemon with the first check layer.
    wait_s : float
        The longest wait for one landed layer (the connector's ``timeout_ms``); a daemon
        found gone ends the wait at once (:func:`kvblend.vllm.daemon.wait_layer`).

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
    endpoint = client.endpoint

    def wait(sess: Any, layer: int) -> None:
        wait_layer(sess, layer, wait_s, endpoint)

    region = client.region(nbytes)
    done = False
    try:
        buf = region[:nbytes].view(np_dtype).reshape(shape)
        a, t_pre = None, time.perf_counter()
        if metric == "attention" and check_layers:
            land_chunks(client, spec.name, segments, buf, True, wait)
            q = np.asarray(question, np.int64)
            rows = np.flatnonzero(cached)
            a = question_attention(ops, torch.from_numpy(buf), rows, q, n + np.arange(q.size))
        t_pre = time.perf_counter() - t_pre
        sess = client.fuse_open_into(
            spec.name, segments, buf[:, 0], buf[:, 1], list(check_layers), list(ratios), metric
        )
        down = False
        try:
            checks = list(check_layers)
            r = blend_layers(ops, sess, buf, ids, cached, checks, metric, True, False, a, wait)
        except (Unavailable, TimeoutError):
            # the daemon is gone or not answering: the closes below must not each wait
            # the whole timeout, and their errors are this one's
            down = True
            client.set_timeout(CLOSE_TIMEOUT_MS)
            raise
        finally:
            stats = _close_quietly(sess) if down else sess.close()
        if a is not None:
            stats.update(attention=a, preview_ms=t_pre * 1000)
        kv = torch.from_numpy(buf).clone()
        done = True
    except (Unavailable, TimeoutError):
        client.set_timeout(CLOSE_TIMEOUT_MS)  # (the preview's landing) as above
        raise
    finally:
        try:
            client.free_region(region)
        except KvblendError:
            if done:
                raise  # after a failure, the failure is what the caller hears of
    return kv, r.selections, stats


def _close_quietly(sess: Any) -> dict:
    """Close a session; after a daemon failure its error is the pass's, not the close's."""
    try:
        return sess.close()
    except KvblendError:
        return {}


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
    model = loaded_model(vllm_config)
    VllmLlamaOps(model)  # refuses what the pass cannot drive
    return model


def load_blend(
    model: Any,
    client: Client,
    spec: Model,
    load: BlendLoad,
    block_ids: Sequence[int],
    cache: PagedCache,
    wait_s: float = 120.0,
) -> tuple[list[np.ndarray], dict]:
    """Blend a request's context and write the fused rows into vLLM's paged cache.

    ``cache`` holds the worker's views of vLLM's cache (:class:`kvblend.vllm.layout.
    PagedCache`); the rows go to prompt positions 0 .. len(load.ids) - 1 through
    ``block_ids``. Returns the selections and the daemon's statistics. ``wait_s``: the
    longest wait for one landed layer.
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
        wait_s,
    )
    t1 = time.perf_counter()
    cache.write(block_ids, load.skip, kv[:, :, load.skip :])  # vLLM has the rows before
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
