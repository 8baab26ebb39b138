"""The connector's configuration: vLLM's engine checked and described as a kvblend Model.

:func:`connector_config` reads what the connector needs from vLLM's config once, at
start (the daemon's endpoint, the model's name and exact description, the chunk
separator, given as ids or as text tokenized here, the blend settings) and refuses, with
:class:`Refused` naming the reason, an engine whose KV kvblend cannot describe exactly or
serve safely (docs/vllm-reference.md, "The model"). Imports torch and vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.logger import init_logger

from .. import describe as _describe
from ..blend import arch as _arch
from ..client import default_endpoint
from ..errors import KvblendError
from ..types import Model
from . import plan
from . import separator as _separator
from .plan import DEFAULT_CONFIG, BlendConfig, blend_settings
from .versions import SUPPORTED_VLLM, supported_text, version_supported  # noqa: F401

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The connector's one logger (its configuration, scheduler, worker and landing): under
# "vllm." so that vLLM's logging configuration (format, level) applies to our lines.
logger = init_logger("vllm.kvblend.vllm")

# Architectures whose attention kvblend describes exactly: neox RoPE on every head (on a
# partial rotary factor's share of each), keys cached after RoPE, full attention but in
# the local layers of an architecture that has them (Gemma 3: a sliding window and a RoPE
# base of their own, both described): the ones the blend pass drives (kvblend.blend.arch,
# the one list).
_NEOX_ARCHS = frozenset(_arch.ARCHITECTURES)
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class Refused(RuntimeError):
    """The connector cannot serve this engine exactly; the message says why."""


class ModelClash(RuntimeError):
    """kvblendd holds another description under the model's name (:func:`model_clash`)."""


def refuse(msg: str) -> Refused:
    """Log why the connector refuses to start and return the :class:`Refused` to raise.

    One line, ``kvblend: refusing to start: <msg>``; a ``msg`` that already starts with
    ``kvblend:`` (another module's error) loses that prefix, so the line has one.
    """
    msg = msg.removeprefix("kvblend: ")
    logger.error("kvblend: refusing to start: %s", msg)
    return Refused(f"kvblend: {msg}")


#: The fields of a model's description, in the order a clash names them.
_MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "rope_theta",
                 "rope_style", "rotary_dim", "scaling", "k_pre_rope", "store")


def model_clash(client: Any, model: Model, reply: str = "") -> str:
    """Say how kvblendd's description of ``model.name`` differs from ``model``'s (one line).

    For a registration kvblendd refused with ``model_conflict``: the daemon's reply names
    at most the first field that differs, without values, so the stored description is
    read back (MODEL_LIST naming it) and compared field by field, both as libkvblend
    normalises them (the scaling's canonical SPEC; ``rotary_dim`` 0 is all of ``head_dim``).
    ``reply``, the daemon's message, is what the line gives when that fails.
    """
    head = f"model '{model.name}' is registered in kvblendd"
    advice = (
        "its stored chunks were computed with that description and are never loaded "
        "for this engine; set kv_connector_extra_config's model_name to store this one "
        "under a name of its own"
    )
    try:
        theirs = client.model_get(model.name)
        ours = Model._from_c(model._to_c())
    except KvblendError as e:
        return f"{head} with another layout or RoPE ({reply or e}); {advice}"

    def value(m: Model, f: str) -> Any:
        return (m.rotary_dim or m.head_dim) if f == "rotary_dim" else getattr(m, f)

    def show(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    diff = [
        f"{f} {show(value(theirs, f))} where this engine has {show(value(ours, f))}"
        for f in _MODEL_FIELDS
        if value(theirs, f) != value(ours, f)
    ]
    what = ", ".join(diff) or "another layout or RoPE" + (f" ({reply})" if reply else "")
    return f"{head} with {what}: {advice}"


def check_version() -> None:
    """Refuse a vLLM other than :data:`SUPPORTED_VLLM` (its connector interface and cache)."""
    v = getattr(vllm, "__version__", "unknown")
    if not version_supported(v):
        raise refuse(f"vLLM {v} is not supported: kvblend.vllm supports vLLM {supported_text()}")


def model_from_vllm(vllm_config: VllmConfig, name: str) -> Model:
    """Return the kvblend Model that describes the engine's KV exactly.

    Raises
    ------
    Refused
        MLA, a sliding window outside an architecture's local layers, an architecture or
        RoPE scaling kvblend cannot describe,
        pipeline parallelism, tensor parallelism over more ranks than KV heads (or a
        count that does not divide them), a quantized KV cache, an unsupported dtype.
    """
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    if not archs or archs[0] not in _NEOX_ARCHS:
        raise refuse(
            f"architecture {archs} is not one whose KV kvblend describes exactly "
            f"(supported: {sorted(_NEOX_ARCHS)})"
        )
    if mc.use_mla:
        raise refuse("MLA attention (latent KV) is not supported")
    arch = _arch.ARCHITECTURES[archs[0]]
    if arch.local_layers:
        try:  # local layers' windows as the pass reads them (layer types and a window)
            _arch.sliding_windows(arch, hf, "kvblend")
        except _arch.ArchRefused as e:
            raise refuse(str(e)) from None
    elif (
        mc.get_sliding_window() is not None
        or getattr(hf, "layer_types", None)
        and any(t != "full_attention" for t in hf.layer_types)
    ):
        raise refuse(f"sliding-window attention layers are not supported for {arch.name}")
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise refuse("pipeline parallelism is not supported yet")
    tp = pc.tensor_parallel_size
    total_heads = mc.get_total_num_kv_heads()
    if tp > 1 and total_heads % tp:
        # vLLM then replicates KV heads across ranks: a rank's cache is not a head range
        raise refuse(
            f"tensor_parallel_size {tp} does not divide the model's {total_heads} KV heads "
            "(vLLM replicates them across ranks then; kvblend lands a rank's own range)"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise refuse(f"kv_cache_dtype {cache_dtype!r}: only 'auto' (the model's dtype)")
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None:
        raise refuse(f"dtype {mc.dtype} (float32, float16 or bfloat16 only)")
    try:
        return _describe.describe(
            hf,
            name=name,
            dtype=dtype,
            num_layers=mc.get_num_layers(pc),
            num_kv_heads=total_heads,
            head_dim=mc.get_head_size(),
        )
    except _describe.Undescribable as e:
        raise refuse(str(e)) from None


def default_model_name(vllm_config: VllmConfig) -> str:
    """Return ``vllm:<served model name>:<dtype>``, cut to kvblend's 64-byte limit."""
    mc = vllm_config.model_config
    served = mc.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0]
    base = os.path.basename(str(served or mc.model).rstrip("/")) or "model"
    name = f"vllm:{base}:{_DTYPES.get(mc.dtype, 'x')}"
    return name.encode()[:64].decode(errors="ignore")


def config_from_extra(
    extra: dict, architecture: str | None, num_layers: int, hf_config: Any = None
) -> BlendConfig | None:
    """Parse ``extra["blend"]`` (absent or None: no blending).

    ``{"metric": "anchored", "ratios": [0.15]}`` (the defaults); ``{}`` takes all
    defaults. Settings with ``check_layers`` and no ``metric`` take the value metric
    (check layer 1, ratio 0.15 for what they leave out), as before anchored became the
    default. Returns None, with the reason in the log, for a model whose
    architecture (or an option of it in ``hf_config``, the model's Hugging Face config)
    the blend pass does not drive (:func:`kvblend.blend.arch.check_config`): its requests are served
    as plain reuse.

    Raises
    ------
    ValueError
        Malformed settings; the message names the key.
    """
    raw = extra.get("blend")
    if raw is None:
        return None
    config = blend_settings(raw, num_layers, DEFAULT_CONFIG, "blend")
    try:
        _arch.check_config(architecture, hf_config, "kvblend: blending refused")
    except _arch.ArchRefused as e:
        logger.warning("%s; its requests are served as plain reuse", e)
        return None
    return config


class _DecodedVocabulary(Sequence):
    """The tokenizer's tokens decoded one by one, on demand (the check samples a few)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return "" if i in self.special else self.tokenizer.decode([i])


def separator_from_extra(extra: dict, vllm_config: VllmConfig) -> tuple[int, ...] | None:
    """Return the chunk separator's ids: ``chunk_separator`` or ``chunk_separator_text``.

    ``chunk_separator_text`` is tokenized with the engine's tokenizer (vLLM's
    ``cached_tokenizer_from_config``, the one its front end and structured output use)
    without special tokens, and checked to be a stable token boundary
    (:func:`kvblend.vllm.separator.check_separator`).

    Raises
    ------
    Refused
        Both keys given, malformed ids, no tokenizer (``skip_tokenizer_init``), or a text
        that fails the check (the message names the context and a candidate that passes).
    """
    text = extra.get("chunk_separator_text")
    if text is not None and extra.get("chunk_separator") is not None:
        raise refuse(
            "kv_connector_extra_config: give chunk_separator (token ids) or "
            "chunk_separator_text, not both"
        )
    if text is None:
        try:
            return plan.parse_separator(extra.get("chunk_separator"))
        except plan.ParamError as e:
            raise refuse(str(e)) from None
    from vllm.tokenizers import cached_tokenizer_from_config

    tok = cached_tokenizer_from_config(vllm_config.model_config)
    if tok is None:
        raise refuse("chunk_separator_text needs the engine's tokenizer (skip_tokenizer_init)")

    def encode(s: str) -> list[int]:
        return list(tok.encode(s, add_special_tokens=False))

    try:
        ids = _separator.check_separator(text, encode, _DecodedVocabulary(tok))
        plan.parse_separator(list(ids))
    except (_separator.SeparatorError, plan.ParamError) as e:
        raise refuse(f"kv_connector_extra_config: {e}") from None
    logger.info("kvblend: chunk_separator_text %r is the token ids %s", text, list(ids))
    return ids


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector runs with, read once from vLLM's config (:func:`connector_config`)."""

    endpoint: str
    timeout_ms: int
    model_name: str
    separator: tuple[int, ...] | None
    model: Model
    block_size: int
    blend: BlendConfig | None
    prefix_caching: bool = False
    store_on_miss: bool = False
    store_tokens_per_step: int = 2048
    store_idle_ms: int = 0
    load_cost_check: bool = True
    load_cost_margin: float = 1.0
    lookup_timeout_ms: int = 500
    #: vLLM's tensor_parallel_size (a request's blend settings naming the attention
    #: metric are refused under it)
    tensor_parallel: int = 1
    #: loads on a GPU land through kvblendd's CUDA device (:func:`device_landing_wanted`;
    #: on vLLM 0.34 the connector then declares ``KVCacheAccess.EXPORTS_FD``)
    device_landing: bool = True
    #: reuse loads start early (``load_kv_async``): the daemon lands them between the
    #: engine's steps, and the request is scheduled once they are in place
    #: (:func:`async_loads_wanted`)
    async_loads: bool = False


#: ``kv_connector_extra_config["async_loads"]``: "auto" (on with vLLM 0.34, whose
#: scheduler can start them while the batch is full), true or false.
ASYNC_LOADS = ("auto", True, False)


def async_loads_wanted(extra: dict, version: str) -> bool:
    """Whether reuse loads start early (asynchronous loads), by ``extra`` and vLLM's version.

    "auto" (the default): on with vLLM 0.34 and later, where ``may_load_async`` lets
    vLLM's scheduler start a load while the running batch is full
    (``--max-num-inflight-kv-loads``); off on 0.32 and 0.33, whose loads land under the
    request's own first step. true or false: as said, on any version.

    Raises
    ------
    ValueError
        ``async_loads`` is none of :data:`ASYNC_LOADS` (the message names the key).
    """
    mode = extra.get("async_loads", "auto")
    if not any(mode is m if isinstance(m, bool) else mode == m for m in ASYNC_LOADS):
        raise ValueError(
            f"kvblend: kv_connector_extra_config: async_loads must be \"auto\", true or "
            f"false, got {mode!r}"
        )
    if mode != "auto":
        return bool(mode)
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (0, 34)


#: ``kv_connector_extra_config["device_landing"]``: "auto" (loads land through a local
#: kvblendd's CUDA device where there is one) or "off" (the copy path on GPUs).
DEVICE_LANDING = ("auto", "off")


def device_landing_wanted(extra: dict) -> bool:
    """Whether ``extra`` lets loads land through kvblendd's CUDA device.

    True for ``device_landing`` "auto" (the default) with an ``ipc://`` endpoint (the
    configured one, else :func:`kvblend.client.default_endpoint`): a local daemon, which
    can map the GPU's memory. Pure (no vLLM call): the connector's ``kv_cache_access``
    and its worker both decide by it.

    Raises
    ------
    ValueError
        ``device_landing`` is not one of :data:`DEVICE_LANDING` (the message names the key).
    """
    mode = extra.get("device_landing", "auto")
    if mode not in DEVICE_LANDING:
        raise ValueError(
            f"kvblend: kv_connector_extra_config: device_landing must be one of "
            f"{list(DEVICE_LANDING)}, got {mode!r}"
        )
    endpoint = extra.get("endpoint") or default_endpoint()
    return mode == "auto" and str(endpoint).startswith("ipc://")


def _int_key(extra: dict, key: str, default: int, lo: int, hi: int) -> int:
    """Return ``extra[key]`` (``default`` when absent), an int in [lo, hi], else refuse."""
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise refuse(f"kv_connector_extra_config: {key} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """Read and check the connector's configuration (``kv_connector_extra_config``).

    Sets vLLM's ``kv_load_failure_policy`` to "recompute" (a failed load must be
    recomputed, never served and never fail the request).

    Raises
    ------
    Refused
        A malformed ``chunk_separator``, ``chunk_separator_text`` or ``blend``, or an
        engine :func:`model_from_vllm` refuses.
    """
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    endpoint: str = extra.get("endpoint") or default_endpoint()
    timeout_ms = _int_key(extra, "timeout_ms", 5000, 1, 3_600_000)
    lookup_timeout_ms = _int_key(extra, "lookup_timeout_ms", min(500, timeout_ms), 1, 3_600_000)
    model_name: str = extra.get("model_name") or default_model_name(vllm_config)
    separator = separator_from_extra(extra, vllm_config)
    tc = vllm_config.kv_transfer_config
    if tc.kv_load_failure_policy != "recompute":
        # A failed load must be recomputed, never served and never fail the request.
        logger.info("kvblend: kv_load_failure_policy set to 'recompute'")
        tc.kv_load_failure_policy = "recompute"
    model = model_from_vllm(vllm_config, model_name)
    archs = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
    try:
        blend = config_from_extra(
            extra,
            archs[0] if archs else None,
            model.num_layers,
            vllm_config.model_config.hf_config,
        )
    except ValueError as e:
        raise refuse(f"kv_connector_extra_config: {e}") from None
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1 and blend is not None and blend.metric == "attention":
        # the ranks select together by sums over their heads (docs/vllm-reference.md,
        # "Tensor parallelism"); the attention metric weighs each head's deviation by its own A
        raise refuse(
            f"blending under tensor parallelism ({tp} ranks) takes the value, key, question "
            "or anchored metric (the ranks sum their heads' deviations or attention); "
            "blend's metric is 'attention'"
        )
    try:
        device_landing = device_landing_wanted(extra)
    except ValueError as e:
        raise refuse(str(e)) from None
    try:
        async_loads = async_loads_wanted(extra, getattr(vllm, "__version__", ""))
    except ValueError as e:
        raise refuse(str(e)) from None
    store_on_miss = extra.get("store_on_miss", separator is not None and tp == 1)
    if not isinstance(store_on_miss, bool):
        raise refuse(
            f"kv_connector_extra_config: store_on_miss must be a bool, got {store_on_miss!r}"
        )
    if store_on_miss and tp > 1:
        # the miss thread prefills through the model's modules, whose collectives every
        # rank would have to run in step with the engine's
        raise refuse(
            f"store_on_miss under tensor parallelism ({tp} ranks) is not supported yet; "
            "requests that ask to store (kv_transfer_params) still store"
        )
    per_step = _int_key(extra, "store_tokens_per_step", 2048, 1, 1 << 20)
    idle_ms = _int_key(extra, "store_idle_ms", 0, 0, 60_000)
    check = extra.get("load_cost_check", True)
    if not isinstance(check, bool):
        raise refuse(f"kv_connector_extra_config: load_cost_check must be a bool, got {check!r}")
    margin = extra.get("load_cost_margin", 1.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin <= 100:
        raise refuse(
            f"kv_connector_extra_config: load_cost_margin must be a number in (0, 100], "
            f"got {margin!r}"
        )
    if separator is not None and blend is None:
        logger.warning(
            "kvblend: a chunk separator without 'blend': the text before the first "
            "separator is computed by vLLM, so the chunks after it are loaded only after "
            "a prefix-cache hit on all of it; configure 'blend' (CacheBlend, or "
            "{\"check_layers\": [], \"ratios\": []} for full reuse) to load them"
        )
    return ConnectorConfig(
        endpoint=endpoint,
        timeout_ms=timeout_ms,
        model_name=model_name,
        separator=separator,
        model=model,
        block_size=vllm_config.cache_config.block_size,
        blend=blend,
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        store_on_miss=store_on_miss,
        store_tokens_per_step=per_step,
        store_idle_ms=idle_ms,
        load_cost_check=check,
        load_cost_margin=float(margin),
        lookup_timeout_ms=lookup_timeout_ms,
        tensor_parallel=tp,
        device_landing=device_landing,
        async_loads=async_loads,
    )
