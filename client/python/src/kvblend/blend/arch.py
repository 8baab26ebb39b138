"""What each architecture of the Llama family asks of CacheBlend's layer operations.

Llama, Mistral, Qwen2 and Qwen3 share one decoder layer (RMSNorm, QKV projection, RoPE,
attention, output projection, RMSNorm, gated MLP) and differ where the blend pass must
know it:

- Llama and Mistral: the layer as is (Mistral's sliding window is refused upstream, by
  the connector's and kvblend.hf's checks; vLLM's Llama 4 attention scaling and adaptive
  RMSNorm on Mistral are refused here);
- Qwen2: a bias on the Q, K and V projections. It lives inside the projection modules
  (vLLM's ``qkv_proj``, transformers' ``q_proj``/``k_proj``/``v_proj``), which the pass
  calls whole, so the bias needs no code of its own; it is checked to be there, so that
  a checkpoint without it is not blended as if it were Qwen2;
- Qwen3: an RMSNorm per head on Q and K (``q_norm``, ``k_norm``, over head_dim) after the
  projection and before RoPE, and an explicit head_dim (taken from the config or vLLM's
  attention module by both paths);
- Qwen3-MoE: Qwen3's attention, and a mixture of experts in place of the MLP (``mlp``: a
  router picks each token's experts). The pass calls the ``mlp`` module whole, so each
  recomputed row is routed as the engine routes it (vLLM's fused MoE kernel under vLLM;
  transformers' experts under kvblend.hf, whose block takes a batch dimension);
- Phi-3 and Phi-4: Q, K and V in one projection, and a partial rotary factor;
- Gemma 3 (text, ``Gemma3ForCausalLM``): Qwen3's Q and K norms, a norm on each sublayer's
  output as well as its input (``post_attention_layernorm`` on the attention's output,
  ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP), an
  embedding scaled by sqrt(hidden) (in transformers' ``embed_tokens`` module, called whole;
  vLLM's model multiplies by its ``normalizer`` in ``embed_input_ids``), the attention
  scaled by ``query_pre_attn_scalar`` ** -0.5 (the attention module's ``scaling``), a RoPE
  base per layer type (each layer's own rotary module, in both engines), and a sliding
  window on its local layers (:func:`sliding_windows`; under vLLM each attention layer's
  own ``sliding_window``, which its kernel takes).

:func:`for_vllm` and :func:`for_hf` check a loaded model and return its :class:`Arch`;
:func:`norm_qk` is the one step the loop adds for Qwen3 and Gemma 3. Anything else raises
:class:`ArchRefused` naming the architecture. Used by :mod:`kvblend.vllm.blend` and
:mod:`kvblend.hf`; imports nothing but the standard library at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ArchRefused(ValueError):
    """The model is not one the blend pass drives exactly; the message says why."""


@dataclass(frozen=True)
class Arch:
    """One architecture's differences from Llama's decoder layer.

    Attributes
    ----------
    name : str
        The Hugging Face architecture (``config.architectures[0]``).
    qkv_bias : bool
        The Q, K and V projections carry a bias (applied by the projection modules).
    qk_norm : bool
        An RMSNorm per head on Q and K (``self_attn.q_norm``, ``self_attn.k_norm``)
        before RoPE.
    fused_qkv : bool
        Transformers' modules project Q, K and V in one ``self_attn.qkv_proj`` (and the
        MLP's gate and up in one ``gate_up_proj``, inside ``mlp``); vLLM's always do.
    moe : bool
        ``mlp`` is a mixture of experts with a router (``mlp.gate``, ``mlp.experts``);
        transformers' block takes [batch, tokens, hidden].
    sandwich_norm : bool
        Each sublayer's output is normed before its residual add (Gemma 2 and 3): the
        attention's by ``post_attention_layernorm``; the MLP's input by
        ``pre_feedforward_layernorm`` and its output by ``post_feedforward_layernorm``.
    local_layers : bool
        Some layers are local (``config.layer_types``, or ``sliding_window_pattern``): they
        attend through a sliding window and are rotated with their own RoPE base
        (transformers' rotary embedding takes the layer type); :func:`sliding_windows`.
    scaled_embedding : bool
        The embedding is scaled (by sqrt(hidden) in Gemma), inside transformers' embedding
        module (``embed_scale``), which the pass calls whole: checked to be there.
    """

    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    moe: bool = False
    sandwich_norm: bool = False
    local_layers: bool = False
    scaled_embedding: bool = False


#: The architectures the blend pass drives, by Hugging Face architecture name. vLLM runs
#: each as the model class of the same name (vLLM 0.32's registry).
ARCHITECTURES = {
    a.name: a
    for a in (
        Arch("LlamaForCausalLM"),
        Arch("MistralForCausalLM"),
        Arch("Qwen2ForCausalLM", qkv_bias=True),
        Arch("Qwen3ForCausalLM", qk_norm=True),
        # Phi-3 and Phi-4: vLLM runs them as Llama; a partial rotary factor (Phi-4-mini's
        # 0.75) is the model's RoPE description (rotary_dim), re-rotated exactly
        Arch("Phi3ForCausalLM", fused_qkv=True),
        # Qwen3-MoE: every token routed through its top-k experts by the engine's own module
        Arch("Qwen3MoeForCausalLM", qk_norm=True, moe=True),
        # Gemma 3 (text): sandwich norms, a scaled embedding, local layers with a sliding
        # window and a RoPE base of their own
        Arch("Gemma3ForCausalLM", qk_norm=True, sandwich_norm=True, local_layers=True,
             scaled_embedding=True),
    )
}

def supported() -> str:
    """Return the supported architectures, comma-separated, for messages."""
    return ", ".join(ARCHITECTURES)


def lookup(name: str | None, where: str) -> Arch:
    """Return the :class:`Arch` of architecture ``name``.

    Raises
    ------
    ArchRefused
        ``name`` is not one of :data:`ARCHITECTURES`; the message starts with ``where``.
    """
    arch = ARCHITECTURES.get(name or "")
    if arch is None:
        raise ArchRefused(
            f"{where}: {name} is not supported for blending (supported: {supported()})"
        )
    return arch


#: Config options of supported architectures that change the layer in ways the pass does
#: not reproduce (vLLM reads them from the Hugging Face config).
_REFUSED_OPTIONS = {
    "llama_4_scaling": "Llama 4 attention scaling",
    "ada_rms_norm_t_cond": "an adaptive RMSNorm",
    "dual_chunk_attention_config": "dual-chunk attention",
    # Gemma 2's (Gemma 3 has none: its configs say None)
    "attn_logit_softcapping": "attention logit softcapping",
    "final_logit_softcapping": "final logit softcapping",
    # Gemma 3's encoder use (EmbeddingGemma)
    "use_bidirectional_attention": "bidirectional attention",
}


def check_config(name: str | None, hf_config: Any, where: str) -> Arch:
    """Return the :class:`Arch` of architecture ``name`` whose Hugging Face config is given.

    Decided from the config alone, so that vLLM's scheduler and worker processes agree
    before any model is loaded.

    Raises
    ------
    ArchRefused
        ``name`` is not one of :data:`ARCHITECTURES`, or the config turns on an option
        the pass does not reproduce; the message starts with ``where``.
    """
    arch = lookup(name, where)
    for key, what in _REFUSED_OPTIONS.items():
        if hf_config is not None and getattr(hf_config, key, None):
            raise ArchRefused(f"{where}: {arch.name} with {what} ({key}) is not blended")
    if arch.local_layers and hf_config is not None:
        sliding_windows(arch, hf_config, where)
    return arch


#: The layer types of transformers' ``layer_types`` the passes drive.
FULL, SLIDING = "full_attention", "sliding_attention"


def layer_types(cfg: Any, num_layers: int) -> list[str] | None:
    """Return each layer's type as the config gives it: ``layer_types``, or one derived from
    ``sliding_window_pattern`` (every Nth layer, 1-based, full: Gemma 3's older configs); None
    when the config has neither. Not checked (the callers say what they take)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return [str(t) for t in types]
    pattern = getattr(cfg, "sliding_window_pattern", None)
    if isinstance(pattern, int) and pattern > 0:
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    return None


def sliding_windows(arch: Arch, hf_config: Any, where: str) -> list[int | None]:
    """Return each layer's sliding window (None: a full-attention layer) from the config.

    From ``layer_types`` (``"sliding_attention"`` or ``"full_attention"``) when the
    config has it, else from ``sliding_window_pattern`` (every ``pattern``-th layer,
    1-based, is full: Gemma 3's older configs). A local layer's row at position p reads
    the keys at p - window + 1 .. p (transformers' ``sliding_window_overlay``: kv > q -
    window). All full for an architecture without local layers.

    Raises
    ------
    ArchRefused
        Local layers without a positive ``sliding_window``, a layer type other than
        those two, or neither ``layer_types`` nor ``sliding_window_pattern``.
    """
    n = int(hf_config.num_hidden_layers)
    if not arch.local_layers:
        return [None] * n
    types = layer_types(hf_config, n)
    if types is None:
        raise ArchRefused(f"{where}: {arch.name} config has neither layer_types nor "
                          "sliding_window_pattern")
    types = types[:n]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ArchRefused(f"{where}: {arch.name} layer types {types} ({SLIDING} or "
                          f"{FULL}, one per layer of {n})")
    window = getattr(hf_config, "sliding_window", None)
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise ArchRefused(f"{where}: {arch.name} has local layers without a sliding window")
    return [window if t == SLIDING else None for t in types]


def _check_local_parts(arch: Arch, layer: Any, i: int, own_window: Any,
                       windows: list[int | None], where: str) -> None:
    """Check decoder layer ``i``'s sandwich norms and its attention's own sliding window
    (``own_window``, as the engine's module holds it) against ``arch`` and the config's
    ``windows`` (:func:`sliding_windows`)."""
    sandwich = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    if arch.sandwich_norm != all(hasattr(layer, x) for x in sandwich):
        what = "no" if arch.sandwich_norm else "unexpected"
        raise ArchRefused(f"{where}: {arch.name} decoder layer {i}: {what} {'/'.join(sandwich)}")
    if arch.local_layers and own_window != windows[i]:
        raise ArchRefused(f"{where}: {arch.name} decoder layer {i}: sliding window "
                          f"{own_window}, the config's {windows[i]}")


def _check_parts(arch: Arch, attn: Any, layer: int, bias_of: list[Any], where: str,
                 mlp: Any = None) -> None:
    """Check one attention module (and the layer's MLP) against what ``arch`` says it has.

    A mixture-of-experts architecture may keep dense MLPs in some layers (Qwen3-MoE's
    ``mlp_only_layers``, ``decoder_sparse_step``): the pass calls ``mlp`` whole either way.
    """
    if hasattr(mlp, "experts") and hasattr(mlp, "gate") and not arch.moe:
        raise ArchRefused(f"{where}: {arch.name} decoder layer {layer} has a mixture of "
                          "experts the pass does not route")
    if arch.moe and getattr(mlp, "shared_expert", None) is not None:
        raise ArchRefused(f"{where}: {arch.name} decoder layer {layer} has a shared expert")
    if arch.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        raise ArchRefused(f"{where}: {arch.name} decoder layer {layer} has no q_norm/k_norm")
    if not arch.qk_norm and (hasattr(attn, "q_norm") or hasattr(attn, "k_norm")):
        raise ArchRefused(
            f"{where}: {arch.name} decoder layer {layer} has Q/K norms the pass would skip"
        )
    if arch.qkv_bias and any(getattr(m, "bias", None) is None for m in bias_of):
        raise ArchRefused(f"{where}: {arch.name} decoder layer {layer} has no QKV bias")


def for_vllm(model: Any) -> Arch:
    """Check the model vLLM runs and return its :class:`Arch` (by vLLM's model class).

    Raises
    ------
    ArchRefused
        Another model class, or one of Mistral's options the pass does not reproduce
        (Llama 4 attention scaling, adaptive RMSNorm), Qwen's dual-chunk attention, or
        layers without the norms or bias their architecture has.
    """
    where = "kvblend"
    arch = lookup(type(model).__name__, where)
    windows = sliding_windows(arch, model.config, where) if arch.local_layers else []
    if arch.scaled_embedding and not hasattr(model.model, "normalizer"):
        raise ArchRefused(f"{where}: {arch.name} has no scaled embedding (normalizer)")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        # vLLM's attention layer says which layers are local (its kernel takes the window)
        _check_local_parts(arch, layer, i,
                           getattr(getattr(attn, "attn", None), "sliding_window", None),
                           windows, where)
        if getattr(attn, "do_llama_4_scaling", False):
            raise ArchRefused(f"{where}: {arch.name} with {_REFUSED_OPTIONS['llama_4_scaling']}")
        if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
            raise ArchRefused(
                f"{where}: {arch.name} with {_REFUSED_OPTIONS['ada_rms_norm_t_cond']}"
            )
        if getattr(attn, "dual_chunk_attention_config", None):
            raise ArchRefused(
                f"{where}: {arch.name} with {_REFUSED_OPTIONS['dual_chunk_attention_config']}"
            )
        _check_parts(arch, attn, i, [getattr(attn, "qkv_proj", None)], where,
                     getattr(layer, "mlp", None))
    return arch


def for_hf(model: Any) -> Arch:
    """Check a transformers model and return its :class:`Arch` (by its class name).

    Raises
    ------
    ArchRefused
        Another model class, or layers without the norms or bias their architecture has.
    """
    where = "kvblend.hf"
    arch = lookup(type(model).__name__, where)
    windows = sliding_windows(arch, model.config, where)
    if arch.scaled_embedding and not hasattr(model.model.embed_tokens, "embed_scale"):
        raise ArchRefused(f"{where}: {arch.name} has no scaled embedding (embed_scale)")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        names = ("qkv_proj",) if arch.fused_qkv else ("q_proj", "k_proj", "v_proj")
        projs = [getattr(attn, p, None) for p in names]
        if any(p is None for p in projs):
            raise ArchRefused(f"{where}: {arch.name} decoder layer {i} has no {'/'.join(names)}")
        # transformers' own attention module says which layers are local: it must agree
        _check_local_parts(arch, layer, i, getattr(attn, "sliding_window", None), windows,
                           where)
        _check_parts(arch, attn, i, projs, where, getattr(layer, "mlp", None))
    return arch


def finish_hf(arch: Arch, layer: Any, h: Any, o: Any) -> Any:
    """Return transformers' decoder ``layer`` of ``arch`` after its attention.

    The residual adds of the attention's projected output ``o`` [n, hidden] and of the MLP
    to h [n, hidden], with Gemma's sandwich norms around each sublayer's output.
    """
    if arch.sandwich_norm:
        h = h + layer.post_attention_layernorm(o)
        return h + layer.post_feedforward_layernorm(
            mlp_3d(arch, layer.mlp, layer.pre_feedforward_layernorm(h)))
    h = h + o
    return h + mlp_3d(arch, layer.mlp, layer.post_attention_layernorm(h))


def norm_qk(arch: Arch, attn: Any, q: Any, k: Any) -> tuple[Any, Any]:
    """Apply ``arch``'s per-head norms to q [n, heads, d] and k [n, kv_heads, d] (before RoPE).

    Returns q and k unchanged for an architecture without them.
    """
    if not arch.qk_norm:
        return q, k
    return attn.q_norm(q), attn.k_norm(k)


def mlp_3d(arch: Arch, mlp: Any, x: Any) -> Any:
    """Transformers' MLP of ``arch`` on x [n, hidden]: its mixture-of-experts block takes a
    batch dimension, a dense MLP (also a dense layer of a mixture) any shape."""
    return mlp(x[None])[0] if arch.moe else mlp(x)
