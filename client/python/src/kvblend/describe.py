"""A model's KV described from its Hugging Face config: the one place that reads RoPE.

Both engines describe their model to the daemon from the same Hugging Face config
fields: :func:`kvblend.hf.model_spec` for a transformers model and
:func:`kvblend.vllm.config.model_from_vllm` for vLLM's engine. Each checks what its own
blend pass can drive and counts layers and heads its own way (vLLM per pipeline stage);
the RoPE they hand the daemon (base, rotated dimensions, scaling) is read here, so a new
RoPE field is added once. Needs no torch nor transformers: a config is read by
attribute.
"""

from __future__ import annotations

from typing import Any

from .types import Model

#: Hugging Face rope types kvblend re-rotates exactly ("default" and "none" are plain RoPE).
ROPE_SCALINGS = ("none", "default", "linear", "llama3", "yarn", "dynamic")


class Undescribable(ValueError):
    """The config has something kvblend cannot describe exactly; the message names it."""


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """Return the config's RoPE parameters (transformers 5's ``rope_parameters``, or {})."""
    return dict(getattr(cfg, "rope_parameters", None) or {})


def rope_theta(cfg: Any) -> float:
    """Return the RoPE base, from ``rope_parameters`` or the older ``rope_theta``."""
    theta = rope_parameters(cfg).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise Undescribable("the model config has no rope_theta")
    return float(theta)


def rope_scaling(cfg: Any) -> dict[str, Any] | None:
    """Return the scaling dict: ``rope_parameters`` when it names a type, else ``rope_scaling``."""
    rp = rope_parameters(cfg)
    if rp.get("rope_type", "default") != "default":
        return rp
    return getattr(cfg, "rope_scaling", None)


def scaling_spec(rs: dict[str, Any] | None, max_pos: int | None) -> str:
    """Return kvblend's scaling SPEC (``Model.scaling``) for a Hugging Face scaling dict."""
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
            if rs.get(extra) not in (None, 1, 1.0, 0):
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
        No rope_theta, or a rope scaling kvblend does not re-rotate exactly.
    """
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
    )
