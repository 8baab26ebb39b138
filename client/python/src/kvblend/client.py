"""Client: kvblend.h, one method per C call.

The value types (Model, ChunkInfo, Segment) are in types.py, the fuse sessions and
received layers in sessions.py.
"""

from __future__ import annotations

import builtins
import ctypes
import hashlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import _lib
from ._arrays import _as_array, _dtype_ok, _stats_dict
from ._lib import HASH_LEN, KvbChunkInfo, KvbLayers, KvbModel, KvbSegment, KvbStat, lib
from .errors import BadArgument, KvblendError, error_for
from .sessions import FuseSession, LandingSession, Layers
from .types import (
    _NP_DTYPES,
    ChunkInfo,
    DeviceCache,
    HashLike,
    LayerRange,
    Model,
    Segment,
    _hash_bytes,
    _name,
)

__all__ = [
    "ChunkInfo",
    "Client",
    "HashLike",
    "LayerRange",
    "Model",
    "Segment",
    "chunk_hash",
    "default_endpoint",
    "hash_hex",
    "malloc_tune",
    "scoped_chunk_hash",
]


def _c_hash(h: HashLike) -> ctypes.Array:
    return _lib.HashArray.from_buffer_copy(_hash_bytes(h))


def _layer_range(layers: LayerRange) -> tuple[int, int]:
    if layers is None:
        return 0, 0
    if isinstance(layers, slice):
        if layers.step not in (None, 1) or layers.start is None or layers.stop is None:
            raise BadArgument(-22, "layers: a slice start:stop with both ends and no step")
        return int(layers.start), int(layers.stop)
    begin, end = layers
    return int(begin), int(end)


def chunk_hash(token_ids: Iterable[int] | np.ndarray) -> bytes:
    """Default chunk hash of a sequence of token ids.

    BLAKE2b-256 over the ids as little-endian uint32, computed by libkvblend; equal to
    ``hashlib.blake2b(np.asarray(ids, '<u4').tobytes(), digest_size=32).digest()``.

    Parameters
    ----------
    token_ids : sequence of int or array
        The chunk's token ids (each in 0 .. 2**32 - 1).

    Returns
    -------
    bytes
        The 32-byte hash.
    """
    ids = _token_ids(token_ids)
    out = _lib.HashArray()
    lib.kvb_chunk_hash(ids.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), ids.size, out)
    return bytes(out)


#: BLAKE2b's personalization for :func:`scoped_chunk_hash` (16 bytes): its hashes can never
#: equal :func:`chunk_hash`'s, whatever the ids.
SCOPE_PERSON = b"kvblend scope v1"


def scoped_chunk_hash(token_ids: Iterable[int] | np.ndarray, scope: bytes = b"") -> bytes:
    """Chunk hash of token ids within a scope (a LoRA adapter, a cache salt).

    An empty scope gives :func:`chunk_hash` itself, so chunks stored without a scope keep
    their keys. Otherwise BLAKE2b-256 personalized with :data:`SCOPE_PERSON` over the
    scope's length (uint32 LE), the scope and the ids as little-endian uint32:
    ``hashlib.blake2b(len(scope).to_bytes(4, 'little') + scope + np.asarray(ids,
    '<u4').tobytes(), digest_size=32, person=b'kvblend scope v1').digest()``. KV computed
    under one scope is never found under another.

    Parameters
    ----------
    token_ids : sequence of int or array
        The chunk's token ids (each in 0 .. 2**32 - 1).
    scope : bytes
        What the KV depends on beyond the model and the ids (kvblend.vllm: the request's
        LoRA adapter and cache salt, :func:`kvblend.vllm.plan.request_scope`).

    Returns
    -------
    bytes
        The 32-byte hash.
    """
    if not scope:
        return chunk_hash(token_ids)
    if not isinstance(scope, bytes):
        raise BadArgument(-22, f"scope must be bytes, got {type(scope).__name__}")
    if len(scope) > 0xFFFFFFFF:
        raise BadArgument(-22, "scope longer than 2**32 - 1 bytes")
    h = hashlib.blake2b(digest_size=HASH_LEN, person=SCOPE_PERSON)
    h.update(len(scope).to_bytes(4, "little"))
    h.update(scope)
    h.update(_token_ids(token_ids).tobytes())
    return h.digest()


def _token_ids(token_ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """Return the ids as a contiguous little-endian uint32 array, checked."""
    ids = np.asarray(_as_array(token_ids)).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise BadArgument(-22, f"token ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF):
        raise BadArgument(-22, "token ids must lie in 0 .. 2**32 - 1")
    return np.ascontiguousarray(ids, dtype="<u4")


def hash_hex(h: HashLike) -> str:
    """Return the 64 lowercase hex digits of a chunk hash."""
    buf = ctypes.create_string_buffer(2 * HASH_LEN + 1)
    lib.kvb_hash_format(_c_hash(h), buf)
    return buf.value.decode()


def default_endpoint() -> str:
    """Return the endpoint ``Client()`` connects to ($KVBLEND_ENDPOINT or the default)."""
    return lib.kvb_default_endpoint().decode()


class Client:
    """A connection to one kvblendd (kvb_client).

    Parameters
    ----------
    endpoint : str, optional
        ``ipc://PATH`` or ``tcp://HOST:PORT``; None: ``$KVBLEND_ENDPOINT``, else the
        default socket (:func:`default_endpoint`).
    timeout_ms : int
        Per-call timeout; 0 means libkvblend's default (5000).
    no_shm : bool
        Never use shared memory (bulk bytes then travel as ZeroMQ frames).
    shm_size : int
        Initial shared-memory segment size; 0 means 64 MiB. It grows on demand.
    server_key, client_secret_key : str, optional
        CURVE keys (Z85) for tcp:// endpoints; None: ``$KVBLEND_SERVER_KEY`` and
        ``$KVBLEND_CLIENT_KEY``.

    Raises
    ------
    Timeout
        No daemon answered within the timeout.
    BadArgument
        A bad endpoint.

    Notes
    -----
    A Client must not be used by two threads at once, as in C; use one per thread
    (they are cheap). Calls take a lock, so concurrent use is serialized rather than
    undefined, but NumPy views handed out (:meth:`shared_buffer`,
    :meth:`FuseSession.output`) are still overwritten by the next call.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_ms: int = 5000,
        no_shm: bool = False,
        shm_size: int = 0,
        server_key: str | None = None,
        client_secret_key: str | None = None,
    ) -> None:
        self._c = ctypes.c_void_p()
        self._lock = threading.RLock()
        self._models: dict[str, Model] = {}
        self._sessions: builtins.list[FuseSession] = []
        opts = _lib.KvbConnectOpts(
            timeout_ms=timeout_ms,
            no_shm=int(bool(no_shm)),
            shm_size=shm_size,
            server_key=server_key.encode() if server_key else None,
            client_secret_key=client_secret_key.encode() if client_secret_key else None,
        )
        err = ctypes.create_string_buffer(512)
        rc = lib.kvb_connect(
            endpoint.encode() if endpoint else None,
            ctypes.byref(opts),
            ctypes.byref(self._c),
            err,
            len(err),
        )
        if rc:
            raise error_for(rc, err.value.decode(errors="replace"))
        self.endpoint = endpoint or default_endpoint()

    # ---- lifetime ----

    def close(self) -> None:
        """Close open fuse sessions, the connection and its shared memory. Idempotent."""
        with self._lock:
            for s in builtins.list(self._sessions):
                try:
                    s.close()
                except KvblendError:
                    pass
            if self._c:
                lib.kvb_close(ctypes.byref(self._c))
                self._c = ctypes.c_void_p()

    def set_timeout(self, timeout_ms: int) -> None:
        """Set the per-call timeout of later calls (e.g. short before closing a connection
        whose daemon stopped answering, so that the close's own calls return soon).

        Raises
        ------
        KvblendError
            ``timeout_ms`` is not positive (``EINVAL``).
        """
        with self._lock:
            self._check(lib.kvb_set_timeout(self._handle(), int(timeout_ms)))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._c

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_c", None):
            self.close()

    # ---- plumbing ----

    def _handle(self) -> ctypes.c_void_p:
        if not self._c:
            raise BadArgument(-22, "the client is closed")
        return self._c

    def _raise(self, rc: int, **kwargs: object) -> None:
        msg = lib.kvb_last_error(self._c) or b""
        raise error_for(rc, msg.decode(errors="replace"), **kwargs)

    def _check(self, rc: int) -> None:
        if rc:
            self._raise(rc)

    def _model(self, name: str) -> Model:
        m = self._models.get(name)
        if m is None:
            m = self.model_get(name)
        return m

    # ---- calls ----

    def ping(self) -> str:
        """Check that the daemon answers; return its version string."""
        buf = ctypes.create_string_buffer(128)
        with self._lock:
            self._check(lib.kvb_ping(self._handle(), buf, len(buf)))
        return buf.value.decode()

    def device_handle_from_fd(self, fd: int) -> bytes:
        """Hand a descriptor of the node's device memory to the daemon; return its handle.

        ``kvb_device_handle_from_fd``: the descriptor goes over the daemon's descriptor
        socket (a local IPC client only), the daemon keeps its own copy for this process
        until it exits, and the 64 bytes returned name it in
        :attr:`DeviceCache.ipc_handle`. No other process can land by that name. The
        emulated device takes a memfd sealed against shrinking this way, and memory no
        other way. ``fd`` stays the caller's.

        Raises
        ------
        BadArgument
            The daemon refuses it (one of its own segments).
        Limit
            This process has handed in 16 descriptors, or all clients 64.
        """
        buf = ctypes.create_string_buffer(64)
        with self._lock:
            self._check(lib.kvb_device_handle_from_fd(self._handle(), fd, buf))
        return buf.raw

    def device_handle_from_fds(
        self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
    ) -> bytes:
        """:meth:`device_handle_from_fd` for memory in segments (``kvb_device_handle_from_fds``).

        Descriptor ``fds[k]``'s memory sits at ``offsets[k]`` of one extent, ``sizes[k]``
        bytes (a GPU cache reserved as one range of addresses, backed by one allocation
        per segment: vLLM 0.34's growable cache); the daemon maps them at the same
        offsets. Offsets increasing, page-aligned, not overlapping; 1 to 128 of them.
        """
        n = len(fds)
        if not n or len(offsets) != n or len(sizes) != n:
            raise BadArgument(-22, "fds, offsets and sizes: one each, at least one")
        buf = ctypes.create_string_buffer(64)
        f = (ctypes.c_int * n)(*fds)
        o = (ctypes.c_uint64 * n)(*offsets)
        z = (ctypes.c_uint64 * n)(*sizes)
        with self._lock:
            self._check(lib.kvb_device_handle_from_fds(self._handle(), f, o, z, n, buf))
        return buf.raw

    def model_register(self, model: Model) -> bool:
        """Register a model; return True when an identical model was already there.

        Raises
        ------
        ModelConflict
            The name is taken by a different layout.
        """
        m = model._to_c()
        layers = model._layers_to_c()
        existed = ctypes.c_int(0)
        with self._lock:
            self._check(
                lib.kvb_model_register_layers(
                    self._handle(), ctypes.byref(m), ctypes.byref(layers), ctypes.byref(existed)
                )
            )
        self._models[model.name] = Model._from_c(m, layers)
        return bool(existed.value)

    def model_list(self) -> builtins.list[Model]:
        """All registered models (their layers read one model at a time)."""
        arr = ctypes.POINTER(KvbModel)()
        n = ctypes.c_size_t(0)
        with self._lock:
            self._check(lib.kvb_model_list(self._handle(), ctypes.byref(arr), ctypes.byref(n)))
        try:
            names = [arr[i].name.decode() for i in range(n.value)]
        finally:
            _lib.free(arr)
        return [self.model_get(name) for name in names]

    def model_get(self, name: str) -> Model:
        """Return the model called ``name``.

        Raises
        ------
        UnknownModel
            There is none.
        """
        m = KvbModel()
        layers = _lib.KvbModelLayers()
        with self._lock:
            self._check(
                lib.kvb_model_get_layers(
                    self._handle(), _name(name), ctypes.byref(m), ctypes.byref(layers)
                )
            )
        model = Model._from_c(m, layers)
        self._models[name] = model
        return model

    def put(
        self,
        model: str,
        hash: HashLike,
        kv: Any,
        base_pos: int = 0,  # noqa: A002
        dtype: str | None = None,
    ) -> bool:
        """Store a chunk; return True when it was already stored (nothing is written).

        Parameters
        ----------
        model : str
            The model's name.
        hash : bytes or str
            The chunk hash (32 bytes, or 64 hex digits); see :func:`chunk_hash`.
        kv : array
            ``[layers, 2, tokens, kv_heads, head_dim]`` in the model's dtype (float16,
            float32, or uint16 raw bits for bf16); a NumPy array or a CPU torch tensor.
            C-contiguous data is passed without a copy (and, if it lies in
            :meth:`shared_buffer`, crosses to the daemon with no copy at all).
        base_pos : int
            Position of the chunk's first token when its keys were rotated.
        dtype : str, optional
            ``'f16'``, ``'bf16'`` or ``'f32'``; None: from the array (uint16 = bf16).

        Raises
        ------
        BadShape, DtypeMismatch, UnknownModel, Full, Limit, TooLarge
            As the daemon replies.
        """
        a = _as_array(kv)
        if a.ndim != 5 or a.shape[1] != 2:
            raise BadArgument(
                -22, f"kv must be [layers, 2, tokens, kv_heads, head_dim], got shape {a.shape}"
            )
        if dtype is None:
            dtype = {
                np.dtype("<f2"): "f16",
                np.dtype("<f4"): "f32",
                np.dtype("<u2"): "bf16",
                np.dtype("<i2"): "bf16",
            }.get(a.dtype)
            if dtype is None:
                raise BadArgument(-22, f"kv dtype {a.dtype}: float16, float32 or uint16 (bf16)")
        elif dtype not in _lib.DTYPES:
            raise BadArgument(-22, f"dtype '{dtype}': one of f16, bf16, f32")
        elif a.dtype.itemsize != _NP_DTYPES[dtype].itemsize:
            raise BadArgument(-22, f"kv dtype {a.dtype} does not hold {dtype} elements")
        a = np.ascontiguousarray(a)
        existed = ctypes.c_int(0)
        with self._lock:
            self._check(
                lib.kvb_put(
                    self._handle(),
                    _name(model),
                    _c_hash(hash),
                    _lib.DTYPES[dtype],
                    a.shape[2],
                    base_pos,
                    ctypes.c_void_p(a.ctypes.data),
                    a.nbytes,
                    ctypes.byref(existed),
                )
            )
        return bool(existed.value)

    def _get(
        self,
        model: str,
        hash: HashLike,
        layers: LayerRange,
        rerotate_pos: int | None,  # noqa: A002
        out: Any,
        heads: tuple[int, int] | None = None,
    ) -> np.ndarray:
        begin, end = _layer_range(layers)
        h = _c_hash(hash)
        target = None
        if heads is not None:
            try:
                hb, hc = (int(x) for x in heads)
            except (TypeError, ValueError):
                raise BadArgument(-22, f"heads {heads!r}: (begin, count)") from None
            if hc < 1 or hb < 0:
                raise BadArgument(-22, f"heads {heads}: begin >= 0 and count >= 1")
            heads = (hb, hc)
        if out is None or not (
            isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable
        ):
            m = self._model(model)
            info = self.lookup(model, [bytes(h)])[0]
            if not info.found:
                # The same error get would give, with the daemon's own message.
                self._get_into(model, h, begin, end, rerotate_pos, np.empty(0, np.uint8))
            nl = (end or info.num_layers) - begin
            shape = m.kv_shape(info.num_tokens, max(nl, 0))
            if heads is not None:
                shape = shape[:3] + (heads[1],) + shape[4:]
            if out is not None:
                target = _as_array(out)
                if target.nbytes != int(np.prod(shape)) * m.np_dtype.itemsize:
                    raise BadArgument(
                        -22,
                        f"out has {target.nbytes} bytes; the layers need "
                        f"shape {shape} of {m.np_dtype}",
                    )
            out = np.empty(shape, m.np_dtype)
        self._get_into(model, h, begin, end, rerotate_pos, out, heads)
        if target is not None:
            target[...] = out.reshape(target.shape).view(target.dtype)
            return target
        return out

    def _get_into(
        self,
        model: str,
        h: ctypes.Array,
        begin: int,
        end: int,
        rerotate_pos: int | None,
        out: np.ndarray,
        heads: tuple[int, int] | None = None,
    ) -> None:
        ptr = ctypes.c_void_p(out.ctypes.data)
        with self._lock:
            c = self._handle()
            # kvb_get and kvb_get_rerotated are this call with no head range
            o = _lib.KvbGetOpts(
                ctypes.sizeof(_lib.KvbGetOpts),
                begin,
                end,
                rerotate_pos is not None,
                rerotate_pos or 0,
                *(heads or (0, 0)),
            )
            rc = lib.kvb_get_opts(c, _name(model), h, ctypes.byref(o), ptr, out.nbytes, None)
            self._check(rc)

    def get(
        self,
        model: str,
        hash: HashLike,
        layers: LayerRange = None,  # noqa: A002
        out: np.ndarray | None = None,
        heads: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Read a chunk's KV, or layers ``[begin, end)`` of it.

        Parameters
        ----------
        model : str
            The model's name.
        hash : bytes or str
            The chunk hash.
        layers : (int, int) or slice, optional
            ``(begin, end)`` or ``slice(begin, end)``; end 0 means the last layer; None: all.
        out : ndarray, optional
            Where to read to. A C-contiguous writable array of exactly the layers'
            size is filled in place with no copy on this side (one fewer round trip
            too: the size is not looked up first). Otherwise the data is read into a
            new array (after a lookup for its size) and copied into ``out``.
        heads : (begin, count), optional
            Only the stored KV heads ``begin .. begin + count - 1`` (a tensor-parallel
            rank's share; ``kvb_get_opts``): the array's heads axis is ``count`` long.
            A range beyond the model's heads raises BadArgument naming them.

        Returns
        -------
        ndarray
            ``out``, or a new ``[layers, 2, tokens, kv_heads, head_dim]`` array in the
            model's dtype (uint16 for bf16; ``count`` heads with ``heads``).

        Raises
        ------
        NotFound
            The chunk is not stored.
        Corrupt
            It failed its checksum; the daemon removed it (a subclass of NotFound).
        BufferSize
            ``out`` does not have the size of the requested layers.
        """
        return self._get(model, hash, layers, None, out, heads)

    def get_layers(
        self,
        model: str,
        hash: HashLike,
        layers: LayerRange = None,  # noqa: A002
    ) -> Layers:
        """Read a chunk's layers and leave them where they arrived: no copy here.

        For nodes that move each layer on (to their device, their own cache) anyway:
        over TCP the fastest read (the daemon sends its stored pages, this side only
        receives). Over IPC, :meth:`get` into a shared buffer crosses with fewer
        copies.

        Parameters
        ----------
        model, hash, layers
            As for :meth:`get`.

        Returns
        -------
        Layers
            ``k[i]`` and ``v[i]``: read-only ``[tokens, kv_heads, head_dim]`` arrays of
            layer ``begin + i``, valid until the Layers is closed (``with`` or
            :meth:`Layers.close`), also after this client is closed.

        Raises
        ------
        NotFound, Corrupt
            As for :meth:`get`.
        """
        begin, end = _layer_range(layers)
        m = self._model(model)
        out = ctypes.POINTER(KvbLayers)()
        with self._lock:
            self._check(
                lib.kvb_get_layers(
                    self._handle(), _name(model), _c_hash(hash), begin, end, ctypes.byref(out)
                )
            )
        return Layers(out, m)

    def get_rerotated(
        self,
        model: str,
        hash: HashLike,
        pos: int,  # noqa: A002
        layers: LayerRange = None,
        out: np.ndarray | None = None,
        heads: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Like :meth:`get`, with the keys re-rotated to positions ``pos..`` (exact RoPE)."""
        return self._get(model, hash, layers, pos, out, heads)

    def lookup(self, model: str, hashes: Sequence[HashLike]) -> builtins.list[ChunkInfo]:
        """Which of ``hashes`` are stored: one ChunkInfo each, in order (``found``)."""
        n = len(hashes)
        if n == 0:
            return []  # libkvblend refuses an empty lookup; the answer is known
        buf = (ctypes.c_uint8 * (HASH_LEN * max(n, 1)))()
        for i, h in enumerate(hashes):
            ctypes.memmove(ctypes.addressof(buf) + i * HASH_LEN, _hash_bytes(h), HASH_LEN)
        out = (KvbChunkInfo * max(n, 1))()
        with self._lock:
            self._check(
                lib.kvb_lookup(
                    self._handle(),
                    _name(model),
                    ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)),
                    n,
                    out,
                )
            )
        return [ChunkInfo._from_c(out[i]) for i in range(n)]

    def list(self, model: str) -> builtins.list[ChunkInfo]:
        """All chunks of a model."""
        arr = ctypes.POINTER(KvbChunkInfo)()
        n = ctypes.c_size_t(0)
        with self._lock:
            self._check(
                lib.kvb_list(self._handle(), _name(model), ctypes.byref(arr), ctypes.byref(n))
            )
        try:
            return [ChunkInfo._from_c(arr[i]) for i in range(n.value)]
        finally:
            _lib.free(arr)

    def delete(self, model: str, hash: HashLike) -> None:  # noqa: A002
        """Delete a chunk. Raises NotFound if absent, Busy if a fuse session uses it."""
        with self._lock:
            self._check(lib.kvb_delete(self._handle(), _name(model), _c_hash(hash)))

    def pin(self, model: str, hash: HashLike, ttl: int) -> None:  # noqa: A002
        """Keep a chunk from eviction for ``ttl`` seconds (1 .. 30 days; again resets it).

        Pins live in the daemon's memory: a restart drops them.
        """
        with self._lock:
            self._check(lib.kvb_pin(self._handle(), _name(model), _c_hash(hash), ttl))

    def unpin(self, model: str, hash: HashLike) -> None:  # noqa: A002
        """Remove a pin; NotFound if the chunk was not pinned."""
        with self._lock:
            self._check(lib.kvb_unpin(self._handle(), _name(model), _c_hash(hash)))

    def stats(self) -> dict[str, float]:
        """Return the daemon's counters, by name."""
        arr = ctypes.POINTER(KvbStat)()
        n = ctypes.c_size_t(0)
        with self._lock:
            self._check(lib.kvb_stats(self._handle(), ctypes.byref(arr), ctypes.byref(n)))
        return _stats_dict(arr, n.value)

    def cluster_check(self) -> dict[str, float]:
        """Run the cluster's replication check (``kvblend cluster check``) on this member.

        Returns the daemon's counters, as :meth:`stats`, with the check's: ``check_members``,
        ``check_answered``, ``check_under`` (chunks with fewer than R copies among their
        owners), ``check_beyond`` (copies held beyond R), and per member ``ID``
        ``check_chunks:ID``, ``check_owned:ID``, ``check_beyond:ID``, ``check_missing:ID``,
        ``check_unverified:ID``, ``check_answered:ID``. A daemon in no cluster returns no
        ``check_*`` counter.
        """
        arr = ctypes.POINTER(KvbStat)()
        n = ctypes.c_size_t(0)
        with self._lock:
            self._check(
                lib.kvb_cluster_check(self._handle(), ctypes.byref(arr), ctypes.byref(n))
            )
        return _stats_dict(arr, n.value)

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        """Return a uint8 NumPy view of ``nbytes`` in the shared-memory segment, or None.

        KV placed here (view it with ``.view(dtype).reshape(shape)``) crosses to the
        daemon in :meth:`put` and from it in :meth:`get` (``out=``) with no copy at all.

        The view is valid only until the next call on this client that needs a larger
        buffer, or :meth:`close`: after that it points at unmapped memory and touching
        it crashes the process. Calls given private buffers stage their data in the
        same segment and overwrite its contents. None when shared memory is not
        available (tcp:// endpoint, ``no_shm``, or too large).
        """
        with self._lock:
            p = lib.kvb_shared_buffer(self._handle(), nbytes)
        if not p:
            return None
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(p))

    def region(self, nbytes: int) -> np.ndarray:
        """Allocate shared memory for the node's own buffers; return a writable uint8 view.

        Put the node's KV cache here (``.view(dtype).reshape(...)``) so that a landing
        session (:meth:`fuse_open_into`) can write fused layers straight into it.
        Zeroed and page-aligned; valid until :meth:`free_region` or :meth:`close`
        (after that the view points at unmapped memory). ipc:// endpoints only.

        Raises
        ------
        KvblendError
            Shared memory is not available (tcp://) or the daemon refused the size.
        """
        with self._lock:
            p = lib.kvb_region_alloc(self._handle(), nbytes)
            if not p:
                msg = lib.kvb_last_error(self._c).decode(errors="replace")
                raise error_for(lib.kvb_last_code(self._c) or -95, msg)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(p))

    def free_region(self, region: np.ndarray) -> None:
        """Release a region from :meth:`region` (pass the array it returned)."""
        with self._lock:
            self._check(lib.kvb_region_free(self._handle(), ctypes.c_void_p(region.ctypes.data)))

    def _fuse_args(
        self,
        segments: Sequence[Segment | tuple],
        check_layers: Sequence[int],
        ratios: Sequence[float],
        metric: str,
    ) -> tuple[Any, int, Any]:
        segs = [_segment(s) for s in segments]
        if len(check_layers) != len(ratios):
            raise BadArgument(-22, "one ratio per check layer")
        if metric not in _lib.METRICS:
            raise BadArgument(-22, f"metric '{metric}': {', '.join(_lib.METRICS)}")
        carr = (KvbSegment * max(len(segs), 1))()
        for i, s in enumerate(segs):
            carr[i].fresh = int(s.hash is None)
            if s.hash is not None:
                ctypes.memmove(carr[i].hash, s.hash, HASH_LEN)
            carr[i].pos = s.pos
            carr[i].count = s.count
        checks = (ctypes.c_uint32 * max(len(check_layers), 1))(*check_layers)
        rat = (ctypes.c_double * max(len(ratios), 1))(*ratios)
        params = _lib.KvbFuseParams(checks, rat, len(check_layers), _lib.METRICS[metric])
        # keep the arrays alive with the params
        params._keep = (checks, rat)  # type: ignore[attr-defined]
        return carr, len(segs), params

    def _open_call(self, fn: Any, model: str, args: tuple) -> ctypes.c_void_p:
        f = ctypes.c_void_p()
        missing = ctypes.POINTER(ctypes.c_uint8)()
        n_missing = ctypes.c_size_t(0)
        with self._lock:
            rc = fn(
                self._handle(),
                _name(model),
                *args,
                ctypes.byref(f),
                ctypes.byref(missing),
                ctypes.byref(n_missing),
            )
            if rc:
                hashes = []
                if missing:
                    raw = ctypes.string_at(missing, HASH_LEN * n_missing.value)
                    hashes = [raw[i : i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]
                    _lib.free(missing)
                self._raise(rc, **({"missing": hashes} if hashes else {}))
        return f

    def _open_recompute(
        self, model: str, carr: Any, n: int, check_layers: Sequence[int], recompute: Any, lay: Any
    ) -> ctypes.c_void_p:
        if len(check_layers):
            raise BadArgument(-22, "recompute is for a session without check layers")
        sel = np.ascontiguousarray(np.asarray(recompute, dtype=np.int32).reshape(-1))
        ptr = ctypes.c_void_p(sel.ctypes.data) if sel.size else None
        return self._open_call(lib.kvb_fuse_open_recompute, model, (carr, n, ptr, sel.size, lay))

    def fuse_open_into(
        self,
        model: str,
        segments: Sequence[Segment | tuple],
        k: np.ndarray,
        v: np.ndarray,
        check_layers: Sequence[int] = (),
        ratios: Sequence[float] = (),
        metric: str = "value",
        pages: Sequence[int] | np.ndarray | None = None,
        recompute: Sequence[int] | np.ndarray | None = None,
        heads: tuple[int, int] | None = None,
    ) -> LandingSession:
        """Open a fuse session that lands every fused layer in the node's own KV cache.

        The daemon writes the stored, re-rotated K and V rows of each layer after the
        first check layer into ``k`` and ``v`` itself, ahead of the node; the node
        computes the selected rows, waits for the layer (:meth:`LandingSession.wait`),
        then writes its rows and attends. At check layers it sends only the metric's
        plane (:meth:`LandingSession.check`). With no check layers the session is
        reuse-only: every layer lands, the node computes the fresh tokens only.

        Parameters
        ----------
        k, v : ndarray
            Views into one :meth:`region`, in the model's dtype: ``[layers, tokens,
            kv_heads, head_dim]``, or with ``pages`` a paged cache ``[layers, blocks,
            page_tokens, kv_heads, head_dim]``. Any strides, the same layer and page
            strides for K and V, head_dim contiguous in V: e.g. K and V interleaved in
            one array. K's token, head and head_dim strides may differ from V's (e.g.
            vLLM's CPU cache, K transposed per block and head); the daemon then lands
            K by them (``kvb_fuse_open_into_strided``).
        pages : sequence of int, optional
            The block table: token t of the prompt is in block ``pages[t //
            page_tokens]``, slot ``t % page_tokens``.
        recompute : sequence of int, optional
            As for :meth:`fuse_open`.
        heads : (begin, count), optional
            A tensor-parallel rank's share: ``k`` and ``v`` hold only the stored heads
            ``[begin, begin + count)`` (their head axis is ``count`` long). With check
            layers (value or key metric) the ranks check in two steps
            (:meth:`LandingSession.check_deviation`, then ``check_select`` with the
            ranks' sum); no ``recompute``.

        Raises
        ------
        NotFound
            Some chunks are not stored; ``err.missing`` lists their hashes.
        BadArgument
            The arrays do not describe a layout of this model in one region.
        """
        m = self._model(model)
        paged = pages is not None
        nd = 5 if paged else 4
        n_heads = m.num_kv_heads
        if heads is not None:
            try:
                hb, hc = (int(x) for x in heads)
            except (TypeError, ValueError):
                raise BadArgument(-22, f"heads {heads!r}: (begin, count)") from None
            if hc < 1 or hb < 0 or hb + hc > m.num_kv_heads:
                raise BadArgument(-22, f"heads {heads}: a range of the {m.num_kv_heads} heads")
            if recompute is not None:
                raise BadArgument(-22, "heads= takes check layers, not recompute=")
            n_heads = hc
        for name, a in (("k", k), ("v", v)):
            if not isinstance(a, np.ndarray) or a.ndim != nd:
                raise BadArgument(-22, f"{name} must be a {nd}-dimensional ndarray")
            if not _dtype_ok(a, m) or (name == "v" and a.strides[-1] != a.dtype.itemsize):
                raise BadArgument(
                    -22, f"{name}: elements of {m.dtype} (got {a.dtype}), head_dim contiguous"
                )
            if a.shape[0] != m.num_layers or a.shape[-2:] != (n_heads, m.head_dim):
                raise BadArgument(
                    -22,
                    f"{name} shape {a.shape}: layers {m.num_layers} first, "
                    f"({n_heads}, {m.head_dim}) last",
                )
            if not a.flags.writeable:
                raise BadArgument(-22, f"{name} must be writable")
        if k.strides[: nd - 3] != v.strides[: nd - 3] or k.shape != v.shape:
            raise BadArgument(-22, "k and v must have the same shape, layer and page strides")
        if min(k.strides + v.strides) < 0:
            raise BadArgument(-22, "negative strides are not supported")
        lay = _lib.KvbKvLayout()
        lay.k = k.ctypes.data
        lay.v = v.ctypes.data
        lay.layer_stride = k.strides[0]
        lay.head_stride = v.strides[-2]
        lay.token_stride = v.strides[-3]
        table = None
        if paged:
            table = np.ascontiguousarray(np.asarray(pages, dtype=np.uint32))
            if table.size and int(table.max()) >= k.shape[1]:
                raise BadArgument(-22, f"block {int(table.max())} outside the {k.shape[1]} blocks")
            lay.page_tokens = k.shape[2]
            lay.page_stride = k.strides[1]
            lay.pages = table.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
            lay.n_pages = table.size
        carr, n, params = self._fuse_args(segments, check_layers, ratios, metric)
        p = ctypes.byref(params) if len(check_layers) else None
        if heads is not None:
            ks = _lib.KvbKvStrides(k.strides[-3], k.strides[-2], k.strides[-1])
            o = _lib.KvbLandOpts(ctypes.sizeof(_lib.KvbLandOpts), None, None, hb, hc)
            if k.strides != v.strides:
                o.k_strides = ctypes.pointer(ks)
            f = self._open_call(
                lib.kvb_fuse_open_into_opts, model, (carr, n, p, ctypes.byref(lay), ctypes.byref(o))
            )
        elif recompute is not None:
            if k.strides != v.strides:
                raise BadArgument(-22, "recompute= takes k and v with the same strides")
            f = self._open_recompute(model, carr, n, check_layers, recompute, ctypes.byref(lay))
        elif k.strides == v.strides:
            f = self._open_call(lib.kvb_fuse_open_into, model, (carr, n, p, ctypes.byref(lay)))
        else:
            ks = _lib.KvbKvStrides(k.strides[-3], k.strides[-2], k.strides[-1])
            f = self._open_call(
                lib.kvb_fuse_open_into_strided,
                model,
                (carr, n, p, ctypes.byref(lay), ctypes.byref(ks)),
            )
        s = LandingSession(
            self, f, m, tuple(check_layers), metric, (k, v, table), hc if heads is not None else None
        )
        self._sessions.append(s)
        return s

    def fuse_open_into_device(
        self,
        model: str,
        segments: Sequence[Segment | tuple],
        cache: DeviceCache,
        progress: np.ndarray,
        check_layers: Sequence[int] = (),
        ratios: Sequence[float] = (),
        metric: str = "value",
        pages: Sequence[int] | np.ndarray | None = None,
        heads: tuple[int, int] | None = None,
    ) -> LandingSession:
        """:meth:`fuse_open_into` for a KV cache in a GPU's memory (``kvb_fuse_open_into_device``).

        A kvblendd whose fuse runs on that GPU (``--device cuda``) maps the allocation
        by ``cache.ipc_handle`` (a CUDA IPC handle, or one :meth:`device_handle_from_fd`
        returned) and writes each landed layer's rows there; the session
        is then used as :meth:`fuse_open_into`'s. ``progress``: at least 4 bytes of a
        :meth:`region` (the progress word :meth:`LandingSession.wait` reads); one per
        open session. ``pages``: the block table when ``cache.page_tokens`` > 0.
        ``heads``: as for :meth:`fuse_open_into` (the cache's strides are for that
        many heads).

        Raises
        ------
        BadArgument
            The daemon has no fuse device, not this GPU, or cannot map the handle; or
            the cache does not lie in the allocation.
        BadShape
            The layout spans more than the allocation holds.
        """
        self._model(model)
        if len(cache.ipc_handle) != 64:
            raise BadArgument(-22, "ipc_handle must be 64 bytes (cudaIpcGetMemHandle, or "
                              "device_handle_from_fd)")
        pci = cache.pci.encode()
        if not pci or len(pci) >= 32:
            raise BadArgument(-22, "pci must be a PCI bus id of under 32 characters")
        if not isinstance(progress, np.ndarray) or progress.nbytes < 4:
            raise BadArgument(-22, "progress must be at least 4 bytes of a region")
        lay = _lib.KvbKvLayout()
        lay.k = cache.base + cache.k_offset
        lay.v = cache.base + cache.v_offset
        lay.layer_stride = cache.layer_stride
        lay.token_stride = cache.token_stride
        lay.head_stride = cache.head_stride
        table = None
        if cache.page_tokens:
            if pages is None:
                raise BadArgument(-22, "a paged cache needs its block table (pages=)")
            table = np.ascontiguousarray(np.asarray(pages, dtype=np.uint32))
            lay.page_tokens = cache.page_tokens
            lay.page_stride = cache.page_stride
            lay.pages = table.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
            lay.n_pages = table.size
        dm = _lib.KvbDeviceMem()
        dm.base = cache.base
        dm.bytes = cache.nbytes
        ctypes.memmove(dm.ipc_handle, cache.ipc_handle, 64)
        dm.pci = pci
        dm.progress = progress.ctypes.data
        carr, n, params = self._fuse_args(segments, check_layers, ratios, metric)
        p = ctypes.byref(params) if len(check_layers) else None
        o = _lib.KvbLandOpts(ctypes.sizeof(_lib.KvbLandOpts), None, ctypes.pointer(dm), 0, 0)
        if heads is not None:
            try:
                o.head_begin, o.head_count = (int(x) for x in heads)
            except (TypeError, ValueError):
                raise BadArgument(-22, f"heads {heads!r}: (begin, count)") from None
        f = self._open_call(
            lib.kvb_fuse_open_into_opts,
            model,
            (carr, n, p, ctypes.byref(lay), ctypes.byref(o)),
        )
        s = LandingSession(
            self, f, self._model(model), tuple(check_layers), metric, (progress, table),
            o.head_count or None,
        )
        self._sessions.append(s)
        return s

    def fuse_open(
        self,
        model: str,
        segments: Sequence[Segment | tuple],
        check_layers: Sequence[int],
        ratios: Sequence[float],
        metric: str = "value",
        recompute: Sequence[int] | np.ndarray | None = None,
    ) -> FuseSession:
        """Open a fuse session (CacheBlend) over stored chunks and fresh tokens.

        Parameters
        ----------
        model : str
            The model's name.
        segments : sequence of Segment
            The prompt in token order; a tuple ``(hash, pos)`` is a chunk and
            ``(count, pos)`` with an int count is fresh tokens.
        check_layers : sequence of int
            Increasing layers at which the selection is made and narrowed. Empty:
            reuse only (nothing cached recomputed; the layer calls start at layer 0
            and carry the fresh tokens' rows).
        ratios : sequence of float
            One per check layer, in [0, 1], not increasing.
        metric : str
            ``'value'`` (CacheBlend) or ``'key'`` (LMCache) deviation, or
            ``'attention'``: question-aware (docs/fuse.md), which needs A
            (:meth:`FuseSession.attention`) by the first check layer.
        recompute : sequence of int, optional
            Only without check layers: the cached tokens (prompt indices, increasing)
            the node recomputes at every layer from layer 0, besides the fresh ones
            (a selection it made itself; kvb_fuse_open_recompute()).

        Returns
        -------
        FuseSession

        Raises
        ------
        NotFound
            Some chunks are not stored; ``err.missing`` lists their hashes.
        """
        m = self._model(model)
        carr, n, params = self._fuse_args(segments, check_layers, ratios, metric)
        p = ctypes.byref(params) if len(check_layers) else None
        if recompute is not None:
            f = self._open_recompute(model, carr, n, check_layers, recompute, None)
        else:
            f = self._open_call(lib.kvb_fuse_open, model, (carr, n, p))
        s = FuseSession(self, f, m)
        self._sessions.append(s)
        return s

    def fuse_device(self) -> None:
        """Take fused layers on the GPU from now on (CUDA IPC; kvb_fuse_device()).

        For a node on the daemon's machine whose KV cache is on the GPU the daemon
        fuses on: sessions opened after this map the daemon's device ring, and
        :meth:`FuseSession.layer` without ``k_out``/``v_out`` leaves each fused layer
        there (:meth:`FuseSession.output_device`). Loads the NVIDIA driver at run time.

        Raises
        ------
        KvblendError
            ``name == 'ENODEV'``: no NVIDIA driver or GPU here; keep using host memory.
        """
        with self._lock:
            self._check(lib.kvb_fuse_device(self._handle()))


def _segment(s: Segment | tuple) -> Segment:
    if isinstance(s, Segment):
        return s
    what, pos = s
    if isinstance(what, (int, np.integer)):
        return Segment.fresh(int(what), int(pos))
    return Segment.chunk(what, int(pos))


def malloc_tune(keep_bytes: int = 0) -> bool:
    """Tune glibc's malloc for receiving large chunks in frames over TCP (optional).

    Process-wide. ``Client.get`` over TCP needs it only where the daemon offers no bulk
    connection (an older one, ``tcp_bulk`` off); ``get_layers`` keeps frames and does.

    Received frames then come from, and return to, the heap instead of being mapped
    and faulted in again at every GET (a 32 MiB GET over loopback TCP: 1.2-1.7 GB/s
    untuned in a process that read other sizes before, 4-5 GB/s tuned). Up to
    ``keep_bytes`` (0: 512 MiB) of freed memory is kept for reuse, so resident
    memory stays near its peak. See ``kvb_malloc_tune()`` in kvblend.h.

    Returns
    -------
    bool
        True when applied; False when malloc is not glibc's (under AddressSanitizer,
        jemalloc): nothing to tune this way.
    """
    return bool(lib.kvb_malloc_tune(keep_bytes) == 0)
