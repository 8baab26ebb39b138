"""The blend pass's attention through vLLM's own CPU attention kernel.

:func:`kvblend.blend.attention.causal_attention` computes the attention of some rows of a
prompt over the whole layer's KV with an exact causal mask in prompt order, in PyTorch.
On vLLM's CPU build the same thing runs several times faster through the kernel vLLM's
own prefill uses (``cpu_attention_with_kv_cache`` over a paged cache), which takes the
rows as requests (:func:`kvblend.blend.attention.runs`): each run of consecutive rows
p..q is one request of q - p + 1 queries over the keys 0..q (a causal prefill of the
run's tokens with the keys before them as context), so every row i sees keys 0..rows[i]
and no other. :class:`PagedAttention` keeps
one layer's KV in a scratch paged cache of its own (not vLLM's: the blend's cache write
stays where it was) and is reused across layers and prompts.

Relies on vLLM's private ops (``vllm._custom_ops.cpu_attn_reshape_and_cache``,
``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache``, the "vec" ISA) as
vLLM 0.32 has them; :func:`paged_attention_for` returns None where they are missing or do
not fit (another device, head size or dtype), and the caller falls back to
``causal_attention``. Imports torch; imported only by :mod:`kvblend.vllm.blend`.
"""

from __future__ import annotations

import torch

from ..blend.attention import runs

#: Tokens per block of the scratch cache (the "vec" ISA needs a multiple of 32).
BLOCK_SIZE = 32
_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PagedAttention:
    """Attention of selected rows over a layer's KV with vLLM's CPU kernel.

    One object per model (heads, KV heads, head size, dtype fixed); not thread-safe.
    """

    def __init__(self, ops, num_heads: int, num_kv_heads: int, head_dim: int, dtype) -> None:
        self.ops = ops
        self.heads, self.kv_heads, self.head_dim, self.dtype = (
            num_heads,
            num_kv_heads,
            head_dim,
            dtype,
        )
        self.cache = torch.empty(0, dtype=dtype)
        self._n = -1  # the prompt length the cache, table and slots are laid out for
        self._rows: torch.Tensor | None = None  # the rows the request metadata describes

    def _layout(self, n: int) -> None:
        """Size the scratch cache, block table and slot mapping for a prompt of n tokens."""
        if n == self._n:
            return
        blocks = -(-n // BLOCK_SIZE)
        if self.cache.shape[0] < blocks:
            self.cache = torch.zeros(
                blocks, self.kv_heads, 2 * BLOCK_SIZE, self.head_dim, dtype=self.dtype
            )
        self.key_cache, self.value_cache = self.cache[:blocks].chunk(2, dim=2)
        self.table = torch.arange(blocks, dtype=torch.int32)[None]
        self.slots = torch.arange(n, dtype=torch.int64)
        self._n, self._rows = n, None

    def _requests(self, rows: torch.Tensor) -> None:
        """One request per run of consecutive rows (kept while the rows stay the same)."""
        if rows is self._rows:  # held here, so no other tensor can be the same object
            return
        qsl, seq_lens = runs(rows.cpu().numpy())
        self.qsl, self.seq_lens = torch.from_numpy(qsl), torch.from_numpy(seq_lens)
        self.block_table = self.table.expand(seq_lens.size, -1)
        self.meta = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=int(seq_lens.size),
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            seq_lens=self.seq_lens,
            dtype=self.dtype,
            query_start_loc=self.qsl,
            causal=True,
            sliding_window_size=-1,
            isa="vec",
            enable_kv_split=False,
        )
        self._rows = rows

    def __call__(self, q, keys, values, rows, scaling: float) -> torch.Tensor:
        """Attend as :func:`kvblend.blend.attention.causal_attention` does.

        q [n, heads, d] of the increasing positions rows, keys and values [N, kv_heads, d];
        returns [n, heads * d].
        """
        if q.shape[0] == 0:
            return q.new_zeros(0, q.shape[1] * q.shape[2])
        n = keys.shape[0]
        self._layout(n)
        self._requests(rows)
        self.ops.cpu_attn_reshape_and_cache(
            keys, values, self.key_cache, self.value_cache, self.slots, "vec"
        )
        q = q.contiguous()
        out = torch.empty_like(q)
        self.ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            output=out,
            query_start_loc=self.qsl,
            seq_lens=self.seq_lens,
            scale=float(scaling),
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=self.block_table,
            softcap=0.0,
            scheduler_metadata=self.meta,
            s_aux=None,
        )
        return out.reshape(q.shape[0], -1)


def paged_attention_for(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype
) -> PagedAttention | None:
    """Return a :class:`PagedAttention` for this model, or None where it does not apply.

    None: not on the CPU, vLLM without its CPU attention ops, another head size or dtype,
    or heads not a multiple of the KV heads.
    """
    if device.type != "cpu" or head_dim not in _HEAD_SIZES or dtype not in _DTYPES:
        return None
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return None
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    needed = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "get_scheduler_metadata")
    if not all(hasattr(torch.ops._C, name) for name in needed):
        return None
    return PagedAttention(ops, num_heads, num_kv_heads, head_dim, dtype)
