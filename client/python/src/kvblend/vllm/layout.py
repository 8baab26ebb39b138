"""vLLM's KV cache as the connector reads and writes it: the one module that knows its layouts.

Two layouts, both one allocation for all layers (``allocate_kv_cache``) at a uniform
layer stride, both viewed by vLLM per layer as ``[num_blocks, kv_heads, block_size,
2 * head_dim]``:

- :data:`CPU_VEC`, vLLM 0.32 on the CPU (attention ISA "vec", ``cpu_attn.py``): the
  bytes are laid out per block and KV head as K transposed ``[head_dim, block_size]``,
  then V rows ``[block_size, head_dim]``.
- :data:`INTERLEAVED`, vLLM's GPU backends: the view means what it says, each token's K
  then its V in the last dimension (K first, ``split(head_size, -1)``), in the physical
  order ``KVCacheLayout`` picks (``vllm/v1/kv_cache_layout.py``: LBNHC "NHD", the
  default, or LBHNC "HND", or a block-outermost order); the view's strides say which, and
  this module reads them rather than assuming one. Its operations are device-agnostic
  torch ops. What has run where: docs/vllm-reference.md ("GPUs: what exists").

A request's token at prompt position p sits in block ``block_ids[p // block_size]``,
slot ``p % block_size``.

:class:`PagedCache` keeps the worker's K and V views of every layer and moves token rows
in and out by prompt position through a request's block table (the copy path, the blend's
cache write, the store's gather, the debug dump); :func:`region_views` describes the same
cache to the daemon as strided arrays (the landing path); :func:`full_blocks` and
:func:`blocks_of` are the block-table arithmetic. Another ISA or shape is refused with the
reason (:class:`LayoutError`), never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..blend import host
from ..types import DeviceCache, Model


class LayoutError(ValueError):
    """vLLM's cache is not in the layout this module knows; the message says why."""


#: vLLM's CPU backend ("vec" ISA): per block and head, K transposed, then V rows.
CPU_VEC = "cpu-vec"
#: vLLM's GPU backends: each token's K then V in the view's last dimension, any physical
#: order of blocks, heads and slots (the view's strides).
INTERLEAVED = "interleaved"


def full_blocks(first: int, last: int, block_size: int) -> range:
    """Return the block indices (in the block table) wholly inside tokens ``first .. last - 1``."""
    return range(-(-first // block_size), last // block_size)


def blocks_of(
    block_ids: Sequence[int], spans: Iterable[tuple[int, int]], block_size: int
) -> set[int]:
    """Return the cache blocks holding any token of ``spans`` (``(first, last)``, last excluded).

    Positions past the block table (a claim vLLM allocated fewer blocks for) have none.
    """
    n = len(block_ids)
    return {block_ids[b] for first, last in spans if last > first
            for b in range(first // block_size, min(-(-last // block_size), n))}


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
    heads : (first, count) or None
        The model's KV heads this cache holds: a tensor-parallel rank's range (vLLM gives
        rank r of t heads ``r * H/t`` to ``(r + 1) * H/t - 1``); None: all of them.
    """

    def __init__(
        self, model: Model, block_size: int, heads: tuple[int, int] | None = None
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.heads = heads or (0, model.num_kv_heads)
        self.kind = CPU_VEC  # or INTERLEAVED, set by register()
        # per layer [blocks, heads, block_size, head_dim] views, whatever the layout (CPU_VEC
        # K: the transposed block seen through a transposed view)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []  # per layer, as vLLM handed it
        self.layer_of: dict[str, int] = {}  # vLLM's layer name -> model layer

    def register(
        self, kv_caches: dict[str, torch.Tensor], forward_context: dict, kind: str | None = None
    ) -> None:
        """Take K and V views of each layer's cache (``register_kv_caches``' argument).

        ``forward_context`` is vLLM's static forward context (layer name -> attention
        module, whose ``isa`` names the CPU backend's layout). ``kind``: the layout; None
        decides by the device: :data:`CPU_VEC` on the CPU (the ISA must be "vec"),
        :data:`INTERLEAVED` elsewhere. Tests pass :data:`INTERLEAVED` for CPU tensors
        laid out as on a GPU.

        Raises
        ------
        LayoutError
            A CPU layer whose ISA is not "vec", a layer of another shape, not contiguous
            (CPU_VEC) or with head_dim not contiguous (INTERLEAVED), layers of different
            strides, or as many layers as the model does not have.
        """
        bs, hd, heads = self.block_size, self.model.head_dim, self.heads[1]
        strides = None
        on_cpu = all(t.device.type == "cpu" for t in kv_caches.values())
        self.kind = k = kind or (CPU_VEC if on_cpu else INTERLEAVED)
        for i, (name, t) in enumerate(kv_caches.items()):
            isa = getattr(forward_context.get(name), "isa", None)
            nb = t.shape[0]
            if t.dim() != 4 or tuple(t.shape) != (nb, heads, bs, 2 * hd):
                raise LayoutError(
                    f"layer {name}: cache shape {tuple(t.shape)} is not the one expected "
                    f"([blocks, {heads}, {bs}, {2 * hd}])"
                )
            if k == CPU_VEC:
                if t.device.type != "cpu" or isa != "vec":
                    raise LayoutError(
                        f"layer {name}: attention ISA {isa!r} on {t.device.type}; kvblend "
                        "knows the CPU 'vec' cache layout and the GPU backends' "
                        "(K and V interleaved per token)"
                    )
                if not t.is_contiguous():
                    raise LayoutError(f"layer {name}: the CPU cache is not contiguous")
                raw = t.view(nb, heads, 2 * bs * hd)
                # Per block and head: K transposed [head_dim, block_size], then V rows.
                self.k.append(raw[:, :, : bs * hd].view(nb, heads, hd, bs).transpose(2, 3))
                self.v.append(raw[:, :, bs * hd :].view(nb, heads, bs, hd))
            elif k == INTERLEAVED:
                if t.stride(-1) != 1 or strides not in (None, t.stride()):
                    raise LayoutError(
                        f"layer {name}: strides {t.stride()}: head_dim must be contiguous "
                        "and every layer laid out alike"
                    )
                strides = t.stride()
                self.k.append(t[..., :hd])
                self.v.append(t[..., hd:])
            else:
                raise LayoutError(f"unknown cache layout {k!r}")
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

        At prompt positions ``first .. first + n - 1`` through the request's block table;
        ``rows`` may be on another device than the cache (copied to the cache's), in the
        cache's dtype (a bfloat16 cache takes bfloat16 rows, not their raw bits: see
        :mod:`kvblend.blend.host`). Rows of all the model's KV heads are cut to this
        cache's range.
        """
        if rows.dtype != self.v[0].dtype:
            raise LayoutError(f"rows of {rows.dtype} for a cache of {self.v[0].dtype}")
        h0, hn = self.heads
        if rows.shape[3] != hn:
            rows = rows[:, :, :, h0 : h0 + hn]
        blk, off = slots(block_ids, first, first + rows.shape[2], self.block_size)
        for layer in range(rows.shape[0]):
            r = rows[layer].to(self.v[layer].device)
            self.k[layer][blk, :, off, :] = r[0]
            self.v[layer][blk, :, off, :] = r[1]

    def write_host(self, block_ids: Sequence[int], first: int, kv: np.ndarray) -> None:
        """Write rows as the daemon answers them: a host array, bfloat16 as raw bits.

        ``kv`` [layers, 2, n, heads, head_dim] in the model's host dtype; as :meth:`write`.
        """
        self.write(block_ids, first, host.tensor(kv, self.v[0].dtype))

    def gather(self, layer: int, block_ids: Sequence[int], length: int, out: np.ndarray) -> None:
        """Copy one layer's K and V of prompt positions 0 .. length - 1 into ``out``.

        ``out`` is [2, length, kv_heads, head_dim] (K, then V) in the model's dtype, on
        the host: this cache's heads, or all the model's (this cache's range written).
        """
        h0, hn = self.heads
        if out.shape[2] != hn:
            out = out[:, :, h0 : h0 + hn]
        blk, off = slots(block_ids, 0, length, self.block_size)
        dt = self.v[layer].dtype  # (bfloat16: out holds the raw bits, kvblend.blend.host)
        host.tensor(out[0], dt)[:] = self.k[layer][blk, :, off, :].cpu()
        host.tensor(out[1], dt)[:] = self.v[layer][blk, :, off, :].cpu()

    def raw_blocks(self, blocks: Sequence[int]) -> np.ndarray:
        """Return the raw values of ``blocks`` in every layer [layers, len(blocks), ...]
        (bfloat16 as raw bits)."""
        return host.array(torch.stack([t[list(blocks)] for t in self.raw]).cpu())


def region_views(
    buf: np.ndarray,
    size: int,
    layers: Sequence[Any],
    model: Model,
    block_size: int,
    kind: str = CPU_VEC,
    heads: int | None = None,
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
    kind : str
        The layout (:attr:`PagedCache.kind`).
    heads : int or None
        The KV heads each layer holds (a tensor-parallel rank's count); None: the model's.

    Returns
    -------
    (k, v) or None
        Strided views ``[layers, blocks, block_size, kv_heads, head_dim]`` of the region.
        CPU_VEC: V with plain row strides, K with the transposed block's own (for
        ``kvb_fuse_open_into_strided``); INTERLEAVED: K and V with the view's own strides,
        V head_dim after K's. None when the layers are not in the region at one stride.
    """
    base = buf.ctypes.data
    es = np.dtype(model.np_dtype).itemsize
    ptrs = [t.data_ptr() for t in layers]
    ls = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    nb, heads = layers[0].shape[0], heads or model.num_kv_heads
    hd, bs = model.head_dim, block_size
    # the bytes one layer's view spans from its first element
    span = es * (1 + sum((n - 1) * st for n, st in zip(layers[0].shape, layers[0].stride())))
    if (
        ls < 0
        or any(p != ptrs[0] + i * ls for i, p in enumerate(ptrs))
        or any(t.stride() != layers[0].stride() for t in layers)
        or ptrs[0] < base
        or ptrs[-1] + span > base + size
    ):
        return None
    arr = buf[ptrs[0] - base :].view(model.np_dtype)
    shape = (len(layers), nb, bs, heads, hd)
    if kind == INTERLEAVED:
        sb, sh, sn, _ = (x * es for x in layers[0].stride())
        strides = (ls, sb, sn, sh, es)
        k = np.lib.stride_tricks.as_strided(arr, shape, strides)
        v = np.lib.stride_tricks.as_strided(arr[hd:], shape, strides)
        return k, v
    block = heads * 2 * bs * hd * es
    k = np.lib.stride_tricks.as_strided(arr, shape, (ls, block, es, 2 * bs * hd * es, bs * es))
    v = np.lib.stride_tricks.as_strided(
        arr[bs * hd :], shape, (ls, block, hd * es, 2 * bs * hd * es, es)
    )
    return k, v


def device_cache(
    layers: Sequence[Any],
    model: Model,
    block_size: int,
    base: int,
    nbytes: int,
    ipc_handle: bytes,
    pci: str,
) -> DeviceCache | None:
    """Describe vLLM's cache in a GPU allocation for the daemon's device landing.

    ``layers``: the layers' caches in model layer order, in the :data:`INTERLEAVED`
    layout (:meth:`PagedCache.layers_in_order`), a tensor-parallel rank's heads as they
    hold them; ``base``, ``nbytes``, ``ipc_handle`` and ``pci``: the allocation they lie
    in (its start in this process, its size, its CUDA IPC handle, its GPU's bus id).
    Returns the :class:`kvblend.DeviceCache` (byte offsets from ``base``, byte strides:
    :meth:`kvblend.Client.fuse_open_into_device`), or None when the layers are not in the
    allocation at one stride.
    """
    es = np.dtype(model.np_dtype).itemsize
    ptrs = [t.data_ptr() for t in layers]
    ls = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    first = layers[0]
    # the bytes one layer's view spans from its first element
    span = es * (1 + sum((n - 1) * st for n, st in zip(first.shape, first.stride())))
    if (
        ls < 0
        or any(p != ptrs[0] + i * ls for i, p in enumerate(ptrs))
        or any(t.stride() != first.stride() or t.shape != first.shape for t in layers)
        or first.stride(-1) != 1
        or ptrs[0] < base
        or ptrs[-1] + span > base + nbytes
    ):
        return None
    sb, sh, sn, _ = (x * es for x in first.stride())
    k = ptrs[0] - base
    return DeviceCache(
        base=base,
        nbytes=nbytes,
        ipc_handle=ipc_handle,
        pci=pci,
        k_offset=k,
        v_offset=k + model.head_dim * es,
        layer_stride=ls,
        token_stride=sn,
        head_stride=sh,
        page_tokens=block_size,
        page_stride=sb,
    )
