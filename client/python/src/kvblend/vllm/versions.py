"""The vLLM releases kvblend.vllm is written against: one list, for every module that checks.

The connector's start-up gate (:func:`kvblend.vllm.config.check_version`) and the
model-loading hook (:mod:`kvblend.vllm.plugin`) both read it. Imports nothing (the plugin
runs in every vLLM process, before torch or vLLM are needed).
"""

from __future__ import annotations

#: vLLM minor versions this connector supports (the CPU cache layout and the v1 connector
#: interface both change between minor versions). 0.33's connector interface adds only
#: the sleep-mode hooks (the connector refuses sleep mode); 0.34's adds
#: ``kv_cache_access``, ``may_load_async`` and ``supports_lookahead_block_hashes`` (each
#: decided in :class:`kvblend.vllm.connector.KvblendConnector`), and the modules the
#: connector and the plugin read did not change in ways they use.
#: tests/engine/test_vllm_interface.py checks all of it against the published sources.
SUPPORTED_VLLM = ("0.32", "0.33", "0.34")


def version_supported(version: str) -> bool:
    """Whether ``version`` (vLLM's ``__version__``) is one of :data:`SUPPORTED_VLLM`."""
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM)


def supported_text() -> str:
    """:data:`SUPPORTED_VLLM` for a message: ``0.32.x, 0.33.x and 0.34.x``."""
    xs = [f"{v}.x" for v in SUPPORTED_VLLM]
    return ", ".join(xs[:-1]) + " and " + xs[-1] if len(xs) > 1 else xs[0]
