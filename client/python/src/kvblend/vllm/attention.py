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

import numpy as np
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
        self._ns: tuple[int, ...] = ()  # the prompt lengths the cache is laid out for
        self._rows: list[torch.Tensor] | None = None  # the rows the metadata describes

    def _layout(self, ns: tuple[int, ...]) -> None:
        """Lay out the scratch cache for prompts of ns tokens, each in its own blocks.

        Sets the slots of every prompt's keys and each prompt's row of the block table.
        """
        if ns == self._ns:
            return
        blocks = [-(-n // BLOCK_SIZE) for n in ns]
        total = sum(blocks)
        if self.cache.shape[0] < total:
            self.cache = torch.zeros(
                total, self.kv_heads, 2 * BLOCK_SIZE, self.head_dim, dtype=self.dtype
            )
        self.key_cache, self.value_cache = self.cache[:total].chunk(2, dim=2)
        base = [sum(blocks[:i]) for i in range(len(ns))]
        self.tables = torch.zeros(len(ns), max(blocks), dtype=torch.int32)
        for i, (b, nb) in enumerate(zip(base, blocks)):  # (the rest of a row is never read)
            self.tables[i, :nb] = torch.arange(b, b + nb, dtype=torch.int32)
        self.slots = torch.cat(
            [torch.arange(b * BLOCK_SIZE, b * BLOCK_SIZE + n) for b, n in zip(base, ns)]
        )
        self._ns, self._rows = ns, None

    def _requests(self, rows: list[torch.Tensor]) -> None:
        """One request per run of consecutive rows of each prompt (kept while rows stay)."""
        if (
            self._rows is not None
            and len(rows) == len(self._rows)
            and all(a is b for a, b in zip(rows, self._rows))
        ):  # held here, so no other tensor can be the same object
            return
        qsl, seq_lens, table = [np.zeros(1, np.int32)], [], []
        for i, r in enumerate(rows):
            q, lens = runs(r.cpu().numpy())
            qsl.append(q[1:] + qsl[-1][-1])
            seq_lens.append(lens)
            table.append(np.full(lens.size, i))
        self.qsl = torch.from_numpy(np.concatenate(qsl))
        self.seq_lens = torch.from_numpy(np.concatenate(seq_lens))
        self.block_table = self.tables[torch.from_numpy(np.concatenate(table))]
        self.meta = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=int(self.seq_lens.numel()),
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
        self._rows = list(rows)

    def __call__(self, q, keys, values, rows, scaling: float) -> torch.Tensor:
        """Attend as :func:`kvblend.blend.attention.causal_attention` does.

        q [n, heads, d] of the increasing positions rows, keys and values [N, kv_heads, d];
        returns [n, heads * d].
        """
        return self.many([q], [keys], [values], [rows], scaling)

    def many(self, qs, keys, values, rows, scaling: float) -> torch.Tensor:
        """Attend several prompts in one kernel call, each over its own KV.

        Lists, one entry a prompt, as :meth:`__call__` takes them; returns the prompts'
        outputs one after another, [sum of n, heads * d].
        """
        n = sum(q.shape[0] for q in qs)
        if n == 0:
            return qs[0].new_zeros(0, qs[0].shape[1] * qs[0].shape[2])
        self._layout(tuple(k.shape[0] for k in keys))
        self._requests(rows)
        self.ops.cpu_attn_reshape_and_cache(
            _cat(keys), _cat(values), self.key_cache, self.value_cache, self.slots, "vec"
        )
        q = _cat(qs).contiguous()
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
        return out.reshape(n, -1)


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


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
