"""Array checks and conversions shared by the client and its sessions (private)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _lib

if TYPE_CHECKING:
    from .types import Model


def _as_array(x: Any) -> np.ndarray:
    """Return x as a NumPy array; a CPU torch tensor is viewed (bfloat16 as raw uint16)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: its raw bits
            import torch  # only reached with a tensor, so torch is importable

            t = t.view(torch.int16)
            return t.numpy().view(np.uint16)
        return t.numpy()
    return np.asarray(x)


def _dtype_ok(a: np.ndarray, m: Model) -> bool:
    """Whether a's elements are m's dtype.

    f16 and f32 exactly; bf16 as its raw 16 bits (uint16 or int16) or a NumPy extension
    bfloat16 (ml_dtypes).
    """
    if m.dtype == "bf16":
        return a.dtype.itemsize == 2 and (a.dtype.kind in "ui" or a.dtype.name == "bfloat16")
    return a.dtype == m.np_dtype


def _row_shape_ok(shape: tuple[int, ...], rows: int, m: Model) -> bool:
    """Whether shape is [rows, kv_heads, head_dim] or [rows, kv_heads * head_dim]."""
    return tuple(shape) in (
        (rows, m.num_kv_heads, m.head_dim),
        (rows, m.num_kv_heads * m.head_dim),
    )


def _stats_dict(arr: Any, n: int) -> dict[str, float]:
    try:
        return {arr[i].name.decode(): arr[i].value for i in range(n)}
    finally:
        _lib.free(arr)
