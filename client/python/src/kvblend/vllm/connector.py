"""KvblendConnector: vLLM's v1 KV connector interface, delegated to its two halves.

vLLM makes one connector per process, for one role: in the scheduler process its
scheduler-side calls go to :class:`~kvblend.vllm.scheduler.SchedulerSide`, in each worker
its worker-side calls go to :class:`~kvblend.vllm.worker.WorkerSide`. This class only
checks the engine at start (:func:`kvblend.vllm.config.connector_config`), builds the
half and passes vLLM's calls (and the step's metadata) on. Imports torch and vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .config import check_version, connector_config, device_landing_wanted, logger
from .daemon import DaemonLink
from .metadata import KvblendMetadata
from .scheduler import SchedulerSide
from .stats import KvblendStats
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvblendConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvblendd (see :mod:`kvblend.vllm`)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = connector_config(vllm_config)
        self.config = cfg
        # only the worker stores, so only its connection registers the model; the
        # scheduler's only looks chunks up, on vLLM's scheduling loop, under its own
        # shorter deadline (a slow daemon must not hold every request up)
        worker = role == KVConnectorRole.WORKER
        daemon = DaemonLink(
            cfg.endpoint,
            cfg.timeout_ms if worker else cfg.lookup_timeout_ms,
            cfg.model if worker else None,
            logger,
        )
        self.scheduler = SchedulerSide(cfg, daemon, kv_cache_config)
        self.worker = WorkerSide(cfg, daemon, vllm_config, kv_cache_config)
        logger.info(
            "kvblend: connector (%s) on %s, model %r", role.name, cfg.endpoint, cfg.model_name
        )
        if role == KVConnectorRole.SCHEDULER and self._exports_fd(vllm_config.kv_transfer_config):
            cache = vllm_config.cache_config
            if getattr(cache, "gpu_memory_utilization", 0.0) is None:
                # vLLM 0.34's growable cache takes all the memory it measures free after
                # warm-up (1.0 by default); the daemon's device buffers come later
                logger.warning(
                    "kvblend: loads land through kvblendd's CUDA device (KVCacheAccess."
                    "EXPORTS_FD): set gpu_memory_utilization (0.9, say) to leave kvblendd's "
                    "device buffers room; unset, vLLM's growable cache takes the whole GPU"
                )

    def _meta(self) -> KvblendMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvblendMetadata)
        return meta

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens from ``num_computed_tokens`` on that stored chunks provide."""
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the request's blocks and claim; note a request that stores."""
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Return this step's loads and completed stores; loaded blocks are not zeroed."""
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        """Forget the request; its blocks are vLLM's to free at once."""
        return self.scheduler.request_finished(request, block_ids)

    # ---- worker side ----

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's metadata (before its forward pass)."""
        super().bind_connector_metadata(connector_metadata)
        self.worker.step_begin(
            connector_metadata if isinstance(connector_metadata, KvblendMetadata) else None
        )

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata (after its forward pass and saves)."""
        self.worker.step_end()
        super().clear_connector_metadata()

    def get_mem_pool_context(self) -> Any:
        """Place vLLM's one KV-cache allocation in a kvblend region (ipc:// daemons)."""
        return self.worker.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep K and V views of each layer's cache (CPU "vec" layout); register the model."""
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Land (or write) each claimed chunk, re-rotated to its position, in its blocks."""
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until this step's landing sessions have the layer in vLLM's cache."""
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Gather this layer's K and V of each storing request's chunk into host memory."""
        self.worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        """Close this step's landing sessions; PUT each chunk gathered this step."""
        self.worker.wait_for_save(self._meta())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Return this step's load and prefill times, for the scheduler's cost model."""
        return self.worker.build_worker_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the workers' load and prefill times (:mod:`kvblend.vllm.cost`)."""
        self.scheduler.update_connector_output(connector_output)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Return where the finished requests' KV came from (scheduler role).

        The workers' part, loads that failed, reaches the scheduler with the step's output.
        """
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        data = self.scheduler.take_stats()
        return None if data is None else KvblendStats(data=data)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33's hook: vLLM then refuses ``enable_sleep_mode`` at start).

        The daemon writes into vLLM's KV cache through the region (or handle) it was given
        when the cache was allocated; sleep mode frees that memory and maps new memory at
        wake-up, which landing sessions would still write into the old.
        """
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """How kvblend's workers reach the device KV cache (vLLM 0.34's hook).

        ``KVCacheAccess.EXPORTS_FD`` when loads land through a local kvblendd's CUDA
        device: the worker exports the growable cache's allocations as POSIX fds
        (:func:`kvblend.vllm.landing.vmm_allocation`), which vLLM makes exportable only
        when told so. That is an ``ipc://`` endpoint on a CUDA platform, with
        ``kv_connector_extra_config["device_landing"]`` "auto" (the default); "off" keeps
        every load on the copy path. Else ``IN_PROCESS`` (copies, any allocation). vLLM
        then refuses to start without its growable cache (``enable_extensible_kv_cache``
        false, ``num_gpu_blocks_override`` or ``kv_cache_memory_bytes`` set): set
        "device_landing": "off" for those. 0.32 and 0.33 never call it.

        Raises
        ------
        ValueError
            ``device_landing`` is neither "auto" nor "off" (the message names the key).
        """
        from vllm.config.kv_transfer import KVCacheAccess

        if cls._exports_fd(kv_transfer_config):
            return KVCacheAccess.EXPORTS_FD
        return KVCacheAccess.IN_PROCESS

    @staticmethod
    def _exports_fd(kv_transfer_config: Any) -> bool:
        """Whether the workers export the device cache by fd (:meth:`kv_cache_access`)."""
        from vllm.platforms import current_platform

        extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
        return device_landing_wanted(extra) and current_platform.is_cuda()

    def may_load_async(self, request: Request) -> bool:
        """Whether vLLM 0.34 may start the request's load while the batch is full.

        The hook's contract (0.34's base class): whether ``get_num_new_matched_tokens``
        may answer ``load_kv_async=True`` for the request. With ``async_loads`` on (the
        default on 0.34) kvblend answers True for a reuse request
        (:meth:`kvblend.vllm.scheduler.SchedulerSide.may_load_async`): under
        ``--max-num-inflight-kv-loads`` vLLM looks it up while the batch is full, the
        daemon lands it between the steps, and the request joins the batch with its
        chunks in place. A blend, or a request without kvblend parameters, answers
        False (see there). 0.32 and 0.33 never call it.
        """
        return self.scheduler.may_load_async(request)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return the requests whose asynchronous loads ended since the last call.

        Sends: none (a request's blocks are vLLM's to free at once). Receives: the loads
        started early (``async_loads``) that landed, were copied, or failed (their
        blocks then go to :meth:`get_block_ids_with_load_errors` in the same step, and
        vLLM recomputes them).
        """
        done = self.worker.get_finished()
        return None, (done or None)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Return the stats object for data vLLM aggregated (:mod:`kvblend.vllm.stats`)."""
        return KvblendStats() if data is None else KvblendStats(data=dict(data))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return the blocks whose load failed this step (vLLM recomputes them)."""
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Close the daemon connection (the region's client stays: vLLM's cache lives there)."""
        self.worker.shutdown()
