"""The connector's connection to kvblendd, with a circuit breaker for a daemon that fails.

One per connector (each vLLM process has its own). The worker's registers the model the
first time it connects, so that chunks can be stored under its name.

The engine must not slow down because kvblendd is down or late: every call the connector
makes runs on vLLM's scheduler loop or in its forward pass. So after a failed call the
link *opens*: for a pause :meth:`DaemonLink.client` fails at once, without a call. The
pause depends on the cause (:class:`DaemonLink` gives the rule): a dead daemon backs off
from 1 s up to :data:`BACKOFF_MAX_S` (5 s); a late answer from a live one pauses kvblend
for :data:`BACKOFF_FIRST_S` (1 s). A timeout does not say which by itself (ZeroMQ waits
for a peer that is not there as for one that is late): a plain socket connect to the
endpoint (:func:`probe`) does. During an outage a request pays nothing: the retry after
a pause is that probe, which a daemon that is gone refuses at once. One log line, naming
the cause, when the link opens; one when it closes again.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Any

from ..client import Client
from ..errors import KvblendError, Unavailable
from ..types import Model

#: Pause after the first failure, and the ceiling a dead daemon's doubling pause stops at
#: (seconds): a daemon that comes back is used again within this long.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 5.0
#: Late answers in a row from a live daemon that pause kvblend for BACKOFF_FIRST_S each;
#: from the next one on, the pause doubles as a dead daemon's does.
LATE_ANSWERS = 3
#: Longest the probe's socket connect may take (seconds).
PROBE_MAX_S = 1.0
#: Per-call timeout of the calls that close a connection after the daemon failed.
CLOSE_TIMEOUT_MS = 100


class DaemonDown(Unavailable):
    """The link is open (the daemon failed recently): no call was made.

    ``code`` is ``-ECONNREFUSED`` while the daemon is taken for dead, ``-ETIMEDOUT`` during
    the pause after a late answer.
    """

    def __init__(self, msg: str, code: int = -errno.ECONNREFUSED) -> None:
        super().__init__(code, msg)


def _connect(endpoint: str, timeout_s: float) -> OSError | None:
    """Connect a plain socket to a ZeroMQ endpoint and close it; None, or the error."""
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
        return e
    finally:
        s.close()
    return None


def probe(endpoint: str, timeout_s: float) -> str | None:
    """Try a plain socket connect to a ZeroMQ endpoint; None if it connects, else why not.

    ``ipc://PATH`` connects a Unix socket (a daemon that is gone refuses at once, its
    socket file removed or stale), ``tcp://HOST:PORT`` a TCP socket within ``timeout_s``.
    Other transports are not probed (None). The connection is closed at once; kvblendd
    sees a peer that went away before its greeting.
    """
    e = _connect(endpoint, timeout_s)
    return None if e is None else e.strerror or type(e).__name__


def _dead(e: OSError, timeout_s: float) -> str:
    """Say what a failed probe tells of the daemon (for the log: ``daemon at X <this>``)."""
    if e.errno == errno.ECONNREFUSED:
        return "refused the connection"
    if e.errno == errno.ENOENT:
        return "has no socket file"
    if isinstance(e, TimeoutError):
        return f"accepted no connection within {timeout_s:g} s"
    return f"cannot be reached: {e.strerror or type(e).__name__}"


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
        Where the open and close lines go.

    One thread uses a link (the scheduler's, the worker's, the worker's miss thread each
    have their own).

    A failed call (:meth:`failed`) opens the link for a pause that depends on its cause:

    - **The daemon is dead**: the call failed other than by a timeout (refused, its
      connection lost, an error), or timed out and the endpoint then refuses a plain
      connect (:func:`probe`: refused, no socket file). The pause is
      :data:`BACKOFF_FIRST_S` (1 s), doubling with each failure until the daemon answers,
      up to :data:`BACKOFF_MAX_S` (5 s).
    - **The answer was late**: the call timed out and the endpoint accepts a connect (a
      live daemon, busy). The pause is :data:`BACKOFF_FIRST_S` only, for up to
      :data:`LATE_ANSWERS` (3) late answers in a row: a slow answer, or a short spell of
      them, never keeps kvblend off for longer than a second at a time. From the next in
      a row on, the pause doubles as a dead daemon's, up to the same 5 s: each try of a
      daemon that stays late costs its caller a whole deadline (of the scheduler loop or
      of a forward pass).

    When a pause is over, the next call probes the endpoint first: refused, the link stays
    open for the next pause (a dead daemon costs nothing); connected, the call is made. An
    answer (:meth:`ok`) closes the link and forgets the back-off. The line when the link
    opens names the cause and the call's error (``kvblend: daemon at ... refused the
    connection (no reply ... [ETIMEDOUT]): ...``, ``... timed out but accepts connections
    (...)``, ``... failed (...)``); one line when it closes again.
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
        self._pause = 0.0  # the last pause of this outage (0: none yet)
        self._late = 0  # late answers in a row from a live daemon
        self._code = -errno.ECONNREFUSED  # DaemonDown's during this pause
        self._why = ""
        self._last_error: BaseException | str | None = None

    @property
    def is_open(self) -> bool:
        """Whether the daemon failed and has not answered since (calls fail at once)."""
        return self._down_since is not None

    @property
    def retry_in(self) -> float:
        """Seconds left of the open link's pause (0.0: closed, or the next call tries)."""
        if self._down_since is None:
            return 0.0
        return max(0.0, self._retry_at - time.monotonic())

    def client(self) -> Client:
        """Return the connection, connecting (and registering the model) if needed.

        Raises
        ------
        DaemonDown
            The link is open and its pause has not run out, or the probe failed.
        KvblendError
            The daemon cannot be reached, or refuses the model (the link opens).
        """
        if self._down_since is not None:
            left = self.retry_in
            if left > 0:
                raise DaemonDown(f"kvblend paused: kvblendd {self._why}; retry in "
                                 f"{left:.1f} s", self._code)
            err = _connect(self.endpoint, self._probe_s)
            if err is not None:
                why = _dead(err, self._probe_s)
                self._open(why, dead=True)
                raise DaemonDown(f"kvblendd {why}")
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
        self._pause = 0.0
        self._late = 0

    def failed(self, error: BaseException | str) -> None:
        """Record a failed call: close the connection and open the link for a pause.

        The connection may be half-way through a request. The pause is the one the
        failure's cause earns (see the class); the first failure of an outage logs one
        line naming the cause. A timeout (:class:`TimeoutError`, as
        :class:`kvblend.errors.Timeout` is) is told apart by a :func:`probe` of the
        endpoint, bounded by ``min(timeout_ms, 1 s)``; anything else (an error, or a text)
        is taken for a dead daemon.
        """
        self.drop(fast=True)
        if isinstance(error, DaemonDown) or error is self._last_error:
            return
        self._last_error = error
        dead, why = self._cause(error)
        opens = self._down_since is None
        pause = self._open(why, dead)
        if not opens:
            return
        self.log.warning(
            "kvblend: daemon at %s %s: requests are served without kvblend; next try in "
            "%.0f s%s",
            self.endpoint,
            why,
            pause,
            f", backing off up to {BACKOFF_MAX_S:.0f} s while it fails" if dead else "",
        )

    @property
    def _probe_s(self) -> float:
        return min(self.timeout_ms / 1000, PROBE_MAX_S)

    def _cause(self, error: BaseException | str) -> tuple[bool, str]:
        """Whether ``error`` says the daemon is dead, and the cause for the log."""
        what = str(error) or type(error).__name__
        if isinstance(error, TimeoutError):
            err = _connect(self.endpoint, self._probe_s)
            if err is None:
                return False, f"timed out but accepts connections ({what})"
            return True, f"{_dead(err, self._probe_s)} ({what})"
        if isinstance(error, KvblendError) and error.code == -errno.ECONNREFUSED:
            return True, f"refused the connection ({what})"
        return True, f"failed ({what})"

    def _open(self, why: str, dead: bool) -> float:
        """Open the link, or keep it open, for the pause this failure earns; return it."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        self._late = 0 if dead else self._late + 1
        if not dead and self._late <= LATE_ANSWERS:
            pause = BACKOFF_FIRST_S
        else:
            pause = min(max(2 * self._pause, BACKOFF_FIRST_S), BACKOFF_MAX_S)
        self._pause = pause
        self._why = why
        self._code = -errno.ECONNREFUSED if dead else -errno.ETIMEDOUT
        self._retry_at = now + pause
        return pause

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
