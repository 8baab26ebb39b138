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

Anything that does not hold (a ``tcp://`` endpoint, shared memory refused or too small, an
allocation of another shape, a layout that is not one allocation with a uniform stride
between layers, a daemon that lost the region) leaves the connector on its copy path; one
log line says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..client import Client
from ..errors import BadShm, KvblendError, NotFound, Unavailable, UnknownSession
from ..sessions import LandingSession
from ..types import Model
from .daemon import wait_layer
from .layout import CPU_VEC, region_views
from .plan import ChunkLoad


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
        """Open a landing session for a load; False when this load takes the copy path.

        Only a load whose chunks lie back to back from position 0, each from its first
        token, lands (the session's token t is prompt position t, in block
        ``blocks[t // block_size]``); the tokens of its last chunk past the claim are
        written too and then computed over by vLLM in the layer's forward, which runs
        only after the layer has landed.
        """
        if not self.active or not chunks:
            return False
        pos = 0
        for c in chunks:
            if c.start != pos or c.first != c.start:
                return False
            pos += c.length
        need = -(-pos // self.block_size)
        if need > len(blocks):
            return False
        assert self.client is not None
        t0 = time.monotonic()
        try:
            s = self.client.fuse_open_into(
                model_name,
                [(c.hash, c.start) for c in chunks],
                self.k,
                self.v,
                pages=blocks[:need],
                heads=self.heads,
            )
        except BadShm as e:
            self.off(f"the daemon no longer knows the region ({e}): restarted or shm_idle")
            return False
        except (NotFound, UnknownSession):
            return False
        except Unavailable:
            raise  # the daemon is down: the load fails (a copy would wait as long again)
        except KvblendError as e:
            if e.name in ("ENOTSUP", "EOPNOTSUPP"):  # a kvblendd older than K strides
                self.off(f"the daemon cannot land vLLM's transposed K ({e})")
            else:
                self.log.warning("kvblend: landing session for %s refused (%s): copying", req_id, e)
            return False
        self.sessions[req_id] = (s, [time.monotonic() - t0])
        return True

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
                try:
                    st = s.close()
                    held[0] += time.monotonic() - t0
                except Unavailable as e:
                    # not answering (it may be stopped, not dead): the close stays queued
                    # for it; the next sessions' closes would wait as long each
                    failed, self.gone = True, True
                    self.log.warning("kvblend: closing the landing session of %s: %s", rid, e)
                except KvblendError as e:
                    failed = True
                    self.log.warning("kvblend: closing the landing session of %s: %s", rid, e)
            out[rid] = (st, held[0], failed or bool(st.get("land_failed")))
        self.sessions = {}
        self.failed = set()
        self.gone = self.stalled = False
        return out
