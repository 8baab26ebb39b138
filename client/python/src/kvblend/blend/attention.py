"""The blend pass's attention: some rows of a prompt over a layer's whole KV, causal
(through a sliding window on a local layer).

:func:`causal_attention` is the reference every model's layer operations can use
(PyTorch's fused attention, any device); :func:`runs` splits the rows into runs of
consecutive positions, the shape an engine's paged prefill kernel takes them in (vLLM's:
:mod:`kvblend.vllm.attention`). Imports torch; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


def causal_attention(q, keys, values, rows, scaling: float, window: int | None = None
                     ) -> torch.Tensor:
    """Attention of q [n, heads, d] (the tokens rows) over keys, values [N, kv_heads, d].

    Row i sees keys 0..rows[i] (causal in prompt order; rows increasing); grouped-query
    heads share a KV head in order (query head j reads KV head j // (heads / kv_heads)).
    ``window``: a local layer's sliding window, row i then sees keys rows[i] - window + 1
    .. rows[i] only (transformers' sliding-window mask: key > query - window); None or a
    window of N or more is the plain causal attention, bit for bit.
    Returns [n, heads * d]. PyTorch's fused attention (no [heads, n, N] scores
    materialised, no copies of the KV per query head): a plain causal mask when the rows
    are the whole prompt in order and no window bites, else a boolean [n, N] mask.
    """
    n, big_n = q.shape[0], keys.shape[0]
    if n == 0:
        return q.new_zeros(0, q.shape[1] * q.shape[2])
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, keys, values))
    kw = {"scale": scaling, "enable_gqa": q.shape[1] != keys.shape[1]}
    local = window is not None and window < big_n
    if not local and n == big_n and bool(rows[-1] == n - 1):  # all rows, in order
        o = sdpa(qt, kt, vt, is_causal=True, **kw)
    else:
        pos = torch.arange(big_n, device=keys.device)[None, :]
        mask = pos <= rows[:, None]
        if local:
            mask &= pos > rows[:, None] - window
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
