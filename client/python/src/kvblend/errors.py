"""Exceptions: one class per error kvblendd or libkvblend can report.

Every call that fails raises a :class:`KvblendError` (or a subclass) carrying the
code libkvblend returned (``code``: a ``KVB_E_*`` value below -1000, or a negative
errno for a local failure), its name (``name``: the wire code in lower case such
as ``'not_found'``, or the errno name such as ``'ETIMEDOUT'``) and the message of
``kvb_last_error()`` (``message``), which for daemon errors is the daemon's own.
"""

from __future__ import annotations

import errno as _errno

# enum kvb_error (kvblend.h) = -(1000 + wire code of proto/kvblend.proto).
WIRE_CODES = {
    -1001: "bad_request",
    -1002: "bad_version",
    -1003: "unknown_op",
    -1004: "bad_shape",
    -1005: "unknown_model",
    -1006: "dtype_mismatch",
    -1007: "bad_frames",
    -1008: "too_large",
    -1009: "model_conflict",
    -1010: "not_found",
    -1011: "corrupt",
    -1012: "full",
    -1013: "limit",
    -1014: "internal",
    -1015: "bad_argument",
    -1016: "bad_shm",
    -1017: "unknown_session",
    -1018: "busy",
    -1100: "protocol",
}


class KvblendError(Exception):
    """A failed kvblend call.

    Attributes
    ----------
    code : int
        The negative code libkvblend returned (``KVB_E_*`` or ``-errno``).
    name : str
        ``'not_found'``, ``'limit'``, ... for daemon codes; ``'EINVAL'``, ... for errno.
    message : str
        What went wrong, from ``kvb_last_error()`` (the daemon's message when it replied).
    """

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        self.name = code_name(code)
        self.message = message or self.name
        super().__init__(f"{self.message} [{self.name}]")


class ProtocolError(KvblendError):
    """The request or reply did not fit the protocol (bad_request, bad_version, ...)."""


class BadShape(KvblendError, ValueError):
    """Sizes or dimensions wrong, zero, too big or overflowing (bad_shape)."""


class DtypeMismatch(KvblendError, ValueError):
    """The payload's dtype differs from the model's (dtype_mismatch)."""


class BadArgument(KvblendError, ValueError):
    """A field is missing or out of range (bad_argument), or a local ``-EINVAL``."""


class BufferSize(KvblendError, ValueError):
    """An output buffer does not match the size of the data (``-ENOBUFS``)."""


class TooLarge(KvblendError, ValueError):
    """The message is above the daemon's max_message (too_large)."""


class ModelConflict(KvblendError):
    """The model name is taken by a different layout (model_conflict)."""


class UnknownModel(KvblendError, LookupError):
    """No model of that name (unknown_model)."""


class NotFound(KvblendError, LookupError):
    """No such chunk (not_found); for fuse_open, ``missing`` lists the absent hashes."""

    missing: list[bytes]

    def __init__(self, code: int, message: str = "", missing: list[bytes] | None = None):
        super().__init__(code, message)
        self.missing = list(missing or [])


class Corrupt(NotFound):
    """The stored chunk failed its checksum and was removed: treat it as a miss (corrupt)."""


class Full(KvblendError):
    """The store is full (full)."""


class Limit(KvblendError):
    """A resource limit of the daemon was reached (limit)."""


class Internal(KvblendError):
    """A daemon-side failure (internal)."""


class BadShm(KvblendError):
    """Shared-memory reference unknown, expired or out of range (bad_shm)."""


class UnknownSession(KvblendError, LookupError):
    """No open fuse session of that id: closed or expired (unknown_session)."""


class Busy(KvblendError):
    """The chunk is in use by an open fuse session (busy)."""


class Unavailable(KvblendError, ConnectionError):
    """The daemon cannot be reached: socket error (``-EIO`` and other errno codes)."""


class Timeout(Unavailable, TimeoutError):
    """No reply within the client's timeout (``-ETIMEDOUT``)."""


_BY_CODE: dict[int, type[KvblendError]] = {
    -1001: ProtocolError,
    -1002: ProtocolError,
    -1003: ProtocolError,
    -1004: BadShape,
    -1005: UnknownModel,
    -1006: DtypeMismatch,
    -1007: ProtocolError,
    -1008: TooLarge,
    -1009: ModelConflict,
    -1010: NotFound,
    -1011: Corrupt,
    -1012: Full,
    -1013: Limit,
    -1014: Internal,
    -1015: BadArgument,
    -1016: BadShm,
    -1017: UnknownSession,
    -1018: Busy,
    -1100: ProtocolError,
    -_errno.EINVAL: BadArgument,
    -_errno.ENOBUFS: BufferSize,
    -_errno.ETIMEDOUT: Timeout,
    -_errno.EIO: Unavailable,
    -_errno.ECONNREFUSED: Unavailable,
    -_errno.ENOTSUP: KvblendError,
}


def code_name(code: int) -> str:
    """Name of a libkvblend return code: the wire code name, or the errno name."""
    if code in WIRE_CODES:
        return WIRE_CODES[code]
    if code < 0 and -code in _errno.errorcode:
        return _errno.errorcode[-code]
    return str(code)


def error_for(code: int, message: str = "", **kwargs: object) -> KvblendError:
    """Return the exception for ``code``, of the most specific class."""
    cls = _BY_CODE.get(code, KvblendError)
    if kwargs and issubclass(cls, NotFound):
        return cls(code, message, **kwargs)  # type: ignore[arg-type]
    return cls(code, message)
