"""vLLM's KV cache as the connector reads and writes it: the one module that knows its layout.

vLLM 0.32 on the CPU (attention ISA "vec", ``cpu_attn.py``) views each layer's cache as
``[num_blocks, kv_heads, block_size, 2 * head_dim]``, but lays the bytes out per block and
KV head as K transposed ``[head_dim, block_size]``, then V rows ``[block_size, head_dim]``.
All layers lie in one allocation (``allocate_kv_cache``) at a uniform stride. A request's
token at prompt position p sits in block ``block_ids[p // block_size]``, slot
``p % block_size``.

:class:`PagedCache` keeps the worker's K and V views of every layer and moves token rows
in and out by prompt position through a request's block table (the copy path, the blend's
cache write, the store's gather, the debug dump); :func:`region_views` describes the same
cache to the daemon as strided arrays (the landing path); :func:`full_blocks` and
:func:`blocks_of` are the block-table arithmetic. Another device, ISA or shape is refused
with the reason (:class:`LayoutError`), never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..types import Model


class LayoutError(ValueError):
    """vLLM's cache is not in the layout this module knows; the message says why."""


def full_blocks(first: int, last: int, block_size: int) -> range:
    """Return the block indices (in the block table) wholly inside tokens ``first .. last - 1``."""
    return range(-(-first // block_size), last // block_size)


def blocks_of(
    block_ids: Sequence[int], spans: Iterable[tuple[int, int]], block_size: int
) -> set[int]:
    """Return the cache blocks holding any token of ``spans`` (``(first, last)``, last excluded)."""
    return {block_ids[i // block_size] for first, last in spans for i in range(first, last)}


def slots(
    block_ids: Sequence[int], first: int, last: int, block_size: int
) -> tuple[torch.Tensor, ...]:
    """Return (block, slot) of prompt positions ``first .. last - 1`` in a block table."""
    pos = torch.arange(first, last)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size], pos % block_size


class PagedCache:
    """The worker's views of vLLM's per-layer CPU caches (see the module docstring).

    Parameters
    ----------
    model : Model
        The model the cache holds (KV heads, head_dim, layers).
    block_size : int
        Tokens per cache block.
    """

    def __init__(self, model: Model, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.k: list[torch.Tensor] = []  # per layer [blocks, heads, head_dim, block_size]
        self.v: list[torch.Tensor] = []  # per layer [blocks, heads, block_size, head_dim]
        self.raw: list[torch.Tensor] = []  # per layer, as vLLM handed it
        self.layer_of: dict[str, int] = {}  # vLLM's layer name -> model layer

    def register(self, kv_caches: dict[str, torch.Tensor], forward_context: dict) -> None:
        """Take K and V views of each layer's cache (``register_kv_caches``' argument).

        ``forward_context`` is vLLM's static forward context (layer name -> attention
        module, whose ``isa`` names the layout).

        Raises
        ------
        LayoutError
            A layer not on the CPU with the "vec" ISA, of another shape or not contiguous,
            or as many layers as the model does not have.
        """
        bs, hd = self.block_size, self.model.head_dim
        for i, (name, t) in enumerate(kv_caches.items()):
            isa = getattr(forward_context.get(name), "isa", None)
            if t.device.type != "cpu" or isa != "vec":
                raise LayoutError(
                    f"layer {name}: attention ISA {isa!r} on {t.device.type}; kvblend knows "
                    "only the CPU 'vec' cache layout (float32)"
                )
            nb, heads = t.shape[0], t.shape[1]
            if tuple(t.shape) != (nb, self.model.num_kv_heads, bs, 2 * hd) or not t.is_contiguous():
                raise LayoutError(
                    f"layer {name}: cache shape {tuple(t.shape)} is not the one expected"
                )
            raw = t.view(nb, heads, 2 * bs * hd)
            # Per block and head: K transposed [head_dim, block_size], then V rows.
            self.k.append(raw[:, :, : bs * hd].view(nb, heads, hd, bs))
            self.v.append(raw[:, :, bs * hd :].view(nb, heads, bs, hd))
            self.raw.append(t)
            m = re.search(r"\.(\d+)\.", name)
            self.layer_of[name] = int(m.group(1)) if m else i
        if len(self.k) != self.model.num_layers:
            raise LayoutError(f"{len(self.k)} cache layers, the model has {self.model.num_layers}")

    def layers_in_order(self) -> list[torch.Tensor]:
        """Return the layers' caches as vLLM handed them, in model layer order."""
        idx = list(self.layer_of.values())
        order = sorted(range(len(idx)), key=idx.__getitem__)
        return [self.raw[i] for i in order]

    def write(self, block_ids: Sequence[int], first: int, rows: torch.Tensor) -> None:
        """Write ``rows`` [layers, 2, n, kv_heads, head_dim] into the cache.

        At prompt positions ``first .. first + n - 1`` through the request's block table.
        """
        blk, off = slots(block_ids, first, first + rows.shape[2], self.block_size)
        for layer in range(rows.shape[0]):
            self.k[layer][blk, :, :, off] = rows[layer, 0]
            self.v[layer][blk, :, off, :] = rows[layer, 1]

    def gather(self, layer: int, block_ids: Sequence[int], length: int, out: np.ndarray) -> None:
        """Copy one layer's K and V of prompt positions 0 .. length - 1 into ``out``.

        ``out`` is [2, length, kv_heads, head_dim] (K, then V) in the model's dtype.
        """
        blk, off = slots(block_ids, 0, length, self.block_size)
        torch.from_numpy(out[0])[:] = self.k[layer][blk, :, :, off]
        torch.from_numpy(out[1])[:] = self.v[layer][blk, :, off, :]

    def raw_blocks(self, blocks: Sequence[int]) -> np.ndarray:
        """Return the raw bytes' view of ``blocks`` in every layer [layers, len(blocks), ...]."""
        return torch.stack([t[list(blocks)] for t in self.raw]).numpy()


def region_views(
    buf: np.ndarray, size: int, layers: Sequence[Any], model: Model, block_size: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Describe vLLM's cache inside a region as K and V arrays for the daemon.

    Parameters
    ----------
    buf : ndarray
        The region (uint8) vLLM's one allocation came from; ``size`` its bytes used.
    layers : sequence of torch.Tensor
        The layers' caches, in model layer order (:meth:`PagedCache.layers_in_order`).
    model : Model
        The model (dtype, KV heads, head_dim).
    block_size : int
        Tokens per block.

    Returns
    -------
    (k, v) or None
        Strided views ``[layers, blocks, block_size, kv_heads, head_dim]`` of the region:
        V with plain row strides, K with the transposed block's own (for
        ``kvb_fuse_open_into_strided``); None when the layers are not in the region at
        one stride.
    """
    base = buf.ctypes.data
    es = np.dtype(model.np_dtype).itemsize
    ptrs = [t.data_ptr() for t in layers]
    ls = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    nb, heads = layers[0].shape[0], model.num_kv_heads
    hd, bs = model.head_dim, block_size
    block = heads * 2 * bs * hd * es
    if (
        any(p != ptrs[0] + i * ls for i, p in enumerate(ptrs))
        or ptrs[0] < base
        or ptrs[-1] + nb * block > base + size
    ):
        return None
    arr = buf[ptrs[0] - base :].view(model.np_dtype)
    shape = (len(layers), nb, bs, heads, hd)
    k = np.lib.stride_tricks.as_strided(arr, shape, (ls, block, es, 2 * bs * hd * es, bs * es))
    v = np.lib.stride_tricks.as_strided(
        arr[bs * hd :], shape, (ls, block, hd * es, 2 * bs * hd * es, es)
    )
    return k, v
