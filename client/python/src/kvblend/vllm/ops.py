"""The layer operations of vLLM's Llama-family and Gemma 3 models, for the blend pass.

:class:`VllmLlamaOps` drives the decoder layer modules of the model vLLM runs
(``input_layernorm``, ``self_attn.qkv_proj``, Qwen3's and Gemma's ``self_attn.q_norm``/
``k_norm``, ``self_attn.rotary_emb``, ``self_attn.o_proj``, ``post_attention_layernorm``,
``mlp``, a mixture of experts for Qwen3-MoE that routes the rows it is given, Gemma's
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``;
:mod:`kvblend.blend.arch`) as :class:`kvblend.blend.loop.LayerOps`, with vLLM's own
attention kernel where one applies (:mod:`kvblend.vllm.attention`), through each local
layer's sliding window.
"""

from __future__ import annotations

from typing import Any

import torch

from ..blend import arch as _arch
from ..blend import host
from ..blend.attention import causal_attention
from .attention import (
    PagedAttention,
    VarlenAttention,
    paged_attention_for,
    varlen_attention_for,
)

#: Architectures (and vLLM model classes of the same name) whose decoder layers this pass
#: drives: the Llama family (:mod:`kvblend.blend.arch`).
SUPPORTED_MODELS = tuple(_arch.ARCHITECTURES)
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
        does not reproduce (:func:`kvblend.blend.arch.for_vllm`), or a layer without the
        parts this pass calls. Under tensor parallelism the modules are the rank's shards
        (its heads; the output projection and the MLP reduce across ranks), so every rank
        runs the pass together (:class:`TensorRanks`).
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
        self.model = model
        self.num_layers = len(self.layers)
        self.device = next(model.parameters()).device
        self.kv_dtype = next(model.parameters()).dtype
        if self.kv_dtype not in host.NP_DTYPES:
            raise BlendRefused(f"kvblend: dtype {self.kv_dtype}; float32, float16 or bfloat16")
        #: per layer, its sliding window (None: full attention), as vLLM's attention layer
        #: holds it and passes it to its kernel (checked against the config by for_vllm)
        self.windows = [getattr(layer.self_attn.attn, "sliding_window", None)
                        if self.arch.local_layers else None for layer in self.layers]
        a = self.layers[0].self_attn
        # vLLM's CPU attention kernel where it applies (several times faster than PyTorch's),
        # vLLM's FlashAttention on a GPU, PyTorch's fused attention otherwise
        shape = (self.device, a.num_heads, a.num_kv_heads, a.head_dim, self.kv_dtype)
        self.attention = (
            paged_attention_for(*shape) or varlen_attention_for(*shape) or causal_attention
        )

    #: Test hook (the worker's FAIL_LOAD_ENV with ``layer L``): the pass's attention at
    #: this layer raises, once.
    fail_layer: int | None = None
    #: Test hook (FAIL_LOAD_ENV with ``preview L``): the question or anchored metric's
    #: preview raises at this layer, once (:func:`kvblend.blend.preview.question_attention`).
    fail_preview: int | None = None

    def begin(self, n: int) -> None:
        pass

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.arch.scaled_embedding:  # Gemma: times sqrt(hidden), in the model's dtype
            return self.model.model.embed_tokens(ids) * self.model.model.normalizer
        return self.model.model.embed_tokens(ids)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (None: full attention); the previews read it."""
        return self.windows[layer]

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
        return self.attend_many(layer, [h], [q], [keys], [values], [rows])[0]

    def attend_many(self, layer: int, hs, qs, keys, values, rows) -> list[torch.Tensor]:
        """Finish the layer for several prompts (lists, one entry a prompt).

        Each attends over its own KV (one kernel call where vLLM's applies); then the
        output projection and the MLP run over all their rows at once.
        """
        a = self.attention_of(layer, qs, keys, values, rows)
        h = self.finish(layer, hs[0] if len(hs) == 1 else torch.cat(hs), a)
        return [h] if len(hs) == 1 else list(torch.split(h, [x.shape[0] for x in hs]))

    def attention_of(self, layer: int, qs, keys, values, rows) -> torch.Tensor:
        """The attention output [sum of n, heads * d] of several prompts (lists, as
        :meth:`attend_many`): the rank's own heads, no collective (under tensor
        parallelism the ranks agree after it, before :meth:`finish` reduces)."""
        if layer == self.fail_layer:
            self.fail_layer = None
            raise RuntimeError(f"kvblend: a failure injected in the blend pass at layer {layer}")
        scaling = self.layers[layer].self_attn.scaling
        w = self.windows[layer]
        if isinstance(self.attention, (PagedAttention, VarlenAttention)):
            return self.attention.many(qs, keys, values, rows, scaling, w)
        return torch.cat([self.attention(*x, scaling, w) for x in zip(qs, keys, values, rows)])

    def scaling(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    def finish(self, layer: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: h + o_proj(a), then the MLP's residual; with
        Gemma's sandwich norms around each sublayer's output (as Gemma3DecoderLayer)."""
        mod = self.layers[layer]
        o, _ = mod.self_attn.o_proj(a)
        if self.arch.sandwich_norm:
            h = h + mod.post_attention_layernorm(o)
            return h + mod.post_feedforward_layernorm(mod.mlp(mod.pre_feedforward_layernorm(h)))
        h = h + o
        return h + mod.mlp(mod.post_attention_layernorm(h))

