"""KV buffers on the host: NumPy arrays seen as torch tensors and back, bfloat16 included.

The blend pass keeps each prompt's KV in host memory (a region the daemon lands into, or
an array) and computes on the model's device. NumPy has no bfloat16: kvblend holds a
bf16 model's KV as its raw 16 bits (``<u2``, :attr:`kvblend.Model.np_dtype`), which
:func:`tensor` views as ``torch.bfloat16`` and :func:`array` views back, without copies.
Imports torch; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import numpy as np
import torch

#: The KV dtypes the blend pass handles, and each one's NumPy dtype on the host.
NP_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype("<u2"),  # bf16's raw bits, as kvblend.Model has them
}


def np_dtype(dtype: torch.dtype) -> np.dtype:
    """Return the host dtype of KV in torch ``dtype`` (ValueError: not one of NP_DTYPES)."""
    try:
        return NP_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"kvblend: dtype {dtype}; float32, float16 or bfloat16") from None


def tensor(buf: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View a host buffer of KV in ``dtype`` as a torch tensor (shares its memory)."""
    if dtype is torch.bfloat16:
        return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(buf)


def array(t: torch.Tensor) -> np.ndarray:
    """View a CPU tensor as a NumPy array (shares its memory; bfloat16 as raw ``<u2``)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
