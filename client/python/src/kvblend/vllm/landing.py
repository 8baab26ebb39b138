"""Direct landing for kvblend.vllm: vLLM's KV cache in a kvblend region, written by the daemon.

When the daemon is local (``ipc://``), the worker's ``get_mem_pool_context()`` returns a
context under which vLLM 0.32's one KV-cache allocation (``allocate_kv_cache``: a single
``torch.zeros(size, dtype=int8)`` on the CPU) becomes a view of a kvblend region: shared
memory the daemon may write. A loading request then opens a reuse-only landing session
(``fuse_open_into``) paged with the request's block table: the daemon writes the chunks,
keys re-rotated to their positions, straight into vLLM's cache layer by layer ahead of the
forward pass, and ``wait_for_layer_load`` waits on the session's progress word.

The arrays handed to the daemon come from :func:`kvblend.vllm.layout.region_views` (vLLM's
CPU cache transposes K per block: the K array has strides of its own,
``kvb_fuse_open_into_strided``).

On a GPU there is no region: :class:`DeviceLanding` exports vLLM's own allocation (its
CUDA IPC handle) and opens device landing sessions (``fuse_open_into_device``) that a
kvblendd fusing on that GPU writes through; the waits and closes are the same.

Anything that does not hold (a ``tcp://`` endpoint, shared memory refused or too small, an
allocation of another shape, a layout that is not one allocation with a uniform stride
between layers, a daemon that lost the region, a daemon with no device on the GPU) leaves
the connector on its copy path; one log line says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..client import Client
from ..errors import BadArgument, BadShm, KvblendError, NotFound, Unavailable, UnknownSession
from ..sessions import LandingSession
from ..types import DeviceCache, Model
from .daemon import wait_layer
from .layout import CPU_VEC, INTERLEAVED, device_cache, region_views
from .plan import ChunkLoad, landable


class _TakeAllocation(TorchFunctionMode):
    """Answer the one ``torch.zeros(size, dtype=int8)`` on the CPU with the region."""

    def __init__(self, region: CacheRegion) -> None:
        super().__init__()
        self.region = region

    def _is_the_cache(self, args: tuple, kwargs: dict) -> bool:
        shape = args[0] if len(args) == 1 else args
        if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
            shape = shape[0]
        dev = kwargs.get("device", "cpu")
        return (
            isinstance(shape, int)
            and shape == self.region.size
            and kwargs.get("dtype") is torch.int8
            and torch.device(dev if dev is not None else "cpu").type == "cpu"
            and set(kwargs) <= {"dtype", "device"}
        )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        r = self.region
        if (
            func is torch.zeros
            and r.buf is not None
            and not r.taken
            and self._is_the_cache(args, kwargs)
        ):
            r.taken = True
            return torch.from_numpy(r.buf[: r.size].view(np.int8))  # zeroed by the daemon
        return func(*args, **kwargs)


class CacheRegion:
    """vLLM's KV cache in a kvblend region, and the landing sessions into it.

    Parameters
    ----------
    endpoint, timeout_ms
        The daemon (``ipc://`` only) and the per-call deadline.
    size : int
        The bytes of vLLM's one KV-cache allocation (``KVCacheTensor.size``).
    logger
        Where the one line saying why landing is off goes.
    """

    def __init__(self, endpoint: str, timeout_ms: int, size: int, logger: logging.Logger) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.size = size
        self.log = logger
        self.client: Client | None = None
        self.buf: np.ndarray | None = None
        self.taken = False
        self.active = False  # the cache is in the region and the views are set
        self.said_off = False
        self.k: np.ndarray | None = None  # [layers, blocks, block_size, heads, hd], K's strides
        self.v: np.ndarray | None = None
        self.block_size = 0
        self.heads: tuple[int, int] | None = None  # a tensor-parallel rank's KV heads
        # this step's sessions, and the seconds each has held the engine (open, waits, close)
        self.sessions: dict[str, tuple[LandingSession, list[float]]] = {}
        self.failed: set[str] = set()  # this step's sessions that stopped landing
        self.gone = False  # this step found the daemon gone or not answering: no closes
        self.stalled = False  # a wait of this step timed out or found the daemon gone

    def off(self, why: str) -> None:
        """Leave landing off for good (copy path), with one log line."""
        if not self.said_off:
            self.said_off = True
            self.log.warning("kvblend: landing off, loads copy from the daemon's reply: %s", why)
        self.active = False
        if not self.taken and self.client is not None and self.buf is not None:
            # vLLM never used it: give the shared memory back.
            try:
                self.client.free_region(self.buf)
            except KvblendError:
                pass
            self.buf = None

    def context(self) -> _TakeAllocation | None:
        """Return the allocation context for vLLM, or None (log line) when there is no region."""
        if not self.endpoint.startswith("ipc://"):
            self.off(f"the endpoint {self.endpoint} is not ipc:// (shared memory is local only)")
            return None
        try:
            self.client = Client(self.endpoint, timeout_ms=self.timeout_ms)
            self.buf = self.client.region(self.size)
        except KvblendError as e:
            self.off(
                f"no shared-memory region of {self.size} bytes for vLLM's KV cache ({e}); "
                "kvblendd's shm_max (--shm-max) must be at least the cache "
                "(VLLM_CPU_KVCACHE_SPACE) plus 4 KiB and shm_total (--shm-total) above it"
            )
            return None
        return _TakeAllocation(self)

    def attach(
        self,
        layers: Sequence[torch.Tensor],
        model: Model,
        block_size: int,
        kind: str = CPU_VEC,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Check that vLLM's layers (layer order, layout ``kind``) lie in the region; view them.

        ``heads``: (first, count) of the model's KV heads the layers hold (a
        tensor-parallel rank's); the daemon lands those of each stored chunk.
        """
        if self.buf is None:
            return
        if not self.taken:
            self.off("vLLM did not allocate its KV cache as one torch.zeros(int8) (another vLLM?)")
            return
        views = region_views(
            self.buf, self.size, layers, model, block_size, kind, heads[1] if heads else None
        )
        if views is None:
            self.off("vLLM's cache layers are not in the region at one stride")
            return
        self.k, self.v = views
        self.block_size = block_size
        if heads is not None and heads != (0, model.num_kv_heads):
            self.heads = heads
        self.active = True
        self.log.info(
            "kvblend: vLLM's KV cache (%d bytes) is in a kvblend region: loads land directly",
            self.size,
        )

    def open(self, model_name: str, req_id: str, chunks: list[ChunkLoad], blocks: list[int]):
        """Open a landing session for a load of this step; False when it takes the copy path.

        Only a load whose chunks lie back to back from position 0, each from its first
        token, lands (the session's token t is prompt position t, in block
        ``blocks[t // block_size]``); the tokens of its last chunk past the claim are
        written too and then computed over by vLLM in the layer's forward, which runs
        only after the layer has landed. The step waits for each layer (:meth:`wait`)
        and closes the session (:meth:`close_all`).
        """
        got = self.start(model_name, req_id, chunks, blocks)
        if got is None:
            return False
        self.sessions[req_id] = (got[0], [got[1]])
        return True

    def start(
        self, model_name: str, req_id: str, chunks: list[ChunkLoad], blocks: list[int]
    ) -> tuple[LandingSession, float] | None:
        """Open a landing session for a load as :meth:`open` does, without keeping it.

        Returns the session and the seconds the open took, or None (the copy path).
        An asynchronous load's session is the caller's to poll and close.
        """
        pos = landable(chunks) if self.active else None
        if pos is None:
            return None
        need = -(-pos // self.block_size)
        if need > len(blocks):
            return None
        assert self.client is not None
        t0 = time.monotonic()
        try:
            s = self._open_session(model_name, [(c.hash, c.start) for c in chunks], blocks[:need])
        except BadArgument as e:
            if self._refused_for_good(e):
                self.off(str(e))
            else:
                self.log.warning("kvblend: landing session for %s refused (%s): copying", req_id, e)
            return None
        except BadShm as e:
            self.off(f"the daemon no longer knows the region ({e}): restarted or shm_idle")
            return None
        except (NotFound, UnknownSession):
            return None
        except Unavailable:
            raise  # the daemon is down: the load fails (a copy would wait as long again)
        except KvblendError as e:
            if e.name in ("ENOTSUP", "EOPNOTSUPP"):  # a kvblendd older than K strides
                self.off(f"the daemon cannot land vLLM's transposed K ({e})")
            else:
                self.log.warning("kvblend: landing session for %s refused (%s): copying", req_id, e)
            return None
        return s, time.monotonic() - t0

    def _open_session(self, model_name: str, segs: list, pages: list[int]) -> LandingSession:
        """Open the landing session of one load into the region (raises as the client)."""
        return self.client.fuse_open_into(
            model_name, segs, self.k, self.v, pages=pages, heads=self.heads
        )

    def _refused_for_good(self, e: BadArgument) -> bool:
        """Whether a refused open means no later one can land either (then off)."""
        return False

    def wait(self, layer: int, timeout_s: float) -> list[str]:
        """Wait until ``layer`` landed in every open session; return the requests that failed.

        A session that stops fails alone. A wait that times out, or finds the daemon gone
        (:func:`kvblend.vllm.daemon.wait_layer` looks every 0.25 s), fails every session
        of the step at once (one daemon lands them all), so that a dead daemon holds the
        engine about one ``timeout_s`` per step, not one per session; :attr:`gone` says so.
        """
        bad = []
        for rid, (s, held) in self.sessions.items():
            if rid in self.failed:
                continue
            t0 = time.monotonic()
            try:
                wait_layer(s, layer, timeout_s, self.endpoint)
                held[0] += time.monotonic() - t0
            except (Unavailable, TimeoutError) as e:
                held[0] += time.monotonic() - t0
                self.log.warning(
                    "kvblend: landing stopped at layer %d (%s): %d sessions of this step fail",
                    layer, e, len(self.sessions) - len(self.failed),
                )
                self.gone = isinstance(e, Unavailable)
                self.stalled = True
                bad += [r for r in self.sessions if r not in self.failed]
                self.failed.update(self.sessions)
                break
            except KvblendError as e:
                self.log.warning("kvblend: landing for %s stopped at layer %d: %s", rid, layer, e)
                self.failed.add(rid)
                bad.append(rid)
        return bad

    def close_one(self, s: LandingSession, req_id: str) -> tuple[dict | None, bool]:
        """Close one session: (its close stats, whether it failed).

        The stats are None when the daemon did not answer (it may be stopped, not dead:
        the close stays queued for it), {} when it answered with an error.
        """
        try:
            st = s.close()
        except Unavailable as e:
            self.log.warning("kvblend: closing the landing session of %s: %s", req_id, e)
            return None, True
        except KvblendError as e:
            self.log.warning("kvblend: closing the landing session of %s: %s", req_id, e)
            return {}, True
        return st, bool(st.get("land_failed"))

    def close_all(self) -> dict[str, tuple[dict, float, bool]]:
        """Close this step's sessions.

        Returns, per request, its close stats, the seconds it held the engine (open, waits
        and close), and whether it failed.
        """
        out = {}
        for rid, (s, held) in self.sessions.items():
            failed = rid in self.failed
            st: dict = {}
            if self.gone:
                # the daemon's process is gone, and its sessions with it: a close would
                # only wait out the timeout
                failed = True
            else:
                t0 = time.monotonic()
                got, bad = self.close_one(s, rid)
                if got is None:
                    # not answering: the next sessions' closes would wait as long each
                    self.gone = True
                elif got or not bad:
                    held[0] += time.monotonic() - t0  # answered
                st, failed = got or {}, failed or bad
            out[rid] = (st, held[0], failed)
        self.sessions = {}
        self.failed = set()
        self.gone = self.stalled = False
        return out


@dataclass(frozen=True)
class DeviceAllocation:
    """The GPU allocation vLLM's KV cache lies in, as the daemon maps it.

    ``base``: its start in this process (what ``ipc_handle`` names), ``nbytes`` at
    least its bytes up to the cache's end, ``ipc_handle`` 64 bytes (``cudaIpcGetMemHandle``;
    for a descriptor handed to the daemon, what :meth:`kvblend.Client.device_handle_from_fd`
    returned), ``pci`` its GPU's bus id.
    """

    base: int
    nbytes: int
    ipc_handle: bytes
    pci: str


def cuda_allocation(layers: Sequence[torch.Tensor], client: Client) -> DeviceAllocation:
    """Export the CUDA allocation holding vLLM's layers (one KV-cache tensor) by CUDA IPC.

    PyTorch's IPC export of the first layer's storage: the handle of the caching
    allocator's block it lies in and its offset there; the bus id from the CUDA driver
    (the format kvblendd's device compares with), else from PyTorch's device properties.
    ``client`` is not needed (vLLM 0.32 and 0.33; the daemon binds the import to the
    client that names the handle). Raises RuntimeError (or what PyTorch raises) when the
    storage cannot be exported, such as memory from vLLM's sleep-mode pool or 0.34's
    growable cache (:func:`vmm_allocation` exports that).
    """
    t = layers[0]
    st = t.untyped_storage()
    _dev, handle, size, offset, *_ = st._share_cuda_()
    handle = bytes(handle)
    if len(handle) != 64:
        raise RuntimeError(f"a CUDA IPC handle of {len(handle)} bytes, not 64")
    return DeviceAllocation(st.data_ptr() - offset, offset + size, handle, _pci_bus_id(t.device))


#: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_ALLOC_GRANULARITY_MINIMUM (cuda.h).
_CU_POSIX_FD = 1
_CU_GRANULARITY_MINIMUM = 0


def vmm_segments(
    layers: Sequence[torch.Tensor], granularity: int
) -> tuple[int, list[tuple[int, int, int]]]:
    """The extent's start and ``(pointer, offset, size)`` of each segment holding ``layers``.

    vLLM 0.34's growable cache reserves one range of addresses and backs each layer's
    region (a segment: layer-outermost layouts) by one allocation once it is final:
    a segment starts at its layer storage's first byte and spans its storage's bytes,
    rounded up to the driver's granularity (what the allocation holds). Layers that share
    a storage (block-outermost: one segment) count once. Raises RuntimeError for
    segments that overlap or do not start on a granule.
    """
    spans: dict[int, int] = {}
    for t in layers:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        spans[ptr] = max(spans.get(ptr, 0), nbytes)
    base = min(spans)
    out, end = [], base
    for ptr in sorted(spans):
        size = -(-spans[ptr] // granularity) * granularity
        if ptr < end or (ptr - base) % granularity:
            raise RuntimeError(f"segment at +{ptr - base} overlaps the one before, or does not "
                               f"start on a granule of {granularity} bytes")
        out.append((ptr, ptr - base, size))
        end = ptr + size
    return base, out


def vmm_allocation(layers: Sequence[torch.Tensor], client: Client) -> DeviceAllocation:
    """Export vLLM 0.34's growable KV cache (CUDA virtual memory) to the daemon by fds.

    Each segment's allocation (:func:`vmm_segments`) is exported as a POSIX fd
    (``cuMemRetainAllocationHandle``, ``cuMemExportToShareableHandle``): vLLM creates
    them exportable when the connector declares ``KVCacheAccess.EXPORTS_FD``. The fds
    go to the daemon over its descriptor socket (:meth:`Client.device_handle_from_fds`),
    which maps them at the same offsets of a range of its own, and are closed here.
    Raises RuntimeError when the memory is not the driver's virtual memory, or not
    exportable.
    """
    import ctypes
    import os

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = layers[0].device
    ordinal = dev.index if dev.index is not None else torch.cuda.current_device()

    class _Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class _Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                    ("location", _Loc), ("win32HandleMetaData", ctypes.c_void_p),
                    ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    prop = _Prop(type=1, requestedHandleTypes=_CU_POSIX_FD, location=_Loc(1, ordinal))
    gran = ctypes.c_size_t()
    rc = cuda.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                            _CU_GRANULARITY_MINIMUM)
    if rc or not gran.value:
        raise RuntimeError(f"cuMemGetAllocationGranularity: CUDA error {rc}")
    base, segs = vmm_segments(layers, gran.value)
    fds: list[int] = []
    try:
        for ptr, _off, _size in segs:
            h, fd = ctypes.c_ulonglong(), ctypes.c_int(-1)
            rc = cuda.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(ptr))
            if rc:
                raise RuntimeError(f"cuMemRetainAllocationHandle: CUDA error {rc} (not the "
                                   "driver's virtual memory)")
            rc = cuda.cuMemExportToShareableHandle(ctypes.byref(fd), h, _CU_POSIX_FD,
                                                   ctypes.c_ulonglong(0))
            cuda.cuMemRelease(h)
            if rc:
                raise RuntimeError(f"cuMemExportToShareableHandle: CUDA error {rc} (created "
                                   "without POSIX fd export)")
            fds.append(fd.value)
        handle = client.device_handle_from_fds(fds, [o for _, o, _ in segs],
                                               [z for _, _, z in segs])
    finally:
        for fd in fds:
            os.close(fd)
    _, last_off, last_size = segs[-1]
    return DeviceAllocation(base, last_off + last_size, handle, _pci_bus_id(dev))


def auto_allocation(layers: Sequence[torch.Tensor], client: Client) -> DeviceAllocation:
    """vLLM's cache as the daemon maps it: by fds when it is the driver's virtual memory
    (vLLM 0.34's growable cache), else by CUDA IPC (0.32, 0.33, or the growable cache off)."""
    try:
        return vmm_allocation(layers, client)
    except (RuntimeError, OSError, AttributeError):
        return cuda_allocation(layers, client)


def _pci_bus_id(device: torch.device) -> str:
    import ctypes

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, buf = ctypes.c_int(), ctypes.create_string_buffer(32)
        if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0 and \
                cuda.cuDeviceGetPCIBusId(buf, 32, dev) == 0:
            return buf.value.decode()
    except OSError:
        pass
    p = torch.cuda.get_device_properties(ordinal)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


class DeviceLanding(CacheRegion):
    """vLLM's KV cache in a GPU's memory, landed into by a kvblendd fusing on that GPU.

    vLLM allocates its cache on the GPU as usual (no region, no allocation context); the
    worker exports the allocation (``export``: :func:`cuda_allocation`), and a load opens
    a device landing session (``fuse_open_into_device``): the daemon maps the allocation
    once and writes each layer's rows, keys re-rotated, into vLLM's paged blocks with its
    own kernel; ``wait_for_layer_load`` waits on the session's progress word (a word of a
    small region) before the layer's forward. A kvblendd without a CUDA device on that
    GPU refuses the first open: landing is then off (one line), and loads are copied.
    The rest (which loads land, waits, closes, failures) is :class:`CacheRegion`'s.

    Parameters
    ----------
    endpoint, timeout_ms, logger
        As :class:`CacheRegion`.
    export : callable
        (vLLM's layer tensors, a :class:`Client` of the daemon) -> their
        :class:`DeviceAllocation` (default :func:`auto_allocation`; tests give the
        emulated device's).
    """

    #: Progress words in the region (one per open session; a step opens at most this many).
    WORDS = 1024

    def __init__(
        self,
        endpoint: str,
        timeout_ms: int,
        logger: logging.Logger,
        export: Callable[[Sequence[torch.Tensor], Client], DeviceAllocation] = auto_allocation,
    ) -> None:
        super().__init__(endpoint, timeout_ms, 0, logger)
        self.export = export
        self.taken = True  # vLLM's own allocation: nothing to give back
        self.cache: DeviceCache | None = None
        self.words: np.ndarray | None = None
        self._free: list[int] = []
        self._word_of: dict[int, int] = {}  # id(session) -> its progress word

    def context(self) -> None:
        return None  # vLLM allocates on its device as usual

    def attach(
        self,
        layers: Sequence[torch.Tensor],
        model: Model,
        block_size: int,
        kind: str = INTERLEAVED,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Export the allocation holding vLLM's layers and describe them (or stay off)."""
        if not self.endpoint.startswith("ipc://"):
            self.off(f"the endpoint {self.endpoint} is not ipc:// (a local daemon maps "
                     "the GPU allocation)")
            return
        if kind != INTERLEAVED:
            self.off(f"vLLM's cache is in the {kind} layout, not a GPU backend's")
            return
        try:
            self.client = Client(self.endpoint, timeout_ms=self.timeout_ms)
            region = self.client.region(4 * self.WORDS)
        except KvblendError as e:
            self.off(f"no region for the landing sessions' progress words ({e})")
            return
        try:
            alloc = self.export(layers, self.client)
        except Exception as e:  # noqa: BLE001 - any failure to export: the copy path
            self.off(f"vLLM's KV-cache allocation cannot be exported ({e})")
            return
        cache = device_cache(layers, model, block_size, alloc.base, alloc.nbytes,
                             alloc.ipc_handle, alloc.pci)
        if cache is None:
            self.off("vLLM's cache layers are not in one allocation at one stride")
            return
        self.buf = region
        self.words = region[: 4 * self.WORDS].view(np.uint32)
        self._free = list(range(self.WORDS - 1, -1, -1))
        self.cache, self.block_size = cache, block_size
        if heads is not None and heads != (0, model.num_kv_heads):
            self.heads = heads
        self.active = True
        self.log.info(
            "kvblend: loads land in vLLM's KV cache on the GPU (%s) when kvblendd fuses on "
            "it (--device cuda)", alloc.pci,
        )

    def off(self, why: str) -> None:
        """Landing off for good (copy path), one line; the progress words go back."""
        super().off(why)
        if self.client is not None and self.buf is not None and not self._word_of:
            try:
                self.client.free_region(self.buf)
            except KvblendError:
                pass
            self.buf = self.words = None

    def _open_session(self, model_name: str, segs: list, pages: list[int]) -> LandingSession:
        if not self._free:
            raise BadArgument(-16, "every progress word is in use this step")
        w = self._free.pop()
        self.words[w] = 0
        try:
            s = self.client.fuse_open_into_device(
                model_name, segs, self.cache, self.words[w : w + 1], pages=pages,
                heads=self.heads,
            )
        except BaseException:
            self._free.append(w)
            raise
        self._word_of[id(s)] = w
        return s

    def _refused_for_good(self, e: BadArgument) -> bool:
        # no device, another GPU, a handle it cannot map, a layout it does not take:
        # every later open would be refused alike
        return "device memory" in str(e)

    def close_one(self, s: LandingSession, req_id: str) -> tuple[dict | None, bool]:
        w = self._word_of.pop(id(s), None)  # None within close_all, which took them first
        st, failed = super().close_one(s, req_id)
        if w is not None and st:  # as close_all: only a close that was answered
            self._free.append(w)
        return st, failed

    def close_all(self) -> dict[str, tuple[dict, float, bool]]:
        # every word of the step is taken first: a gone daemon's sessions are not closed
        words = [self._word_of.pop(id(s), None) for s, _ in self.sessions.values()]
        out = super().close_all()
        # a word goes back only when its session's close was answered: one whose close
        # failed (the daemon gone or not answering) may still be written, and keeps it
        for (st, _, _), w in zip(out.values(), words):
            if w is not None and st:
                self._free.append(w)
        return out
