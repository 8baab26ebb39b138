"""The connector's connection to kvblendd, made when first needed and again after an error.

One per connector (each vLLM process has its own). The worker's registers the model the
first time it connects, so that chunks can be stored under its name.
"""

from __future__ import annotations

from ..client import Client
from ..errors import KvblendError
from ..types import Model


class DaemonLink:
    """A lazily made :class:`kvblend.Client`; :meth:`drop` after an error starts afresh.

    Parameters
    ----------
    endpoint, timeout_ms
        The daemon and the per-call deadline.
    model : Model, optional
        Registered on each new connection (the worker side); None: never (the scheduler
        side only looks chunks up).
    """

    def __init__(self, endpoint: str, timeout_ms: int, model: Model | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.model = model
        self._client: Client | None = None
        self._registered = False

    def client(self) -> Client:
        """Return the connection, connecting (and registering the model) if needed.

        Raises
        ------
        KvblendError
            The daemon cannot be reached, or refuses the model.
        """
        if self._client is None:
            self._client = Client(self.endpoint, timeout_ms=self.timeout_ms)
            self._registered = False
        if not self._registered and self.model is not None:
            self._client.model_register(self.model)
            self._registered = True
        return self._client

    def drop(self) -> None:
        """Close the connection: after an error it may be half-way through a request."""
        if self._client is not None:
            try:
                self._client.close()
            except KvblendError:
                pass
        self._client = None
