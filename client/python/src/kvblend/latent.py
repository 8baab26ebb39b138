"""DeepSeek's multi-head latent attention (MLA) cache in kvblend's K and V planes.

An MLA layer (DeepSeek-V2, V3; arXiv 2405.04434, section 2.1) caches one row a token:
the compressed latent c (``kv_lora_rank`` values, after its RMSNorm, with no position
in it), then the decoupled RoPE key k_pe (``qk_rope_head_dim`` values, rotated at the
token's position in interleaved pairs (2j, 2j + 1): DeepSeek's complex rotation, vLLM's
``is_neox_style=False``, kvblend's ``gptj``). vLLM's MLA cache holds these rows as
``[blocks, block_size, L + R]``; transformers' ``DynamicCache`` holds c as a layer's keys
and k_pe as its values.

The daemon stores a K and a V plane of ``[tokens, kv_heads, head_dim]`` per layer and
re-rotates the first ``rotary_dim`` dimensions of K. :class:`Latent` splits a row into
one KV head of ``head_dim = (L + R) / 2`` so that only k_pe is ever rotated and no byte
is added::

    K = [k_pe (R) | c[0 : head_dim - R]]      rotary_dim R, gptj pairs
    V = c[head_dim - R : L]

A re-rotated GET or a landing therefore moves k_pe to the chunk's new position and hands
the latent back bit for bit, and the daemon's selection over K and V reads the whole
row, latent included. Needs L + R even and L >= R (DeepSeek-V2 and V3: 512 + 64).
No torch needed: rows may be NumPy arrays or torch tensors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Latent(NamedTuple):
    """One MLA cache row's shape: ``rank`` latent values, then ``rope_dim`` k_pe values."""

    rank: int
    rope_dim: int

    @property
    def head_dim(self) -> int:
        """The stored head's width: half the row."""
        return (self.rank + self.rope_dim) // 2

    @property
    def row(self) -> int:
        return self.rank + self.rope_dim

    def check(self) -> Latent:
        """Return self, or raise ValueError naming why this row cannot be split."""
        if self.rank <= 0 or self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"an MLA row of kv_lora_rank {self.rank} and qk_rope_head_dim "
                             f"{self.rope_dim}: both must be positive, the RoPE part even")
        if self.row % 2 or self.rank < self.rope_dim:
            raise ValueError(f"an MLA row of kv_lora_rank {self.rank} + qk_rope_head_dim "
                             f"{self.rope_dim}: kvblend splits it into two equal planes with "
                             "the RoPE key first, which needs an even row and "
                             "kv_lora_rank >= qk_rope_head_dim")
        return self

    def split(self, rows: Any) -> Any:
        """Return the daemon's ``[..., 2, tokens, 1, head_dim]`` for rows ``[..., tokens, L + R]``.

        Every leading dimension (layers) is kept; the result is a new array of the rows'
        type and dtype.
        """
        self.check()
        if len(rows.shape) < 2:
            raise ValueError(f"MLA rows of shape {tuple(rows.shape)}, expected "
                             f"[..., tokens, {self.row}]")
        if rows.shape[-1] != self.row:
            raise ValueError(f"MLA rows of width {rows.shape[-1]}, expected {self.row}")
        h, r = self.head_dim, self.rope_dim
        shape = (*rows.shape[:-2], 2, rows.shape[-2], 1, h)
        out = _empty_like(rows, shape)
        out[..., 0, :, 0, :r] = rows[..., self.rank:]
        out[..., 0, :, 0, r:] = rows[..., : h - r]
        out[..., 1, :, 0, :] = rows[..., h - r: self.rank]
        return out

    def join(self, kv: Any) -> Any:
        """The inverse of :meth:`split`: ``[..., 2, tokens, 1, head_dim]`` to rows."""
        self.check()
        h, r = self.head_dim, self.rope_dim
        if len(kv.shape) < 4 or kv.shape[-4] != 2 or tuple(kv.shape[-2:]) != (1, h):
            raise ValueError(f"MLA planes of shape {tuple(kv.shape)}, expected "
                             f"[..., 2, tokens, 1, {h}]")
        shape = (*kv.shape[:-4], kv.shape[-3], self.row)
        out = _empty_like(kv, shape)
        out[..., self.rank:] = kv[..., 0, :, 0, :r]
        out[..., : h - r] = kv[..., 0, :, 0, r:]
        out[..., h - r: self.rank] = kv[..., 1, :, 0, :]
        return out


def _empty_like(a: Any, shape: tuple[int, ...]) -> Any:
    if hasattr(a, "new_empty"):  # a torch tensor
        return a.new_empty(shape)
    return np.empty(shape, a.dtype)


def latent_of(cfg: Any) -> Latent | None:
    """Return the :class:`Latent` of a Hugging Face config with MLA, or None without it.

    MLA is read from ``kv_lora_rank`` and ``qk_rope_head_dim`` (DeepSeek-V2 and V3,
    Kimi-K2 and other DeepSeek-V3 architectures).
    """
    rank = getattr(cfg, "kv_lora_rank", None)
    if rank is None:
        return None
    return Latent(int(rank), int(getattr(cfg, "qk_rope_head_dim", 0) or 0))
