"""A model's KV described from its Hugging Face config: the one place that reads RoPE.

Both engines describe their model to the daemon from the same Hugging Face config
fields: :func:`kvblend.hf.model_spec` for a transformers model and
:func:`kvblend.vllm.config.model_from_vllm` for vLLM's engine. Each checks what its own
blend pass can drive and counts layers and heads its own way (vLLM per pipeline stage);
the RoPE they hand the daemon (base, rotated dimensions, scaling) is read here, so a new
RoPE field is added once. Needs no torch nor transformers: a config is read by
attribute.

Models whose layers rotate with two bases (Gemma 3: sliding-window layers with base
10,000, full-attention layers with 1,000,000) are described by :func:`local_layers`:
transformers 5 writes them as ``rope_parameters`` keyed by layer type, earlier releases
as ``rope_local_base_freq`` beside ``rope_theta``; ``layer_types`` (or
``sliding_window_pattern``) says which layer is which.
"""

from __future__ import annotations

from typing import Any

from .blend.arch import FULL, SLIDING, layer_types
from .latent import latent_of
from .types import Model

#: Hugging Face rope types kvblend re-rotates exactly ("default" and "none" are plain RoPE).
ROPE_SCALINGS = ("none", "default", "linear", "llama3", "yarn", "dynamic")


class Undescribable(ValueError):
    """The config has something kvblend cannot describe exactly; the message names it."""


def _per_type(rp: dict[str, Any]) -> bool:
    return FULL in rp or SLIDING in rp


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """Return the config's RoPE parameters (transformers 5's ``rope_parameters``, or {}):
    the full-attention layers' where they are given per layer type."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    return dict(rp.get(FULL) or {}) if _per_type(rp) else rp


def rope_theta(cfg: Any) -> float:
    """Return the RoPE base, from ``rope_parameters`` or the older ``rope_theta``."""
    theta = rope_parameters(cfg).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise Undescribable("the model config has no rope_theta")
    return float(theta)


def rope_scaling(cfg: Any) -> dict[str, Any] | None:
    """Return the scaling dict: ``rope_parameters`` when it names a type, else ``rope_scaling``
    (the full-attention layers' where RoPE is given per layer type)."""
    rp = rope_parameters(cfg)
    if rp.get("rope_type", "default") != "default":
        return rp
    rs = getattr(cfg, "rope_scaling", None)
    if isinstance(rs, dict) and _per_type(rs):
        return None  # transformers 5 mirrors the per-type rope_parameters here
    return rs


def rope_by_type(cfg: Any) -> dict[str, dict[str, Any]]:
    """Return the RoPE parameters per layer type of a model whose layer types rotate apart
    (transformers 5's ``rope_parameters`` keyed by layer type, or transformers 4's
    ``rope_local_base_freq``: the sliding layers' base), else {}."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if _per_type(rp):
        return {t: dict(v) for t, v in rp.items() if isinstance(v, dict)}
    if getattr(cfg, "rope_local_base_freq", None):
        return {SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}}
    return {}


def local_layers(cfg: Any, num_layers: int) -> tuple[float, int]:
    """Return (:attr:`Model.rope_local_theta`, :attr:`Model.full_every`) of the config:
    (0.0, 0) when every layer rotates alike.

    Raises
    ------
    Undescribable
        Sliding layers with a RoPE scaling, a layer type other than full and sliding
        attention, or full-attention layers not every Nth (kvblend describes local layers
        as all but every ``full_every``-th).
    """
    local = rope_by_type(cfg).get(SLIDING)
    if not local:
        return 0.0, 0
    if local.get("rope_type", "default") not in ("default", "none"):
        raise Undescribable(
            f"sliding-window layers with rope scaling {local.get('rope_type')!r} are not "
            "described by kvblend (their RoPE must be plain)"
        )
    theta = local.get("rope_theta")
    if not isinstance(theta, (int, float)) or not theta > 0:
        raise Undescribable("the sliding-window layers' RoPE has no rope_theta")
    types = layer_types(cfg, num_layers)
    if types is None:
        raise Undescribable("a local RoPE base without layer_types or sliding_window_pattern")
    if len(types) < num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise Undescribable(f"layer types {sorted(set(types))} of {len(types)} layers: "
                            f"kvblend describes {FULL} and {SLIDING} of every layer")
    types = types[:num_layers]
    full = [i for i, t in enumerate(types) if t == FULL]
    if not full:
        raise Undescribable("every layer is a sliding-window one: describe its base as rope_theta")
    every = full[0] + 1
    if every < 2 or full != list(range(every - 1, num_layers, every)):
        raise Undescribable(
            f"full-attention layers {full}: kvblend describes local layers as all but every "
            "Nth layer (N >= 2)"
        )
    return float(theta), every


def scaling_spec(rs: dict[str, Any] | None, max_pos: int | None, *,
                 magnitude_free: bool = False) -> str:
    """Return kvblend's scaling SPEC (``Model.scaling``) for a Hugging Face scaling dict.

    ``magnitude_free``: accept YaRN's ``attention_factor``, ``mscale`` and
    ``mscale_all_dim``. They change only the magnitude of every rotated key (the
    frequencies stay YaRN's), which a re-rotation of keys cached after RoPE keeps as it
    is; DeepSeek's latent keys are such (:func:`describe_latent`).
    """
    if not rs:
        return "none"
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise Undescribable(f"rope scaling type {kind!r} is not one kvblend re-rotates exactly")
    if kind in ("none", "default"):
        return "none"
    f = rs.get("factor")
    if not isinstance(f, (int, float)):
        raise Undescribable(f"rope scaling {kind!r} without a numeric factor")
    if kind == "linear":
        return f"linear:{f}"
    orig = rs.get("original_max_position_embeddings") or max_pos
    if kind == "llama3":
        return (
            f"llama3:{f},{rs['low_freq_factor']},{rs['high_freq_factor']},"
            f"{rs['original_max_position_embeddings']}"
        )
    if kind == "yarn":
        for extra in ("attention_factor", "mscale", "mscale_all_dim"):
            if not magnitude_free and rs.get(extra) not in (None, 1, 1.0, 0):
                raise Undescribable(f"yarn with {extra}={rs[extra]} is not described by kvblend")
        return f"yarn:{f},{orig},{rs.get('beta_fast', 32)},{rs.get('beta_slow', 1)}"
    return f"dynamic:{f},{orig}"


def rotary_dim(cfg: Any, head_dim: int) -> int:
    """Return :attr:`Model.rotary_dim`: 0 (all of head_dim) unless a partial rotary factor."""
    prf = rope_parameters(cfg).get(
        "partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)
    )
    rotary = int(head_dim * (prf or 1.0))
    return 0 if rotary == head_dim else rotary


def describe(
    cfg: Any, *, name: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int
) -> Model:
    """Return the :class:`Model` of a model whose keys are cached after neox-pair RoPE.

    The layout (layers, KV heads, head_dim, dtype) comes from the engine; the RoPE from
    ``cfg``, the Hugging Face (text) config.

    Raises
    ------
    Undescribable
        No rope_theta, or a rope scaling kvblend does not re-rotate exactly, or local
        layers :func:`local_layers` does not describe.
    """
    local_theta, full_every = local_layers(cfg, num_layers)
    return Model(
        name=name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rope_theta=rope_theta(cfg),
        rope_style="neox",  # rotate_half pairs (j, j + d/2), in HF and vLLM alike
        rotary_dim=rotary_dim(cfg, head_dim),
        scaling=scaling_spec(rope_scaling(cfg), getattr(cfg, "max_position_embeddings", None)),
        k_pre_rope=False,
        rope_local_theta=local_theta,
        full_every=full_every,
    )


def describe_latent(cfg: Any, *, name: str, dtype: str, num_layers: int) -> Model:
    """Return the :class:`Model` of a model with DeepSeek's latent attention (MLA).

    Each layer's cache row (the latent, then the RoPE key) is stored as one KV head of
    half the row (:class:`kvblend.latent.Latent`): the RoPE key's ``qk_rope_head_dim``
    dimensions are the rotated ones, in interleaved pairs (``gptj``), cached after RoPE,
    as vLLM's DeepSeek-V2/V3 layers and transformers' DeepseekV2 cache them.

    Raises
    ------
    Undescribable
        No MLA in ``cfg``, a row :class:`~kvblend.latent.Latent` cannot split, no
        rope_theta, a rope scaling other than YaRN, or local layers.
    """
    lat = latent_of(cfg)
    if lat is None:
        raise Undescribable("the model config has no kv_lora_rank: not latent attention")
    try:
        lat.check()
    except ValueError as e:
        raise Undescribable(str(e)) from None
    if local_layers(cfg, num_layers) != (0.0, 0):
        raise Undescribable("latent attention with local layers is not described by kvblend")
    rs = rope_scaling(cfg) or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "none", "yarn"):
        # vLLM's DeepSeek layers rotate every scaled RoPE by DeepSeek's YaRN
        # (deepseek_yarn, or deepseek_llama_scaling: the same rotation)
        raise Undescribable(f"latent attention with rope scaling {kind!r}: vLLM rotates it "
                            "as DeepSeek's YaRN; kvblend describes yarn only")
    return Model(
        name=name,
        num_layers=num_layers,
        num_kv_heads=1,
        head_dim=lat.head_dim,
        dtype=dtype,
        rope_theta=rope_theta(cfg),
        rope_style="gptj",  # DeepSeek's complex rotation: pairs (2j, 2j + 1)
        rotary_dim=lat.rope_dim,
        scaling=scaling_spec(rope_scaling(cfg), getattr(cfg, "max_position_embeddings", None),
                             magnitude_free=True),
        k_pre_rope=False,
    )
