"""kvblend's value types: Model, ChunkInfo and Segment (plain data, no connection).

What the client, its sessions and the engine integrations pass around. Each converts to
and from its libkvblend struct; nothing here opens a connection.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Union

import numpy as np

from . import _lib
from ._lib import HASH_LEN, KvbChunkInfo, KvbModel, lib
from .errors import BadArgument

HashLike = Union[bytes, bytearray, memoryview, str]
LayerRange = Union[tuple[int, int], slice, None]

_NP_DTYPES = {"f16": np.dtype("<f2"), "bf16": np.dtype("<u2"), "f32": np.dtype("<f4")}
_DTYPE_NAMES = {v: k for k, v in _lib.DTYPES.items()}
_STYLE_NAMES = {v: k for k, v in _lib.ROPE_STYLES.items()}


def _hash_bytes(h: HashLike) -> bytes:
    """Return a 32-byte chunk hash given as bytes or 64 hex digits."""
    if isinstance(h, str):
        out = _lib.HashArray()
        if lib.kvb_hash_parse(h.encode(), out) != 0:
            raise BadArgument(-22, f"'{h}' is not a chunk hash (64 hex digits)")
        return bytes(out)
    b = bytes(h)
    if len(b) != HASH_LEN:
        raise BadArgument(-22, f"a chunk hash is {HASH_LEN} bytes, got {len(b)}")
    return b

def _name(s: str) -> bytes:
    return s.encode()

@dataclass
class Model:
    """A KV layout and its RoPE configuration (struct kvb_model).

    Attributes
    ----------
    name : str
        1 .. 64 bytes.
    num_layers, num_kv_heads, head_dim : int
        The KV layout.
    dtype : str
        ``'f16'``, ``'bf16'`` (stored as raw uint16 bits) or ``'f32'``.
    rope_theta : float
        RoPE base.
    rope_style : str
        ``'neox'`` (pairs j, j + d/2) or ``'gptj'`` (pairs 2j, 2j + 1).
    rotary_dim : int
        Rotated dimensions; 0 means head_dim.
    scaling : str
        RoPE scaling SPEC as on the command line: ``none``, ``linear:FACTOR``,
        ``llama3:FACTOR,LOW,HIGH,ORIGINAL_MAX_POS``,
        ``yarn:FACTOR,ORIGINAL_MAX_POS[,BETA_FAST,BETA_SLOW]``, ``dynamic:FACTOR,MAX_POS``
        (parsed and formatted by libkvblend).
    k_pre_rope : bool
        Keys are stored before RoPE.
    store : str
        How chunks are stored: ``'dtype'`` (lossless, the default), or quantized and
        decoded back on every read: ``'fp8'``, ``'int8'``, ``'int4'`` or
        ``'int4:GROUP'`` (docs/storage.md). Part of the model's identity.
    rope_local_theta : float
        Local layers (Gemma 3's sliding-window ones) rotate with this base, by default
        RoPE without scaling; 0 (the default): every layer rotates alike.
    full_every : int
        With ``rope_local_theta``: layer ``l`` (from 0) is a full-attention layer, rotated
        by ``rope_theta`` and ``scaling``, when ``(l + 1) % full_every == 0``, and a local
        one otherwise (Gemma 3: 6). 2 .. num_layers; 0 without local layers.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "f16"
    rope_theta: float = 10000.0
    rope_style: str = "neox"
    rotary_dim: int = 0
    scaling: str = "none"
    k_pre_rope: bool = False
    store: str = "dtype"
    rope_local_theta: float = 0.0
    full_every: int = 0

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` is a local layer, rotated with ``rope_local_theta``."""
        return bool(self.full_every) and (layer + 1) % self.full_every != 0

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of this model's tensors (``<u2`` for bf16)."""
        return _NP_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.np_dtype.itemsize

    def kv_shape(self, tokens: int, layers: int | None = None) -> tuple[int, ...]:
        """Shape ``[layers, 2, tokens, kv_heads, head_dim]`` of a chunk's KV."""
        n = self.num_layers if layers is None else layers
        return (n, 2, tokens, self.num_kv_heads, self.head_dim)

    def _to_c(self) -> KvbModel:
        m = KvbModel()
        name = _name(self.name)
        if not 1 <= len(name) <= _lib.NAME_MAX:
            raise BadArgument(-22, f"model name must be 1..{_lib.NAME_MAX} bytes")
        if self.dtype not in _lib.DTYPES:
            raise BadArgument(-22, f"dtype '{self.dtype}': one of f16, bf16, f32")
        if self.rope_style not in _lib.ROPE_STYLES:
            raise BadArgument(-22, f"rope_style '{self.rope_style}': neox or gptj")
        m.name = name
        m.num_layers = self.num_layers
        m.num_kv_heads = self.num_kv_heads
        m.head_dim = self.head_dim
        m.dtype = _lib.DTYPES[self.dtype]
        m.rope_theta = self.rope_theta
        m.rope_style = _lib.ROPE_STYLES[self.rope_style]
        m.rotary_dim = self.rotary_dim
        m.k_pre_rope = int(bool(self.k_pre_rope))
        if lib.kvb_rope_scaling_parse(self.scaling.encode(), ctypes.byref(m)) != 0:
            raise BadArgument(-22, f"rope scaling '{self.scaling}' is not a valid SPEC")
        if lib.kvb_store_parse(self.store.encode(), ctypes.byref(m)) != 0:
            raise BadArgument(-22, f"store '{self.store}': dtype, fp8, int8, int4 or int4:GROUP")
        return m

    def _layers_to_c(self) -> _lib.KvbModelLayers:
        if (self.rope_local_theta != 0) != (self.full_every != 0):
            raise BadArgument(-22, "rope_local_theta and full_every go together (both 0: "
                              "every layer rotates alike)")
        every = self.full_every
        if isinstance(every, bool) or not isinstance(every, int) or not 0 <= every < 1 << 32:
            # ctypes would wrap a negative count into a uint32 the daemon then names
            raise BadArgument(-22, f"full_every must be an int in [0, 2^32), got {every!r}")
        return _lib.KvbModelLayers(float(self.rope_local_theta), every)

    @classmethod
    def _from_c(cls, m: KvbModel, layers: _lib.KvbModelLayers | None = None) -> Model:
        buf = ctypes.create_string_buffer(128)
        store = ctypes.create_string_buffer(32)
        lib.kvb_rope_scaling_format(ctypes.byref(m), buf, len(buf))
        lib.kvb_store_format(ctypes.byref(m), store, len(store))
        return cls(
            name=m.name.decode(),
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=_DTYPE_NAMES.get(m.dtype, str(m.dtype)),
            rope_theta=m.rope_theta,
            rope_style=_STYLE_NAMES.get(m.rope_style, str(m.rope_style)),
            rotary_dim=m.rotary_dim,
            scaling=buf.value.decode(),
            k_pre_rope=bool(m.k_pre_rope),
            store=store.value.decode(),
            rope_local_theta=layers.rope_local_theta if layers else 0.0,
            full_every=layers.full_every if layers else 0,
        )


@dataclass(frozen=True)
class ChunkInfo:
    """A stored chunk as lookup() and list() describe it (struct kvb_chunk_info)."""

    hash: bytes
    found: bool
    num_tokens: int
    base_pos: int
    num_layers: int
    raw_bytes: int
    stored_bytes: int

    @classmethod
    def _from_c(cls, c: KvbChunkInfo) -> ChunkInfo:
        return cls(
            bytes(c.hash),
            bool(c.found),
            c.num_tokens,
            c.base_pos,
            c.num_layers,
            c.raw_bytes,
            c.stored_bytes,
        )


@dataclass(frozen=True)
class DeviceCache:
    """A node's KV cache in a GPU allocation, for :meth:`Client.fuse_open_into_device`.

    Byte offsets and strides as :meth:`Client.fuse_open_into` reads them from its
    arrays: element ``d`` of head ``h`` of token ``t`` of layer ``l`` of K is at
    ``base + k_offset + l * layer_stride + page(t) * page_stride + slot(t) *
    token_stride + h * head_stride + d * dtype size`` (V from ``v_offset``; head_dim
    contiguous), with ``page(t)`` and ``slot(t)`` from the block table when
    ``page_tokens`` > 0. vLLM's GPU backends: each token's K then V per head, so
    ``v_offset = k_offset + head_dim * dtype size``.
    """

    base: int  # the allocation's device pointer in this process (cudaMalloc's)
    nbytes: int
    ipc_handle: bytes  # 64 bytes: cudaIpcGetMemHandle(base), or Client.device_handle_from_fd
    pci: str  # the GPU's PCI bus id, e.g. "0000:3B:00.0"
    k_offset: int
    v_offset: int
    layer_stride: int
    token_stride: int
    head_stride: int
    page_tokens: int = 0
    page_stride: int = 0


@dataclass(frozen=True)
class Segment:
    """One segment of a fused prompt: a stored chunk, or ``count`` fresh tokens, at ``pos``.

    Build them with :meth:`chunk` and :meth:`fresh`.
    """

    pos: int
    hash: bytes | None = None
    count: int = 0

    @classmethod
    def chunk(cls, hash: HashLike, pos: int) -> Segment:  # noqa: A002 - the C field's name
        """Place the stored chunk ``hash`` with its first token at absolute position ``pos``."""
        return cls(pos=pos, hash=_hash_bytes(hash))

    @classmethod
    def fresh(cls, count: int, pos: int) -> Segment:
        """Place ``count`` tokens not in the store (e.g. the question) from position ``pos``."""
        return cls(pos=pos, count=count)
