"""The connector's connection to kvblendd, with a circuit breaker for a daemon that is down.

One per connector (each vLLM process has its own). The worker's registers the model the
first time it connects, so that chunks can be stored under its name.

The engine must not slow down because kvblendd is down: every call the connector makes
runs on vLLM's scheduler loop or in its forward pass. So after a failed call the link
*opens*: for a back-off (1 s, doubling up to 30 s) :meth:`DaemonLink.client` fails at
once, without a call; after it, one probe (a plain socket connect to the endpoint,
bounded by ``min(timeout_ms, 1 s)``) decides whether a real connection is tried. A
stopped daemon refuses the connect at once, so during an outage a request pays nothing;
only a daemon that accepts but does not answer costs one ``timeout_ms`` per back-off.
One log line when the link opens, one when it closes again.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from ..client import Client
from ..errors import KvblendError, Unavailable
from ..types import Model

#: Back-off after the first failure, and its ceiling (seconds).
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
#: Longest the probe's socket connect may take (seconds).
PROBE_MAX_S = 1.0
#: Per-call timeout of the calls that close a connection after the daemon failed.
CLOSE_TIMEOUT_MS = 100


class DaemonDown(Unavailable):
    """The link is open (the daemon failed recently): no call was made."""

    def __init__(self, msg: str) -> None:
        super().__init__(-111, msg)


def probe(endpoint: str, timeout_s: float) -> str | None:
    """Try a plain socket connect to a ZeroMQ endpoint; None if it connects, else why not.

    ``ipc://PATH`` connects a Unix socket (a daemon that is gone refuses at once, its
    socket file removed or stale), ``tcp://HOST:PORT`` a TCP socket within ``timeout_s``.
    Other transports are not probed (None). The connection is closed at once; kvblendd
    sees a peer that went away before its greeting.
    """
    if endpoint.startswith("ipc://"):
        path, family = endpoint[len("ipc://") :], socket.AF_UNIX
        if path.startswith("@"):
            path = "\0" + path[1:]  # an abstract socket
        addr: object = path
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        if host in ("*", ""):
            host = "127.0.0.1"
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            addr = (host, int(port))
        except ValueError:
            return None
    else:
        return None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        s.connect(addr)
    except OSError as e:
        return e.strerror or type(e).__name__
    finally:
        s.close()
    return None


class DaemonLink:
    """A lazily made :class:`kvblend.Client` behind a circuit breaker.

    Parameters
    ----------
    endpoint, timeout_ms
        The daemon and the per-call deadline.
    model : Model, optional
        Registered on each new connection (the worker side); None: never (the scheduler
        side only looks chunks up).
    logger : logging.Logger, optional
        Where the open and close lines go (``kvblend: daemon ... unreachable``).

    One thread uses a link (the scheduler's, the worker's, the worker's miss thread each
    have their own).
    """

    def __init__(
        self,
        endpoint: str,
        timeout_ms: int,
        model: Model | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.model = model
        self.log = logger or logging.getLogger("kvblend.vllm")
        self._client: Client | None = None
        self._registered = False
        self._down_since: float | None = None  # the link is open since then
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._why = ""
        self._last_error: BaseException | str | None = None

    @property
    def is_open(self) -> bool:
        """Whether the daemon failed and has not answered since (calls fail at once)."""
        return self._down_since is not None

    def client(self) -> Client:
        """Return the connection, connecting (and registering the model) if needed.

        Raises
        ------
        DaemonDown
            The link is open and its back-off has not run out, or the probe failed.
        KvblendError
            The daemon cannot be reached, or refuses the model (the link opens).
        """
        if self._down_since is not None:
            now = time.monotonic()
            if now < self._retry_at:
                raise DaemonDown(f"kvblendd unreachable ({self._why}); retry in "
                                 f"{self._retry_at - now:.1f} s")
            why = probe(self.endpoint, min(self.timeout_ms / 1000, PROBE_MAX_S))
            if why is not None:
                self._reopen(why)
                raise DaemonDown(f"kvblendd unreachable ({why})")
        try:
            if self._client is None:
                self._client = Client(self.endpoint, timeout_ms=self.timeout_ms)
                self._registered = False
            if not self._registered and self.model is not None:
                self._client.model_register(self.model)
                self._registered = True
        except KvblendError as e:
            self.failed(e)
            raise
        return self._client

    def ok(self) -> None:
        """Record a call that succeeded: an open link closes (one log line)."""
        if self._down_since is None:
            return
        self.log.warning(
            "kvblend: daemon at %s answers again after %.1f s: kvblend on",
            self.endpoint,
            time.monotonic() - self._down_since,
        )
        self._down_since = None
        self._backoff = BACKOFF_FIRST_S

    def failed(self, error: BaseException | str) -> None:
        """Record a failed call: close the connection (it may be half-way through a
        request) and open the link; the first failure of an outage logs one line."""
        self.drop(fast=True)
        if isinstance(error, DaemonDown) or error is self._last_error:
            return
        self._last_error = error
        why = str(error) or type(error).__name__
        if self._down_since is not None:
            self._reopen(why)
            return
        self._down_since = time.monotonic()
        self._backoff = BACKOFF_FIRST_S
        self._why = why
        self._retry_at = self._down_since + self._backoff
        self.log.warning(
            "kvblend: daemon at %s unreachable (%s): requests are served without kvblend, "
            "retrying after %.0f s and backing off up to %.0f s",
            self.endpoint,
            why,
            self._backoff,
            BACKOFF_MAX_S,
        )

    def _reopen(self, why: str) -> None:
        """A retry failed: wait twice as long before the next (at most BACKOFF_MAX_S)."""
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        self._why = why
        self._retry_at = time.monotonic() + self._backoff

    def drop(self, fast: bool = False) -> None:
        """Close the connection without opening the link (the next call reconnects).

        ``fast``: the daemon failed, so the close's own calls (open sessions, regions)
        wait at most :data:`CLOSE_TIMEOUT_MS` each, not ``timeout_ms``.
        """
        if self._client is not None:
            try:
                if fast:
                    self._client.set_timeout(CLOSE_TIMEOUT_MS)
                self._client.close()
            except KvblendError:
                pass
        self._client = None


#: How often a landing wait looks whether the daemon is still there (seconds).
WAIT_SLICE_S = 0.25


def wait_layer(sess: Any, layer: int, timeout_s: float, endpoint: str) -> None:
    """``sess.wait(layer)`` for at most ``timeout_s``, ending early when the daemon is gone.

    The wait runs in slices of :data:`WAIT_SLICE_S`; between two, a :func:`probe` of the
    endpoint: a daemon that was killed refuses it, and the wait ends at once instead of
    after ``timeout_s``.

    Raises
    ------
    TimeoutError
        The layer did not land within ``timeout_s``.
    Unavailable
        The daemon is gone (the probe failed).
    KvblendError
        The daemon stopped landing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            sess.wait(layer, max(0.0, min(WAIT_SLICE_S, left)))
            return
        except TimeoutError:
            if left <= WAIT_SLICE_S:
                raise
        why = probe(endpoint, PROBE_MAX_S)
        if why is not None:
            raise Unavailable(-111, f"kvblendd gone while landing layer {layer} ({why})")
