"""kvblend inside vLLM 0.32: a v1 KV connector that stores chunks and lands them anywhere.

Load it with::

    KVTransferConfig(kv_connector="KvblendConnector", kv_connector_module_path="kvblend.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"endpoint": "ipc://..."})

A request names its stored chunks in ``kv_transfer_params={"kvblend": {"segments":
[[start, length, "chunk" | "fresh"], ...], "store": bool}}``. The scheduler side looks the
chunks up and claims the tokens they cover from the start of the prompt up to the first
token vLLM must compute; the worker side reads each claimed chunk from kvblendd with its
keys re-rotated to the chunk's new position and writes it into vLLM's paged CPU cache
before the forward pass. A request flagged ``store`` whose prompt is one chunk has that
chunk's KV gathered from the cache layer by layer and stored. docs/vllm.md says what is
supported, what is refused and how failures fall back.

This module imports torch and vLLM; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from . import _vllm_blend as blend
from . import _vllm_plan as plan
from ._vllm_land import CacheRegion
from .client import Client, Model, chunk_hash, default_endpoint
from .errors import KvblendError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (format, level) applies to our lines.
logger = init_logger(f"vllm.{__name__}")

#: vLLM versions this connector is written against (the CPU cache layout and the v1
#: connector interface both change between minor versions).
SUPPORTED_VLLM = "0.32"

#: Test hook: while the file this names exists, the worker's next load fails (and removes it).
FAIL_LOAD_ENV = "KVBLEND_VLLM_FAIL_LOAD_FILE"

#: Test hook: while the file this names exists, loads are copied, not landed.
COPY_ENV = "KVBLEND_VLLM_COPY_FILE"

#: Debug hook: when set to a folder, the worker writes the raw cache blocks it filled in
#: each load there (``load-<n>.npz``), for tests that check the landed rows independently.
DUMP_ENV = "KVBLEND_VLLM_DUMP_DIR"

_ROPE_SCALINGS = ("none", "default", "linear", "llama3", "yarn", "dynamic")
# Architectures whose attention kvblend describes exactly: full attention, neox RoPE on
# all heads, keys cached after RoPE.
_NEOX_ARCHS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class Refused(RuntimeError):
    """The connector cannot serve this engine exactly; the message says why."""


def _refuse(msg: str) -> Refused:
    logger.error("kvblend: refusing to start: %s", msg)
    return Refused(f"kvblend: {msg}")


def _check_version() -> None:
    v = getattr(vllm, "__version__", "unknown")
    if not (v == SUPPORTED_VLLM or v.startswith(SUPPORTED_VLLM + ".")):
        raise _refuse(f"vLLM {v} is not supported: kvblend.vllm supports vLLM {SUPPORTED_VLLM}.x")


def _scaling_spec(rs: dict[str, Any] | None, max_pos: int | None) -> str:
    """Kvblend's SPEC for a Hugging Face rope scaling dict (rope_parameters in transformers 5)."""
    if not rs:
        return "none"
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in _ROPE_SCALINGS:
        raise _refuse(f"rope scaling type {kind!r} is not one kvblend re-rotates exactly")
    if kind in ("none", "default"):
        return "none"
    f = rs.get("factor")
    if not isinstance(f, (int, float)):
        raise _refuse(f"rope scaling {kind!r} without a numeric factor")
    if kind == "linear":
        return f"linear:{f}"
    orig = rs.get("original_max_position_embeddings") or max_pos
    if kind == "llama3":
        return (
            f"llama3:{f},{rs['low_freq_factor']},{rs['high_freq_factor']},"
            f"{rs['original_max_position_embeddings']}"
        )
    if kind == "yarn":
        for extra in ("attention_factor", "mscale", "mscale_all_dim"):
            if rs.get(extra) not in (None, 1, 1.0, 0):
                raise _refuse(f"yarn with {extra}={rs[extra]} is not described by kvblend")
        return f"yarn:{f},{orig},{rs.get('beta_fast', 32)},{rs.get('beta_slow', 1)}"
    return f"dynamic:{f},{orig}"


def model_from_vllm(vllm_config: VllmConfig, name: str) -> Model:
    """Return the kvblend Model that describes the engine's KV exactly.

    Raises
    ------
    Refused
        MLA, sliding window, an architecture or RoPE scaling kvblend cannot describe,
        tensor or pipeline parallelism, a quantized KV cache, an unsupported dtype.
    """
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    if not archs or archs[0] not in _NEOX_ARCHS:
        raise _refuse(
            f"architecture {archs} is not one whose KV kvblend describes exactly "
            f"(supported: {sorted(_NEOX_ARCHS)})"
        )
    if mc.use_mla:
        raise _refuse("MLA attention (latent KV) is not supported")
    if (
        mc.get_sliding_window() is not None
        or getattr(hf, "layer_types", None)
        and any(t != "full_attention" for t in hf.layer_types)
    ):
        raise _refuse("sliding-window attention layers are not supported")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise _refuse("tensor or pipeline parallelism is not supported yet")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise _refuse(f"kv_cache_dtype {cache_dtype!r}: only 'auto' (the model's dtype)")
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None:
        raise _refuse(f"dtype {mc.dtype} (float32, float16 or bfloat16 only)")
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise _refuse("the model config has no rope_theta")
    scaling = rp if rp.get("rope_type", "default") != "default" else None
    if scaling is None:
        scaling = getattr(hf, "rope_scaling", None)
    head_dim = mc.get_head_size()
    prf = rp.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    rotary = int(head_dim * prf)
    return Model(
        name=name,
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=head_dim,
        dtype=dtype,
        rope_theta=float(theta),
        rope_style="neox",
        rotary_dim=0 if rotary == head_dim else rotary,
        scaling=_scaling_spec(scaling, getattr(hf, "max_position_embeddings", None)),
        k_pre_rope=False,
    )


def default_model_name(vllm_config: VllmConfig) -> str:
    """Return ``vllm:<served model name>:<dtype>``, cut to kvblend's 64-byte limit."""
    mc = vllm_config.model_config
    served = mc.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0]
    base = os.path.basename(str(served or mc.model).rstrip("/")) or "model"
    name = f"vllm:{base}:{_DTYPES.get(mc.dtype, 'x')}"
    return name.encode()[:64].decode(errors="ignore")


@dataclass
class LoadSpec:
    """One request's chunks to write into its blocks this step."""

    req_id: str
    chunks: list[plan.ChunkLoad]
    block_ids: list[int]
    block_size: int
    blend: blend.BlendLoad | None = None  # a CacheBlend load instead of the chunks


@dataclass
class StoreSpec:
    """One request whose prompt (one chunk) is stored once this step has prefilled it."""

    req_id: str
    hash: bytes
    length: int
    block_ids: list[int]
    block_size: int


@dataclass
class KvblendMetadata(KVConnectorMetadata):
    """What the worker does in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass
class _Pending:
    """Scheduler-side state of a request that stores."""

    hash: bytes
    length: int
    block_ids: list[int]


class KvblendConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvblendd (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        _check_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.endpoint: str = extra.get("endpoint") or default_endpoint()
        self.timeout_ms = int(extra.get("timeout_ms", 5000))
        self.model_name: str = extra.get("model_name") or default_model_name(vllm_config)
        try:
            self.separator = plan.parse_separator(extra.get("chunk_separator"))
        except plan.ParamError as e:
            raise _refuse(str(e)) from None
        if vllm_config.cache_config.enable_prefix_caching:
            raise _refuse(
                "prefix caching must be off (enable_prefix_caching=False): blocks filled "
                "from chunks at new positions must not be reused as if computed after "
                "their prefix"
            )
        tc = vllm_config.kv_transfer_config
        if tc.kv_load_failure_policy != "recompute":
            # A failed load must be recomputed, never served and never fail the request.
            logger.info("kvblend: kv_load_failure_policy set to 'recompute'")
            tc.kv_load_failure_policy = "recompute"
        self.model = model_from_vllm(vllm_config, self.model_name)
        self.block_size = vllm_config.cache_config.block_size
        archs = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
        try:
            self.blend = blend.config_from_extra(
                extra,
                archs[0] if archs else None,
                self.model.num_layers,
                vllm_config.model_config.hf_config,
            )
        except ValueError as e:
            raise _refuse(f"kv_connector_extra_config: {e}") from None
        self._blend_model: Any = None
        self._client: Client | None = None
        self._logged: set[str] = set()
        # scheduler side
        self._plans: dict[str, tuple[int, list[plan.ChunkLoad]]] = {}
        self._loads: list[LoadSpec] = []
        self._stores: dict[str, _Pending] = {}
        # worker side
        self._registered = False
        self._k: list[torch.Tensor] = []  # per layer [blocks, heads, head_dim, block_size]
        self._v: list[torch.Tensor] = []  # per layer [blocks, heads, block_size, head_dim]
        self._raw: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._gathered: dict[str, np.ndarray] = {}
        self._dump_dir = os.environ.get(DUMP_ENV)
        self._dumps = 0
        self._region: CacheRegion | None = None  # the cache in a kvblend region (landing)
        self._landing: dict[str, LoadSpec] = {}  # this step's loads the daemon lands
        logger.info(
            "kvblend: connector (%s) on %s, model %r", role.name, self.endpoint, self.model_name
        )

    # ---- plumbing ----

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("kvblend: " + msg, *args)

    def _daemon(self) -> Client:
        if self._client is None:
            self._client = Client(self.endpoint, timeout_ms=self.timeout_ms)
            self._registered = False
        if not self._registered and self.role == KVConnectorRole.WORKER:
            self._client.model_register(self.model)
            self._registered = True
        return self._client

    def _drop_client(self) -> None:
        # After an error the connection may be half-way through a request: start afresh.
        if self._client is not None:
            try:
                self._client.close()
            except KvblendError:
                pass
        self._client = None

    # ---- scheduler side ----

    def _plan(self, request: Request, num_computed_tokens: int) -> tuple[int, list]:
        try:
            if self.blend is not None:
                got = blend.plan_blend(
                    self._daemon(),
                    self.model_name,
                    self.model.num_layers,
                    request.kv_transfer_params,
                    request.prompt_token_ids or [],
                    num_computed_tokens,
                    self.blend,
                )
                if got is not None:
                    self._logged.discard("lookup")
                    return got
            kvp, override = blend.split_override(request.kv_transfer_params)
            if override is not None and self.blend is None:
                self._log_once(
                    "override",
                    "requests carry blend settings, but 'blend' is "
                    "not configured (or refused): full reuse",
                )
            out = plan.plan_request(
                self._daemon(),
                self.model_name,
                self.model.num_layers,
                kvp,
                request.prompt_token_ids or [],
                num_computed_tokens,
                self.separator,
            )
            self._logged.discard("lookup")  # log the next outage again
            return out
        except plan.ParamError as e:
            # Once per request: vLLM asks again while the request waits for blocks.
            self._log_once(
                "params:" + request.request_id,
                "request %s served without kvblend: %s",
                request.request_id,
                e,
            )
        except KvblendError as e:
            self._drop_client()
            self._log_once("lookup", "daemon error, serving without kvblend: %s", e)
        return 0, []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens from ``num_computed_tokens`` on that stored chunks provide."""
        n, loads = self._plan(request, num_computed_tokens)
        self._plans[request.request_id] = (n, loads)  # a cache for update_state_after_alloc
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the request's blocks and claim; note a request that stores."""
        rid = request.request_id
        n, loads = self._plans.pop(rid, (0, []))
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            if n != num_external_tokens:  # vLLM asked again and got another answer
                n, loads = self._plan(request, request.num_computed_tokens)
            if n != num_external_tokens:
                self._log_once("claim", "claim changed under vLLM for %s: no load", rid)
                return
            if isinstance(loads, blend.BlendLoad):
                self._loads.append(LoadSpec(rid, [], block_ids, self.block_size, loads))
                return
            self._loads.append(LoadSpec(rid, loads, block_ids, self.block_size))
            return
        ids = request.prompt_token_ids or []
        try:
            params = plan.parse_params(
                blend.split_override(request.kv_transfer_params)[0], len(ids)
            )
        except plan.ParamError:
            return
        if params is None or not params.store:
            return
        why = plan.store_shape_error(params, len(ids))
        if why:
            logger.warning("kvblend: request %s not stored: %s", rid, why)
            return
        self._stores[rid] = _Pending(chunk_hash(ids), len(ids), block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Return this step's loads and completed stores; loaded blocks are not zeroed."""
        meta = KvblendMetadata(loads=self._loads)
        self._loads = []
        overwritten: set[int] = set()
        for ld in meta.loads:
            spans = [(c.first, c.last) for c in ld.chunks]
            if ld.blend is not None:
                spans.append((0, len(ld.blend.ids)))
            for first, last in spans:
                for b in plan.full_blocks(first, last, ld.block_size):
                    overwritten.add(ld.block_ids[b])
        zero = scheduler_output.new_block_ids_to_zero
        if zero and overwritten:
            scheduler_output.new_block_ids_to_zero = [b for b in zero if b not in overwritten]
        scheduled = scheduler_output.num_scheduled_tokens
        progress: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id in self._stores:
                self._stores[r.req_id].block_ids = list(r.block_ids[0])
                progress[r.req_id] = r.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._stores:
                new = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:
                    # Resumed after preemption: new_block_ids is its whole block list.
                    self._stores[rid].block_ids = list(new[0]) if new else []
                elif new:
                    self._stores[rid].block_ids.extend(new[0])
                progress[rid] = cached.num_computed_tokens[i]
        for rid, done in progress.items():
            st = self._stores[rid]
            if done + scheduled.get(rid, 0) >= st.length:
                spec = StoreSpec(rid, st.hash, st.length, st.block_ids, self.block_size)
                meta.stores.append(spec)
                del self._stores[rid]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        """Forget the request; its blocks are vLLM's to free at once."""
        self._plans.pop(request.request_id, None)
        self._stores.pop(request.request_id, None)
        self._logged.discard("params:" + request.request_id)
        return False, None

    # ---- worker side ----

    def get_mem_pool_context(self) -> Any:
        """Place vLLM's one KV-cache allocation in a kvblend region (ipc:// daemons).

        Returns a context (see ``kvblend._vllm_land``) or None: vLLM then allocates as
        usual and loads take the copy path (one log line says why).
        """
        sizes = {t.size for t in self._kv_cache_config.kv_cache_tensors}
        if len(sizes) != 1:
            logger.warning("kvblend: landing off: %d KV-cache allocations, not one", len(sizes))
            return None
        self._region = CacheRegion(self.endpoint, self.timeout_ms, sizes.pop(), logger)
        return self._region.context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep K and V views of each layer's cache (CPU "vec" layout); register the model."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        bs, hd = self.block_size, self.model.head_dim
        for i, (name, t) in enumerate(kv_caches.items()):
            isa = getattr(ctx.get(name), "isa", None)
            if t.device.type != "cpu" or isa != "vec":
                raise _refuse(
                    f"layer {name}: attention ISA {isa!r} on {t.device.type}; kvblend knows "
                    "only the CPU 'vec' cache layout (float32)"
                )
            nb, heads = t.shape[0], t.shape[1]
            if tuple(t.shape) != (nb, self.model.num_kv_heads, bs, 2 * hd) or not t.is_contiguous():
                raise _refuse(f"layer {name}: cache shape {tuple(t.shape)} is not the one expected")
            raw = t.view(nb, heads, 2 * bs * hd)
            # Per block and head: K transposed [head_dim, block_size], then V rows.
            self._k.append(raw[:, :, : bs * hd].view(nb, heads, hd, bs))
            self._v.append(raw[:, :, bs * hd :].view(nb, heads, bs, hd))
            self._raw.append(t)
            m = re.search(r"\.(\d+)\.", name)
            self._layer_of[name] = int(m.group(1)) if m else i
        if len(self._k) != self.model.num_layers:
            raise _refuse(f"{len(self._k)} cache layers, the model has {self.model.num_layers}")
        if self.blend is not None:
            try:
                self._blend_model = blend.worker_model(self._vllm_config)
            except (RuntimeError, AttributeError) as e:
                raise _refuse(f"blending configured, but {e}") from None
        if self._region is not None:
            idx = list(self._layer_of.values())
            order = sorted(range(len(idx)), key=idx.__getitem__)
            self._region.attach([self._raw[i] for i in order], self.model, bs)
        try:
            self._daemon()
        except KvblendError as e:
            self._drop_client()
            logger.warning("kvblend: daemon not reachable at start (%s); retrying per request", e)

    def _slots(self, block_ids: list[int], first: int, last: int) -> tuple[torch.Tensor, ...]:
        pos = torch.arange(first, last)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Land (or write) each claimed chunk, re-rotated to its position, in the request's blocks.

        With the cache in a region, a load whose chunks lie back to back from position 0
        gets a landing session: the daemon writes the layers itself, and
        wait_for_layer_load waits for each. Other loads are copied here from the
        daemon's reply.
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvblendMetadata)
        for ld in meta.loads:
            t0 = time.monotonic()
            try:
                fail = os.environ.get(FAIL_LOAD_ENV)
                if fail and os.path.exists(fail):
                    os.unlink(fail)
                    raise RuntimeError("load failure injected by " + FAIL_LOAD_ENV)
                copy = os.environ.get(COPY_ENV)
                if (
                    self._region is not None
                    and ld.blend is None
                    and not (copy and os.path.exists(copy))
                    and self._region.open(self.model_name, ld.req_id, ld.chunks, ld.block_ids)
                ):
                    self._landing[ld.req_id] = ld
                    continue
                client = self._daemon()
                if ld.blend is not None:
                    blend.load_blend(
                        self._blend_model,
                        client,
                        self.model,
                        ld.blend,
                        ld.block_ids,
                        self.block_size,
                        self._k,
                        self._v,
                    )
                for c in ld.chunks:
                    kv = client.get_rerotated(self.model_name, c.hash, pos=c.start)
                    rows = torch.from_numpy(kv[:, :, c.first - c.start : c.last - c.start])
                    blk, off = self._slots(ld.block_ids, c.first, c.last)
                    for layer in range(self.model.num_layers):
                        self._k[layer][blk, :, :, off] = rows[layer, 0]
                        self._v[layer][blk, :, off, :] = rows[layer, 1]
            except (KvblendError, ValueError, IndexError, RuntimeError, TimeoutError) as e:
                self._drop_client()
                self._load_failed(ld, str(e))
                continue
            logger.info(
                "kvblend: %s %d tokens of %s in %.3f s%s",
                "blended" if ld.blend is not None else "loaded",
                sum(c.last - c.first for c in ld.chunks) + len(ld.blend.ids if ld.blend else []),
                ld.req_id,
                time.monotonic() - t0,
                "" if ld.blend is not None else " (copied from the daemon's reply)",
            )
            if self._dump_dir:
                self._dump(ld, "blended" if ld.blend is not None else "copied")

    def _load_failed(self, ld: LoadSpec, why: str) -> None:
        """Report a load's blocks to vLLM, which recomputes them (policy 'recompute')."""
        bad = {
            ld.block_ids[i // self.block_size] for c in ld.chunks for i in range(c.first, c.last)
        }
        if ld.blend is not None:
            bad |= {ld.block_ids[i // self.block_size] for i in range(len(ld.blend.ids))}
        self._load_errors |= bad
        logger.warning(
            "kvblend: load for %s failed (%s); vLLM recomputes its %d blocks",
            ld.req_id,
            why,
            len(bad),
        )

    def _landed(self) -> None:
        """Close this step's landing sessions: log each load, report the failed ones."""
        assert self._region is not None
        for rid, (st, secs, failed) in self._region.close_all().items():
            ld = self._landing.pop(rid)
            if failed:
                self._load_failed(ld, "landing stopped")
                continue
            logger.info(
                "kvblend: loaded %d tokens of %s in %.3f s (landed by kvblendd in vLLM's cache: "
                "the time the engine waited; %d layers, daemon landing %.1f ms)",
                sum(c.last - c.first for c in ld.chunks),
                rid,
                secs,
                int(st.get("layers_landed", 0)),
                st.get("land_ms", 0.0),
            )
            if self._dump_dir:
                self._dump(ld, "landed")

    def _dump(self, ld: LoadSpec, how: str) -> None:
        """Write the raw blocks a load touched (debug hook for tests, DUMP_ENV)."""
        spans = [(c.first, c.last) for c in ld.chunks]
        if ld.blend is not None:
            spans.append((0, len(ld.blend.ids)))
        blocks = sorted({ld.block_ids[i // self.block_size] for a, b in spans for i in range(a, b)})
        raw = torch.stack([t[blocks] for t in self._raw]).numpy()
        path = os.path.join(self._dump_dir, f"load-{self._dumps}.npz")
        self._dumps += 1
        np.savez(
            path,
            raw=raw,
            blocks=np.array(blocks),
            block_ids=np.array(ld.block_ids),
            block_size=self.block_size,
            chunks=np.array([[c.start, c.length, c.first, c.last] for c in ld.chunks]),
            hashes=np.array([c.hash.hex() for c in ld.chunks]),
            path=how,  # "landed" or "copied"
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until this step's landing sessions have the layer in vLLM's cache.

        Copied loads were written in start_load_kv. A session that stops (an error, or
        past ``timeout_ms``) has its blocks recomputed by vLLM (reported at the step's end).
        """
        if self._region is None or not self._region.sessions:
            return
        self._region.wait(self._layer_of[layer_name], self.timeout_ms / 1000)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Gather this layer's K and V of each storing request's chunk into host memory."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvblendMetadata)
        if not meta.stores:
            return
        layer = self._layer_of[layer_name]
        for st in meta.stores:
            buf = self._gathered.get(st.req_id)
            if buf is None:
                buf = np.empty(self.model.kv_shape(st.length), self.model.np_dtype)
                self._gathered[st.req_id] = buf
            blk, off = self._slots(st.block_ids, 0, st.length)
            torch.from_numpy(buf[layer, 0])[:] = self._k[layer][blk, :, :, off]
            torch.from_numpy(buf[layer, 1])[:] = self._v[layer][blk, :, off, :]

    def wait_for_save(self) -> None:
        """Close this step's landing sessions; PUT each chunk gathered this step (position 0)."""
        if self._region is not None and self._region.sessions:
            self._landed()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvblendMetadata)
        for st in meta.stores:
            buf = self._gathered.pop(st.req_id, None)
            if buf is None:
                continue
            try:
                self._daemon().put(self.model_name, st.hash, buf, base_pos=0)
            except KvblendError as e:
                self._drop_client()
                logger.warning("kvblend: storing %s failed: %s", st.req_id, e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return the blocks whose load failed this step (vLLM recomputes them)."""
        bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        """Close the daemon connection (the region's client stays: vLLM's cache lives there)."""
        if self._region is not None and self._region.sessions:
            self._landed()
        self._drop_client()


def store_documents(llm: Any, docs: list[list[int]] | list[str]) -> list[bytes]:
    """Prefill each document alone with ``store`` set, so that kvblendd holds its KV.

    Parameters
    ----------
    llm : vllm.LLM
        An engine running :class:`KvblendConnector`.
    docs : list of token-id lists, or list of str
        Strings are tokenized with the engine's tokenizer, without special tokens.

    Returns
    -------
    list of bytes
        Each document's chunk hash (what a later request's segments refer to).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = None
    id_lists = []
    for d in docs:
        if isinstance(d, str):
            tok = tok or llm.get_tokenizer()
            d = tok.encode(d, add_special_tokens=False)
        id_lists.append([int(t) for t in d])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in id_lists]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=1,
            extra_args={
                "kv_transfer_params": {
                    "kvblend": {"segments": [[0, len(ids), "chunk"]], "store": True}
                }
            },
        )
        for ids in id_lists
    ]
    llm.generate(prompts, params, use_tqdm=False)
    return [chunk_hash(ids) for ids in id_lists]
