"""Layers, FuseSession and LandingSession: what Client.get_layers() and the fuse calls return."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ._arrays import _as_array, _dtype_ok, _row_shape_ok, _stats_dict
from ._lib import KvbStat, lib
from .errors import BadArgument
from .types import ChunkInfo, Model

if TYPE_CHECKING:
    from .client import Client


class Layers:
    """Layers of a chunk left in the frames they arrived in (:meth:`Client.get_layers`).

    ``k[i]`` and ``v[i]`` are read-only arrays of layer ``layer_begin + i`` that view
    the received bytes. Without :meth:`close` the frames live as long as any of the
    arrays does; :meth:`close` (or the end of a ``with`` block) frees them at once,
    after which the arrays must not be read. ``info`` describes the chunk.
    """

    def __init__(self, ptr: Any, model: Model) -> None:
        self._ptr = ptr
        c = ptr.contents
        self.layer_begin: int = c.layer_begin
        self.layer_end: int = c.layer_end
        self.info = ChunkInfo._from_c(c.info)
        n = c.layer_end - c.layer_begin
        shape = (c.info.num_tokens, model.num_kv_heads, model.head_dim)

        def view(p: int) -> np.ndarray:
            buf = (ctypes.c_uint8 * c.tensor_bytes).from_address(p)
            buf._layers = self  # an array outliving the Layers keeps the frames alive
            a = np.frombuffer(buf, dtype=model.np_dtype).reshape(shape)
            a.flags.writeable = False
            return a

        self.k: list[np.ndarray] = [view(c.k[i]) for i in range(n)]
        self.v: list[np.ndarray] = [view(c.v[i]) for i in range(n)]

    def close(self) -> None:
        """Free the frames (the arrays then must not be read). Idempotent."""
        if self._ptr:
            self.k = []
            self.v = []
            lib.kvb_layers_free(ctypes.byref(self._ptr))
            self._ptr = None

    def __enter__(self) -> Layers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class FuseSession:
    """An open fuse session (kvb_fuse); made by :meth:`Client.fuse_open`.

    The node prefills the layers before the first check layer itself, then calls
    :meth:`layer` for every layer from ``next_layer`` on, in order, with fresh K and
    V for the tokens :meth:`rows` names: all tokens at the first check layer, the
    selected (HKVD) tokens after it. From the layer after the first check layer on,
    the daemon returns the fused K and V of all tokens.

    Use it as a context manager, or call :meth:`close` (which returns the stats).
    Like its Client, a session must not be used by two threads at once.
    """

    def __init__(self, client: Client, handle: ctypes.c_void_p, model: Model) -> None:
        self._client = client
        self._f = handle
        self.model = model
        self.stats: dict[str, float] | None = None

    def _handle(self) -> ctypes.c_void_p:
        if not self._f:
            raise BadArgument(-22, "the fuse session is closed")
        return self._f

    @property
    def tokens(self) -> int:
        """Tokens in the session (the sum of its segments)."""
        return int(lib.kvb_fuse_tokens(self._handle()))

    @property
    def next_layer(self) -> int:
        """The layer the next :meth:`layer` call must be for."""
        return int(lib.kvb_fuse_next_layer(self._handle()))

    @property
    def done(self) -> bool:
        """Whether every layer has been served."""
        return self.next_layer >= self.model.num_layers

    def rows(self) -> np.ndarray:
        """Sorted token indices (int32, a copy) whose fresh K and V the next layer call needs."""
        p = ctypes.POINTER(ctypes.c_int32)()
        n = lib.kvb_fuse_rows(self._handle(), ctypes.byref(p))
        if n == 0:
            return np.empty(0, np.int32)
        return np.ctypeslib.as_array(p, shape=(n,)).copy()

    def _in(self, x: Any, rows: int, what: str) -> np.ndarray:
        a = np.ascontiguousarray(_as_array(x))
        m = self.model
        want = (rows, m.num_kv_heads, m.head_dim)
        if not _row_shape_ok(a.shape, rows, m) or not _dtype_ok(a, m):
            raise BadArgument(
                -22,
                f"{what} must be {want} (or [{rows}, {m.num_kv_heads * m.head_dim}]) of "
                f"{m.dtype}, got {a.shape} of {a.dtype}",
            )
        return a

    def _out(self, x: np.ndarray | None, what: str) -> np.ndarray | None:
        if x is None:
            return None
        m = self.model
        if not (
            isinstance(x, np.ndarray)
            and x.flags.c_contiguous
            and x.flags.writeable
            and x.nbytes == self.tokens * m.row_bytes
        ):
            raise BadArgument(
                -22,
                f"{what} must be a writable C-contiguous array of "
                f"{self.tokens * m.row_bytes} bytes "
                f"([{self.tokens}, {m.num_kv_heads}, {m.head_dim}])",
            )
        return x

    def layer(
        self,
        layer: int,
        k: Any,
        v: Any,
        k_out: np.ndarray | None = None,
        v_out: np.ndarray | None = None,
    ) -> bool:
        """Serve one layer; return whether fused K and V are available for it.

        Parameters
        ----------
        layer : int
            Must equal :attr:`next_layer`.
        k, v : array
            Fresh K and V for :meth:`rows`, each ``[rows, kv_heads, head_dim]``.
        k_out, v_out : ndarray, optional
            Filled with the fused K and V of all tokens (``[tokens, kv_heads,
            head_dim]``) when the result is True. Without them, read the fused layer
            with :meth:`output`.

        Returns
        -------
        bool
            False at the first check layer (fused = the node's fresh KV), True after.

        Raises
        ------
        BadArgument
            Wrong layer or row count; the session stays as it was.
        UnknownSession
            The session expired.
        """
        rows = lib.kvb_fuse_rows(self._handle(), None)
        ka, va = self._in(k, rows, "k"), self._in(v, rows, "v")
        ko, vo = self._out(k_out, "k_out"), self._out(v_out, "v_out")
        # Zero rows: libkvblend still wants a readable pointer for the empty frame.
        kp = ka.ctypes.data if ka.nbytes else ctypes.addressof(_EMPTY)
        vp = va.ctypes.data if va.nbytes else ctypes.addressof(_EMPTY)
        fused = ctypes.c_int(0)
        c = self._client
        with c._lock:
            c._check(
                lib.kvb_fuse_layer(
                    c._handle(),
                    self._f,
                    layer,
                    ctypes.c_void_p(kp),
                    ctypes.c_void_p(vp),
                    ctypes.c_void_p(ko.ctypes.data) if ko is not None else None,
                    ctypes.c_void_p(vo.ctypes.data) if vo is not None else None,
                    ctypes.byref(fused),
                )
            )
        return bool(fused.value)

    def attention(self, a: Any) -> None:
        """Give A for the attention metric (kvb_fuse_attention()).

        ``a`` is float32 ``[chunk tokens, kv_heads]``: how much the question attends to
        each token of the session's stored chunks (in prompt order, fresh tokens
        skipped) through each KV head, finite and >= 0. It goes with the next
        :meth:`layer` (or :meth:`LandingSession.check`) call; the daemon scores that
        and every later check layer with it.

        Raises
        ------
        BadArgument
            Wrong shape, or the session's metric is not ``'attention'``.
        """
        arr = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
        m = self.model
        if arr.ndim != 2 or arr.shape[1] != m.num_kv_heads:
            raise BadArgument(
                -22, f"A must be [chunk tokens, {m.num_kv_heads}] float32, got {arr.shape}"
            )
        c = self._client
        with c._lock:
            c._check(
                lib.kvb_fuse_attention(
                    c._handle(),
                    self._handle(),
                    ctypes.c_void_p(arr.ctypes.data if arr.size else ctypes.addressof(_EMPTY)),
                    arr.size,
                )
            )

    def output(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Return the fused K and V of the last layer call, in the daemon's shared ring.

        Read-only views ``[tokens, kv_heads, head_dim]`` with no copy, valid until the
        next call on this session (the ring slot is reused) and never after
        :meth:`close` (the ring is unmapped). None when the last call returned no
        fused layer or the ring is not shared (tcp://, ``no_shm``): then pass
        ``k_out`` and ``v_out`` to :meth:`layer`.
        """
        k, v = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.kvb_fuse_output(self._handle(), ctypes.byref(k), ctypes.byref(v)) != 0:
            return None
        m = self.model
        shape = (self.tokens, m.num_kv_heads, m.head_dim)
        n = self.tokens * m.row_bytes
        views = []
        for p in (k.value, v.value):
            a = np.frombuffer((ctypes.c_uint8 * n).from_address(p), np.uint8)
            a = a.view(m.np_dtype).reshape(shape)
            a.flags.writeable = False
            views.append(a)
        return views[0], views[1]

    @property
    def on_device(self) -> bool:
        """Whether fused layers can stay on the GPU (:meth:`Client.fuse_device`)."""
        return bool(lib.kvb_fuse_on_device(self._handle()))

    def output_device(self) -> tuple[int, int] | None:
        """Device pointers to the fused K and V the last layer call left on the GPU.

        Integers (CUdeviceptr) valid in this process's primary CUDA context of the
        daemon's GPU, each ``[tokens, kv_heads, head_dim]`` in the model's dtype,
        read-only, until the next call on this session; wrap them with the node's
        framework (CuPy's ``UnownedMemory``, a DLPack capsule). None when the last
        call left no fused layer on the device.
        """
        k, v = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.kvb_fuse_output_device(self._handle(), ctypes.byref(k), ctypes.byref(v)) != 0:
            return None
        return int(k.value or 0), int(v.value or 0)

    def close(self) -> dict[str, float]:
        """Close the session; return the daemon's timings and byte counts for it.

        Idempotent: a second call returns the same stats.
        """
        if not self._f:
            return self.stats or {}
        c = self._client
        arr = ctypes.POINTER(KvbStat)()
        n = ctypes.c_size_t(0)
        with c._lock:
            rc = lib.kvb_fuse_close(c._c, ctypes.byref(self._f), ctypes.byref(arr), ctypes.byref(n))
            self._f = ctypes.c_void_p()
            if self in c._sessions:
                c._sessions.remove(self)
            self.stats = _stats_dict(arr, n.value) if arr else {}
            c._check(rc)
        return self.stats

    def __enter__(self) -> FuseSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_EMPTY = (ctypes.c_uint8 * 1)()


class LandingSession(FuseSession):
    """A fuse session that lands fused layers in the node's own buffers.

    Made by :meth:`Client.fuse_open_into`. Per layer, the node:

    * up to and including the first check layer: computes every token itself;
    * at a check layer: :meth:`check` with the metric's plane (V, or K for the key
      metric; K and V for the attention metric) of :meth:`rows`; it returns the rows
      to stop computing;
    * after the first check layer: computes the selected rows (:meth:`rows`), then
      :meth:`wait` for the layer, then writes its rows into its cache and attends.

    Close it (or leave the ``with`` block) before reusing the buffers: once
    :meth:`close` returns the daemon writes nothing more.
    """

    def __init__(
        self,
        client: Client,
        handle: ctypes.c_void_p,
        model: Model,
        check_layers: tuple[int, ...],
        metric: str,
        keep: tuple,
        heads: int | None = None,
    ) -> None:
        super().__init__(client, handle, model)
        self.check_layers = check_layers
        self.metric = metric
        self._keep = keep  # the arrays the daemon writes into, and the block table
        # the rows a check takes: of the node's heads (a head range's count), else all
        self._rows_model = dataclasses.replace(model, num_kv_heads=heads) if heads else model

    def layer(self, *args: Any, **kwargs: Any) -> bool:  # noqa: D102 - refused
        raise BadArgument(-22, "a landing session takes check() and wait(), not layer()")

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is in the node's buffers (at once for its own layers).

        Raises
        ------
        TimeoutError
            Not landed within ``timeout`` seconds.
        KvblendError
            The daemon stopped landing (e.g. ``Corrupt``): close the session.
        """
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        c = self._client
        with c._lock:
            rc = lib.kvb_fuse_wait(c._handle(), self._handle(), layer, ms)
            if rc == -110:
                raise TimeoutError(lib.kvb_last_error(c._c).decode(errors="replace"))
            c._check(rc)

    def _check_rows(self, rows: Any, plain: bool = False) -> tuple[np.ndarray, int, int]:
        """The rows of a check call as (array kept alive, its pointer, its row stride)."""
        m = self._rows_model
        a = _as_array(rows)
        n = int(lib.kvb_fuse_rows(self._handle(), None))
        both = self.metric == "attention" and not plain
        row_bytes = m.row_bytes * (2 if both else 1)
        if both:
            ok = tuple(a.shape) in (
                (n, 2, m.num_kv_heads, m.head_dim),
                (n, 2 * m.num_kv_heads * m.head_dim),
            )
            flat = 2 * m.num_kv_heads * m.head_dim
            want = f"[{n}, 2, {m.num_kv_heads}, {m.head_dim}] (or [{n}, {flat}])"
        else:
            ok = _row_shape_ok(a.shape, n, m)
            flat = m.num_kv_heads * m.head_dim
            want = f"[{n}, {m.num_kv_heads}, {m.head_dim}] (or [{n}, {flat}])"
        if not ok or not _dtype_ok(a, m):
            raise BadArgument(-22, f"rows must be {want} of {m.dtype}, got {a.shape} of {a.dtype}")
        inner = a[0] if n else a.reshape(-1)
        if n and (not inner.flags.c_contiguous or inner.nbytes != row_bytes or a.strides[0] < 0):
            a = np.ascontiguousarray(a)
        stride = a.strides[0] if n else 0
        ptr = a.ctypes.data if a.nbytes else ctypes.addressof(_EMPTY)
        return a, ptr, stride

    def check(self, layer: int, rows: Any) -> np.ndarray:
        """Send the metric's plane at a check layer; return the dropped tokens.

        ``rows`` holds the V rows (K for the key metric) of :meth:`rows`, ``[rows,
        kv_heads, head_dim]`` or ``[rows, kv_heads * head_dim]``; for the attention
        metric K and V of each row, ``[rows, 2, kv_heads, head_dim]`` or ``[rows, 2 *
        kv_heads * head_dim]`` (K first, as in a fused QKV output). Rows may be strided
        (e.g. a column slice of a fused QKV output): in a :meth:`Client.region` or the
        shared buffer they are read where they are. Afterwards :meth:`rows` is the new
        selection; the returned int32 array lists the tokens sent that are no longer
        selected (sorted). A session of a head range (``heads=``) is refused: its
        tensor-parallel ranks use :meth:`check_deviation` and :meth:`check_select`.
        """
        a, ptr, stride = self._check_rows(rows)
        dp = ctypes.POINTER(ctypes.c_int32)()
        nd = ctypes.c_size_t(0)
        c = self._client
        with c._lock:
            c._check(
                lib.kvb_fuse_check(
                    c._handle(),
                    self._f,
                    layer,
                    ctypes.c_void_p(ptr),
                    stride,
                    ctypes.byref(dp),
                    ctypes.byref(nd),
                )
            )
        if nd.value == 0:
            return np.empty(0, np.int32)
        return np.ctypeslib.as_array(dp, shape=(nd.value,)).copy()

    def check_deviation(self, layer: int, rows: Any) -> np.ndarray:
        """A check layer's first half: each of :meth:`rows`' deviation over this session's heads.

        ``rows`` as for :meth:`check` (value or key metric: the plane's rows of this
        session's heads, ``[rows, heads, head_dim]``). Returns float32, one a row;
        nothing is selected. Tensor-parallel ranks sum their answers (a sum of squares
        over heads: the sum is the whole model's) and each calls :meth:`check_select`
        with the sum (``kvb_fuse_check_deviation``, ABI ``KVBLEND_1.5``).
        """
        a, ptr, stride = self._check_rows(rows, plain=True)
        n = int(lib.kvb_fuse_rows(self._handle(), None))
        out = np.empty(n, np.float32)
        c = self._client
        with c._lock:
            c._check(
                lib.kvb_fuse_check_deviation(
                    c._handle(), self._f, layer, ctypes.c_void_p(ptr), stride,
                    out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                )
            )
        return out

    def check_select(self, layer: int, deviation: Any) -> np.ndarray:
        """A check layer's second half: select by ``deviation`` (float32, one a row of :meth:`rows`).

        The daemon selects as :meth:`check` does by its own deviations; returns the
        dropped tokens as :meth:`check` does (``kvb_fuse_check_select``).
        """
        n = int(lib.kvb_fuse_rows(self._handle(), None))
        d = np.ascontiguousarray(np.asarray(deviation, dtype=np.float32))
        if d.shape != (n,):
            raise BadArgument(-22, f"deviation must be [{n}] float32, got {d.shape}")
        dp = ctypes.POINTER(ctypes.c_int32)()
        nd = ctypes.c_size_t(0)
        c = self._client
        with c._lock:
            c._check(
                lib.kvb_fuse_check_select(
                    c._handle(), self._f, layer,
                    d.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if n else None,
                    ctypes.byref(dp), ctypes.byref(nd),
                )
            )
        if nd.value == 0:
            return np.empty(0, np.int32)
        return np.ctypeslib.as_array(dp, shape=(nd.value,)).copy()
