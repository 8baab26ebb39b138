"""What the connector's scheduler half hands its worker half each step (vLLM's metadata).

vLLM carries a :class:`KvblendMetadata` from the scheduler process to the workers with
every step: the loads to write into requests' blocks before the forward pass, and the
stores to gather from them after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .plan import BlendLoad, ChunkLoad


@dataclass
class LoadSpec:
    """One request's chunks to write into its blocks this step."""

    req_id: str
    chunks: list[ChunkLoad]
    block_ids: list[int]
    block_size: int
    blend: BlendLoad | None = None  # a CacheBlend load instead of the chunks
    #: an asynchronous load (``load_kv_async``): landed between steps and reported done in
    #: ``get_finished``; the request is not scheduled before
    early: bool = False
    #: an asynchronous claim vLLM took other than it was made (why): the worker fails it at
    #: once, its blocks from the claim's first on invalid, so that vLLM recomputes them
    #: and the request does not wait for a load that never starts
    fail: str | None = None


@dataclass
class StoreSpec:
    """One request whose prompt (one chunk) is stored once this step has prefilled it."""

    req_id: str
    hash: bytes
    length: int
    block_ids: list[int]
    block_size: int


@dataclass
class MissSpec:
    """A chunk a request missed, to prefill alone from position 0 and store (a miss)."""

    hash: bytes
    ids: list[int]


@dataclass
class KvblendMetadata(KVConnectorMetadata):
    """What the worker does in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    misses: list[MissSpec] = field(default_factory=list)
    #: tokens the step computes, all requests together (the prefill rate's measure)
    scheduled_tokens: int = 0


@dataclass
class KvblendWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker measured in one step, for the scheduler's cost model.

    ``samples`` are ``(kind, tokens, seconds)`` (:mod:`kvblend.vllm.cost`): each load's
    time on the engine, and the step's forward pass when it loaded nothing.
    """

    samples: list[tuple[str, int, float]] = field(default_factory=list)
    #: tokens of loads that failed this step (vLLM recomputes them)
    failed_tokens: int = 0
    #: why kvblend is off for good on this engine, sent once when the worker turns it off
    #: (a model-name clash or a failed RoPE self-test found after the start): the
    #: scheduler claims nothing from then on
    off: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """All workers' samples of the step together.

        Tensor-parallel ranks load the same requests (each its heads): only rank 0 sends
        samples, and the failed tokens are the most any rank failed, not their sum. One
        rank off turns kvblend off.
        """
        assert isinstance(other, KvblendWorkerMeta)
        return KvblendWorkerMeta(
            self.samples + other.samples, max(self.failed_tokens, other.failed_tokens),
            self.off or other.off,
        )
