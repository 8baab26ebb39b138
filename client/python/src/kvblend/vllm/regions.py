"""The shared-memory regions the blend pass lands prompts into, kept between blends.

A blend of :mod:`kvblend.vllm.blend` lands each prompt's context into a region of the
daemon's (:meth:`kvblend.Client.region`); :func:`regions_of` gives the client's
:class:`RegionPool`, which keeps the regions a blend gave back for the next blends.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from ..client import Client
from ..errors import KvblendError, Unavailable

#: Regions a client keeps between blends (:class:`RegionPool`): at most this many, each
#: for at most this long unused (well under the daemon's ``shm_idle``, 600 s by default,
#: after which it would release them itself), rounded up to this size.
POOL_REGIONS = 4
POOL_IDLE_S = 30.0
POOL_ROUND = 4 << 20


class RegionPool:
    """Shared-memory regions of one client, kept between blends for the next ones.

    A blend lands its context into a region (:meth:`kvblend.Client.region`). A fresh
    region's pages are mapped and zeroed on first touch, by the daemon landing into it and
    by the pass writing its rows: at 1K tokens of SmolLM2 (45 MB) that was 22-24 ms here,
    and its free 3-5 ms more, on every blend. A region given back is kept (at most
    :data:`POOL_REGIONS`, each at most :data:`POOL_IDLE_S` unused) and handed to the next
    blend it is large enough for, its pages already in place (a timer frees the ones
    unused that long while no blend comes). It is not zeroed again: a
    blend writes every row of every layer of its buffer before reading it (the daemon the
    stored rows, the pass its own). The regions die with the client (its close frees
    them), so one pool per client (:func:`regions_of`). A batch that fails frees the
    kept regions too (:mod:`kvblend.vllm.blend`): a daemon restarted, or one whose
    ``shm_idle`` is under :data:`POOL_IDLE_S`, no longer knows a kept region, which fails
    that batch once (the worker retries its requests one at a time on fresh regions;
    under tensor parallelism vLLM recomputes them).
    """

    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        self._idle: list[tuple[float, np.ndarray]] = []  # (given back at, region)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None  # expires kept regions while idle

    def take(self, nbytes: int) -> np.ndarray:
        """A region of at least ``nbytes``: the smallest kept one that fits, else a new one
        (rounded up to :data:`POOL_ROUND`); a refused size first frees the kept ones."""
        client = self._client()
        with self._lock:
            self._expire(client)
            fits = [i for i, (_, r) in enumerate(self._idle) if r.nbytes >= nbytes]
            if fits:
                i = min(fits, key=lambda j: self._idle[j][1].nbytes)
                return self._idle.pop(i)[1]
            size = -(-nbytes // POOL_ROUND) * POOL_ROUND
            try:
                return client.region(size)
            except Unavailable:
                raise
            except KvblendError:
                if not self._idle and size == nbytes:
                    raise
            # the daemon's shm budget: what is kept goes first, then the exact size (the
            # rounding may pass shm_max where the size itself fits)
            self._clear(client)
            return client.region(nbytes)

    def give(self, region: np.ndarray) -> None:
        """Keep a region a blend is done with (the oldest kept one freed past the limit)."""
        client = self._client()
        with self._lock:
            self._idle.append((time.monotonic(), region))
            while len(self._idle) > POOL_REGIONS:
                self._free(client, self._idle.pop(0)[1])
            self._expire(client)

    def _arm(self) -> None:
        """(The lock held.) A timer for the oldest kept region's expiry, none when none is
        kept: an engine left idle frees them too, with no blend to look."""
        if not self._idle:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is None:
            due = self._idle[0][0] + POOL_IDLE_S - time.monotonic()
            self._timer = threading.Timer(max(due, 0.0) + 0.05, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self) -> None:
        client = self._client()
        with self._lock:
            self._timer = None
            self._expire(client)

    def clear(self) -> None:
        """Free every kept region."""
        client = self._client()
        with self._lock:
            self._clear(client)

    def _clear(self, client: Client | None) -> None:
        while self._idle:
            self._free(client, self._idle.pop()[1])
        self._arm()

    def kept(self) -> int:
        """How many regions are kept."""
        return len(self._idle)

    def _expire(self, client: Client | None) -> None:
        """(The lock held.) Free the kept regions past :data:`POOL_IDLE_S`; arm the timer."""
        now = time.monotonic()
        while self._idle and now - self._idle[0][0] > POOL_IDLE_S:
            self._free(client, self._idle.pop(0)[1])
        self._arm()

    @staticmethod
    def _free(client: Client | None, region: np.ndarray) -> None:
        if client is None:
            return  # closed: its regions went with it
        try:
            client.free_region(region)
        except KvblendError:
            pass  # (the daemon's idle release, or gone: nothing left to free)


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def regions_of(client: Client) -> RegionPool:
    """The client's :class:`RegionPool` (made on first use; gone with the client)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(client)
        if pool is None:
            pool = _POOLS[client] = RegionPool(client)
        return pool

