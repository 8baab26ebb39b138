"""The RoPE self-test: the daemon must re-rotate this model's keys as vLLM rotates them.

kvblend describes a model's RoPE to the daemon (:func:`kvblend.vllm.config.model_from_vllm`:
theta, scaling, rotary dims, style) and the daemon re-rotates stored keys by that
description. A description that is wrong (a config field kvblend does not read, a scaling
it reads differently) would load keys rotated wrongly, and the engine would answer wrong
without an error. So before the worker loads anything, it checks every layer's own
``rotary_emb`` module against the daemon:

1. the same keys (seeded random rows, in the model's dtype) rotated by vLLM's module at
   positions ``base ..`` and at ``target ..``;
2. the first stored in the daemon under a model of the same description (a name of its
   own, so nothing the engine stores is touched), read back re-rotated to ``target``;
3. compared with the second: the largest difference over the largest key must stay within
   the dtype's rounding (:data:`TOLERANCE`), else :class:`SelfTestFailed` names the layer.

A model whose local layers rotate with a base of their own (Gemma 3's sliding-window
layers: ``rope_local_theta``, ``full_every``) is stored with that description too, so each
layer is checked against the daemon's rotation of its own kind: both kinds are covered.

The chunk is deleted afterwards. Random keys rather than a text's: the rotation is linear
per position and independent of what the keys hold, and random rows use every rotary
channel with weight.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..client import Client
from ..errors import KvblendError
from ..types import Model

#: Largest difference allowed, relative to the largest key, by the model's dtype. Sound
#: descriptions differ by rounding: up to 3.2e-5 in float32 (vLLM's cos/sin table is
#: float32, its angles at position 1000 off by that much), 1.1e-3 in float16, 7.9e-3 in
#: bfloat16 (test_vllm_selftest); wrong ones by 0.3 of the largest key or more (theta off
#: by 1%, a scaling left out or misread, the rotary dim wrong).
TOLERANCE = {"f32": 1e-3, "f16": 8e-3, "bf16": 6e-2}
#: Rows rotated, and the positions compared (``target`` is lowered to fit the module).
ROWS = 16
BASE = 3
TARGET = 1000


class SelfTestFailed(RuntimeError):
    """The daemon re-rotates this model's keys unlike vLLM; the message names the layer."""


def _to_np(t: torch.Tensor, model: Model) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(np.uint16)
    return t.cpu().numpy().astype(model.np_dtype, copy=False)


def _to_f64(a: np.ndarray, model: Model) -> np.ndarray:
    if model.dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def test_model(model: Model, layers: int) -> Model:
    """Return the model the test stores under: ``model``'s description, a name of its own."""
    desc = dataclasses.replace(model, name="", num_layers=layers)
    tag = hashlib.sha256(repr(desc).encode()).hexdigest()[:16]
    return dataclasses.replace(model, name=f"kvblend-selftest-{tag}", num_layers=layers)


def rotated(rotary: Any, keys: torch.Tensor, first: int) -> torch.Tensor:
    """Return ``keys`` [rows, heads, head_dim] rotated by vLLM's ``rotary`` at ``first ..``."""
    n, heads, hd = keys.shape
    pos = torch.arange(first, first + n, device=keys.device)
    k = keys.reshape(n, heads * hd).clone()
    q = k.clone()  # the module rotates both; only k is compared
    _, k = rotary(pos, q, k)
    return k.reshape(n, heads, hd)


def run(client: Client, model: Model, rotaries: Sequence[tuple[str, Any]], seed: int = 0) -> str:
    """Check each ``(layer name, rotary_emb)`` of the engine against the daemon.

    Returns a one-line summary (the largest relative difference, the positions).

    Raises
    ------
    SelfTestFailed
        A layer's keys re-rotated by the daemon differ from vLLM's rotation beyond the
        dtype's rounding.
    KvblendError
        The daemon could not be asked (the caller decides when to try again).
    """
    rotaries = list(rotaries)
    if not rotaries:
        raise SelfTestFailed("kvblend: RoPE self-test: the model has no rotary_emb modules")
    m = test_model(model, len(rotaries))
    limit = min(
        int(getattr(r, "max_position_embeddings", TARGET + ROWS + 1) or TARGET + ROWS + 1)
        for _, r in rotaries
    )
    target = max(BASE + 1, min(TARGET, limit - ROWS - 1))
    gen = torch.Generator().manual_seed(seed)
    device = next((b.device for b in rotaries[0][1].buffers()), torch.device("cpu"))
    tdtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[model.dtype]
    keys = torch.randn(ROWS, model.num_kv_heads, model.head_dim, generator=gen)
    keys = keys.to(device=device, dtype=tdtype)
    kv = np.zeros(m.kv_shape(ROWS), m.np_dtype)
    want = []
    with torch.no_grad():
        for i, (_, rot) in enumerate(rotaries):
            kv[i, 0] = _to_np(rotated(rot, keys, BASE), m)
            want.append(_to_f64(_to_np(rotated(rot, keys, target), m), m))
    h = hashlib.sha256(f"kvblend-selftest {seed} {BASE} {target}".encode()).digest()
    client.model_register(m)
    client.put(m.name, h, kv, base_pos=BASE)
    try:
        got = client.get_rerotated(m.name, h, pos=target)
    finally:
        try:
            client.delete(m.name, h)
        except KvblendError:
            pass
    tol = TOLERANCE[model.dtype]
    worst = 0.0
    for i, (name, _) in enumerate(rotaries):
        g = _to_f64(got[i, 0], m)
        scale = float(np.abs(want[i]).max()) or 1.0
        err = float(np.abs(g - want[i]).max()) / scale
        if not np.isfinite(err) or err > tol:
            raise SelfTestFailed(
                f"kvblend: RoPE self-test failed at layer {i} ({name}): keys stored at "
                f"positions {BASE}.. and re-rotated by the daemon to {target}.. differ from "
                f"vLLM's rotary_emb at {target}.. by {err:.3g} of the largest key (tolerance "
                f"{tol:g} for {model.dtype}): kvblend's description of this model's RoPE "
                f"(theta {model.rope_theta:g}, rotary_dim {model.rotary_dim or model.head_dim}, "
                f"scaling {model.scaling or 'none'}{_local(m, i)}) is wrong; refused, never "
                "served wrong"
            )
        worst = max(worst, err)
    return (
        f"RoPE self-test passed: {len(rotaries)} layers, keys re-rotated from position "
        f"{BASE} to {target}, largest difference {worst:.2g} of the largest key "
        f"(tolerance {tol:g})"
    )


def _local(m: Model, layer: int) -> str:
    """What the description says of a model's local layers, for the failure message."""
    if not m.full_every:
        return ""
    kind = "a local" if m.is_local(layer) else "a full-attention"
    return (f"; local layers' theta {m.rope_local_theta:g}, every {m.full_every}th layer "
            f"full: layer {layer} is {kind} one")


def rotaries_of(model: Any) -> list[tuple[str, Any]]:
    """Return ``(name, rotary_emb)`` of each decoder layer of vLLM's model, in order."""
    layers = model.model.layers
    return [
        (f"model.layers.{i}.self_attn.rotary_emb", layer.self_attn.rotary_emb)
        for i, layer in enumerate(layers)
    ]
