"""The connector's figures in vLLM's KV-connector stats (``get_kv_connector_stats``).

Per request, the response's ``kv_transfer_params`` say where its prompt's KV came from
(:meth:`kvblend.vllm.scheduler.SchedulerSide.request_finished`); these are the same
figures summed over the requests that finished in an interval, which vLLM aggregates and
logs (``KV Transfer metrics: ...``) and hands to its stat loggers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: The counters, all tokens but ``requests``: prompt tokens of the finished requests;
#: exact prefix hits of vLLM's own cache; loaded as stored (re-rotated); the context of
#: CacheBlend loads; computed by vLLM; declined loads (computed, loading would lose);
#: recomputed after a load failed in the worker; stored.
FIELDS = (
    "requests",
    "prompt_tokens",
    "prefix_cached",
    "reused",
    "blended",
    "computed",
    "load_declined",
    "recomputed_after_failure",
    "stored",
)


def _zeros() -> dict[str, Any]:
    return {k: 0 for k in FIELDS}


@dataclass
class KvblendStats(KVConnectorStats):
    """Sums of :data:`FIELDS` over an interval."""

    data: dict[str, Any] = field(default_factory=_zeros)

    def reset(self) -> None:
        self.data = _zeros()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """This interval's sums and another's (another worker's, or the next step's)."""
        for k, v in (other.data or {}).items():
            if k in FIELDS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in FIELDS)
