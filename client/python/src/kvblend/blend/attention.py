"""The blend pass's attention: some rows of a prompt over a layer's whole KV, causal.

:func:`causal_attention` is the reference every model's layer operations can use
(PyTorch's fused attention, any device); :func:`runs` splits the rows into runs of
consecutive positions, the shape an engine's paged prefill kernel takes them in (vLLM's:
:mod:`kvblend.vllm.attention`). Imports torch; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def causal_attention(q, keys, values, rows, scaling: float) -> torch.Tensor:
    """Attention of q [n, heads, d] (the tokens rows) over keys, values [N, kv_heads, d].

    Row i sees keys 0..rows[i] (causal in prompt order; rows increasing); grouped-query
    heads share a KV head in order (query head j reads KV head j // (heads / kv_heads)).
    Returns [n, heads * d]. PyTorch's fused attention (no [heads, n, N] scores
    materialised, no copies of the KV per query head): a plain causal mask when the rows
    are the whole prompt in order, else a boolean [n, N] mask.
    """
    n, big_n = q.shape[0], keys.shape[0]
    if n == 0:
        return q.new_zeros(0, q.shape[1] * q.shape[2])
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, keys, values))
    kw = {"scale": scaling, "enable_gqa": q.shape[1] != keys.shape[1]}
    if n == big_n and bool(rows[-1] == n - 1):  # increasing rows: all of them, in order
        o = sdpa(qt, kt, vt, is_causal=True, **kw)
    else:
        mask = torch.arange(big_n, device=keys.device)[None, :] <= rows[:, None]
        o = sdpa(qt, kt, vt, attn_mask=mask, **kw)
    return o[0].transpose(0, 1).reshape(n, -1)


def runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split increasing positions ``rows`` into runs of consecutive ones.

    Returns (query_start_loc [runs + 1], seq_lens [runs]) as int32: run j holds the rows
    query_start_loc[j]..query_start_loc[j + 1] - 1, and its last position is
    seq_lens[j] - 1.
    """
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
        return np.zeros(1, np.int32), np.zeros(0, np.int32)
    ends = np.flatnonzero(np.diff(rows) != 1)  # the last index of each run but the last
    last = np.append(ends, rows.size - 1)
    qsl = np.concatenate(([0], last + 1)).astype(np.int32)
    return qsl, (rows[last] + 1).astype(np.int32)
