"""The blend pass's attention through vLLM's own CPU attention kernel.

:func:`kvblend.blend.attention.causal_attention` computes the attention of some rows of a
prompt over the whole layer's KV with an exact causal mask in prompt order, in PyTorch.
On vLLM's CPU build the same thing runs several times faster through the kernel vLLM's
own prefill uses (``cpu_attention_with_kv_cache`` over a paged cache), which takes the
rows as requests (:func:`kvblend.blend.attention.runs`): each run of consecutive rows
p..q is one request of q - p + 1 queries over the keys 0..q (a causal prefill of the
run's tokens with the keys before them as context), so every row i sees keys 0..rows[i]
and no other. A local layer's sliding window W (Gemma 3's) is the kernel's own: row i
then sees keys rows[i] - W + 1 .. rows[i], as vLLM's prefill of that layer does (measured
against that mask). :class:`PagedAttention` keeps
one layer's KV in a scratch paged cache of its own (not vLLM's: the blend's cache write
stays where it was) and is reused across layers and prompts.

Relies on vLLM's private ops (``vllm._custom_ops.cpu_attn_reshape_and_cache``,
``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache``, the "vec" ISA) as
vLLM 0.32 has them; :func:`paged_attention_for` returns None where they are missing or do
not fit (another device, head size or dtype), and the caller falls back to
``causal_attention``. Imports torch; imported only by :mod:`kvblend.vllm.blend`.
"""

from __future__ import annotations

import functools

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
        self._window = -1  # the sliding window the metadata is for (-1: none)

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

    def _requests(self, rows: list[torch.Tensor], window: int) -> None:
        """One request per run of consecutive rows of each prompt (kept while rows and the
        window stay)."""
        if (
            self._rows is not None
            and window == self._window
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
            sliding_window_size=window,
            isa="vec",
            enable_kv_split=False,
        )
        self._rows, self._window = list(rows), window

    def __call__(self, q, keys, values, rows, scaling: float,
                 window: int | None = None) -> torch.Tensor:
        """Attend as :func:`kvblend.blend.attention.causal_attention` does.

        q [n, heads, d] of the increasing positions rows, keys and values [N, kv_heads, d];
        ``window``: a local layer's sliding window (None: full attention); returns
        [n, heads * d].
        """
        return self.many([q], [keys], [values], [rows], scaling, window)

    def many(self, qs, keys, values, rows, scaling: float,
             window: int | None = None) -> torch.Tensor:
        """Attend several prompts in one kernel call, each over its own KV.

        Lists, one entry a prompt, as :meth:`__call__` takes them; returns the prompts'
        outputs one after another, [sum of n, heads * d].
        """
        n = sum(q.shape[0] for q in qs)
        if n == 0:
            return qs[0].new_zeros(0, qs[0].shape[1] * qs[0].shape[2])
        w = -1 if window is None else int(window)
        self._layout(tuple(k.shape[0] for k in keys))
        self._requests(rows, w)
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
            sliding_window=w,
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


class VarlenAttention:
    """Attention of selected rows through FlashAttention's varlen kernel (vLLM's, on a GPU).

    The same split as :class:`PagedAttention`: each run of consecutive rows p..q of a
    prompt is one sequence of q - p + 1 queries over keys 0..q, and FlashAttention's
    causal mask, aligned to the bottom right of each sequence's scores (its documented
    contract), lets row i see keys 0..rows[i] and no other. The layer's KV is copied once
    into a scratch paged cache of its own (``[blocks, BLOCK, kv_heads, head_dim]``, each
    prompt in its own blocks), which every run of the prompt reads through its row of the
    block table (``seqused_k``: the run's last position + 1), so keys are never copied
    per run. ``fn`` is the kernel (``flash_attn_varlen_func`` of
    ``vllm.v1.attention.backends.fa_utils``, with vLLM's FlashAttention version); tests
    give a reference of its contract. One object per model; not thread-safe.
    """

    #: Tokens per block of the scratch cache (vLLM's FlashAttention takes multiples of 16).
    BLOCK = 16

    def __init__(self, fn, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.fn = fn
        self.heads, self.kv_heads, self.head_dim, self.dtype = (
            num_heads, num_kv_heads, head_dim, dtype,
        )
        self.device = torch.device(device)
        self.k_cache = torch.empty(0, self.BLOCK, num_kv_heads, head_dim, dtype=dtype,
                                   device=self.device)
        self.v_cache = torch.empty_like(self.k_cache)
        self._key: tuple | None = None  # the prompt lengths and rows the metadata is for
        self._rows: list[torch.Tensor] | None = None

    def __call__(self, q, keys, values, rows, scaling: float,
                 window: int | None = None) -> torch.Tensor:
        """Attend as :func:`kvblend.blend.attention.causal_attention` does."""
        return self.many([q], [keys], [values], [rows], scaling, window)

    def _metadata(self, ns: tuple[int, ...], rows: list[torch.Tensor]) -> None:
        """The block table, query starts and key counts of every run (kept while rows stay)."""
        if (
            self._key == ns
            and self._rows is not None
            and len(rows) == len(self._rows)
            and all(a is b for a, b in zip(rows, self._rows))
        ):
            return
        blocks = [-(-n // self.BLOCK) for n in ns]
        self.base = [sum(blocks[:i]) for i in range(len(ns))]
        self.blocks = blocks
        total = sum(blocks)
        if self.k_cache.shape[0] < total:
            shape = (total, self.BLOCK, self.kv_heads, self.head_dim)
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros_like(self.k_cache)
        tables = np.zeros((len(ns), max(blocks)), np.int32)
        for i, (b, nb) in enumerate(zip(self.base, blocks)):  # (the rest of a row: unread)
            tables[i, :nb] = np.arange(b, b + nb)
        qsl, seq, owner = [np.zeros(1, np.int32)], [], []
        for i, r in enumerate(rows):
            q, lens = runs(r.cpu().numpy())
            qsl.append(q[1:] + qsl[-1][-1])
            seq.append(lens)
            owner.append(np.full(lens.size, i))
        qsl, seq = np.concatenate(qsl), np.concatenate(seq)
        dev = self.device
        self.qsl = torch.from_numpy(qsl).to(dev)
        self.seq = torch.from_numpy(seq).to(dev)
        self.table = torch.from_numpy(tables[np.concatenate(owner)]).to(dev)
        self.max_q = int(np.diff(qsl).max()) if seq.size else 0
        self.max_k = int(seq.max()) if seq.size else 0
        self._key, self._rows = ns, list(rows)

    def many(self, qs, keys, values, rows, scaling: float,
             window: int | None = None) -> torch.Tensor:
        """Attend several prompts in one kernel call, each over its own KV (lists, one
        entry a prompt); returns their outputs one after another, [sum of n, heads * d].
        ``window``: a local layer's sliding window, FlashAttention's ``window_size`` of
        (window - 1, 0): row i sees keys rows[i] - window + 1 .. rows[i]."""
        n = sum(q.shape[0] for q in qs)
        if n == 0:
            return qs[0].new_zeros(0, qs[0].shape[1] * qs[0].shape[2])
        self._metadata(tuple(k.shape[0] for k in keys), rows)
        for k, v, b, nb in zip(keys, values, self.base, self.blocks):
            flat = slice(b, b + nb)
            self.k_cache[flat].view(-1, self.kv_heads, self.head_dim)[: k.shape[0]] = k
            self.v_cache[flat].view(-1, self.kv_heads, self.head_dim)[: v.shape[0]] = v
        extra = {} if window is None else {"window_size": (int(window) - 1, 0)}
        out = self.fn(
            q=_cat(qs).contiguous(),
            k=self.k_cache,
            v=self.v_cache,
            max_seqlen_q=self.max_q,
            cu_seqlens_q=self.qsl,
            max_seqlen_k=self.max_k,
            seqused_k=self.seq,
            softmax_scale=float(scaling),
            causal=True,
            block_table=self.table,
            **extra,
        )
        return out.reshape(n, -1)


#: The dtypes FlashAttention computes in.
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention_for(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype
) -> VarlenAttention | None:
    """Return a :class:`VarlenAttention` over vLLM's FlashAttention, or None.

    None: not on a CUDA device, float32 (FlashAttention takes float16 and bfloat16), a
    head size it does not take (a multiple of 8 up to 256), heads not a multiple of the
    KV heads, or vLLM without its FlashAttention (the caller falls back to PyTorch's
    fused attention, :func:`kvblend.blend.attention.causal_attention`).
    """
    if device.type != "cuda" or dtype not in _VARLEN_DTYPES:
        return None
    if head_dim % 8 or head_dim > 256 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        return None
    try:
        from vllm.v1.attention.backends import fa_utils

        version = fa_utils.get_flash_attn_version(
            head_size=head_dim, kv_cache_block_size=VarlenAttention.BLOCK
        )
        fn = fa_utils.flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - any import or probe failure: PyTorch's attention
        return None
    if version is not None:
        fn = functools.partial(fn, fa_version=version)
    return VarlenAttention(fn, num_heads, num_kv_heads, head_dim, dtype, device)
