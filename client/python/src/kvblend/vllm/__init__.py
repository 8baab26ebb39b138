"""kvblend inside vLLM 0.32 to 0.34: a v1 KV connector that stores chunks and lands them anywhere.

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

The package, by role:

- :mod:`.connector`: :class:`KvblendConnector`, vLLM's interface, delegating to
- :mod:`.scheduler` (the scheduler process's half) and :mod:`.worker` (each worker's);
- :mod:`.plan`: the one planner (parse, hash, look up, claim; no torch or vLLM);
- :mod:`.layout`: the one module that knows vLLM's cache layout;
- :mod:`.landing`: vLLM's cache in a kvblend region, written by the daemon;
- :mod:`.misses`: chunks a separator-split request missed, prefilled alone and stored;
- :mod:`.cost`: whether a load pays, from the load and prefill times the worker measures
  (no torch or vLLM); :mod:`.stats`: the requests' figures in vLLM's connector stats;
- :mod:`.separator`: a separator given as text, checked against the engine's tokenizer;
- :mod:`.blend`, :mod:`.attention`: the blend pass over vLLM's modules and vLLM's CPU
  attention kernel (the pass itself is :mod:`kvblend.blend`'s);
- :mod:`.config`, :mod:`.daemon`, :mod:`.metadata`: the engine checked at start, the
  connection to kvblendd, what the scheduler hands the worker each step;
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that makes the model reachable;
- :mod:`.documents`: :func:`store_documents`, :func:`wait_for_stores`.

Importing this package imports neither torch nor vLLM (vLLM's plugin loader imports
:mod:`.plugin` in every process): the names below are imported when first asked for, as
vLLM's connector factory does (``getattr(module, "KvblendConnector")``).
``import kvblend`` does not import this package.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Where each public name lives (imported on first use).
_EXPORTS = {
    "KvblendConnector": "connector",
    "KvblendMetadata": "metadata",
    "LoadSpec": "metadata",
    "StoreSpec": "metadata",
    "Refused": "config",
    "SUPPORTED_VLLM": "config",
    "default_model_name": "config",
    "model_from_vllm": "config",
    "COPY_ENV": "worker",
    "DUMP_ENV": "worker",
    "FAIL_LOAD_ENV": "worker",
    "store_documents": "documents",
    "wait_for_stores": "documents",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
