"""A v1 KV connector that transfers nothing and writes down what vLLM hands it.

``ProbeConnector`` implements the abstract methods of vLLM's
``KVConnectorBase_V1`` as no-ops (no external hits, nothing saved) and appends
one JSON object per observation to the file named by
``kv_connector_extra_config["facts_path"]``: the KV-cache tensors given to
``register_kv_caches``, the requests seen by the scheduler side, the scheduler
output, the forward context and the per-layer calls. The blocks of layer 0
that the first step wrote are also saved (``torch.save``) under ``dump_path``
with that step's slot mapping, so that tests/engine/smoke.py can tell where
in a block the model's keys and values are. It exists to learn the interface, not to be reused.

Loaded by vLLM as ``kv_connector="ProbeConnector"``,
``kv_connector_module_path="probe_connector"`` with tests/engine on the path.
"""

import dataclasses
import json
import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

# Observations of one kind past this many are counted, not written.
MAX_PER_EVENT = 6


class ProbeMetadata(KVConnectorMetadata):
    """Empty metadata: the probe sends nothing from scheduler to worker."""

    def __init__(self, step: int):
        self.step = step


def tensor_facts(t):
    """Shape, dtype, strides and addresses of a tensor, JSON-ready."""
    storage = t.untyped_storage()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "stride": list(t.stride()),
        "device": str(t.device),
        "contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": storage.data_ptr(),
        "storage_nbytes": storage.nbytes(),
        "storage_offset": t.storage_offset(),
    }


def short(value, depth=0):
    """A JSON-ready summary of any value: tensors by facts, small values in full."""
    if isinstance(value, torch.Tensor):
        out = tensor_facts(value)
        if value.numel() <= 64:
            out["values"] = value.tolist()
        return out
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        out = [short(v, depth + 1) for v in items[:16]]
        if len(items) > 16:
            out.append(f"... {len(items)} items")
        return out
    if isinstance(value, dict):
        keys = list(value)
        out = {str(k): short(value[k], depth + 1) for k in keys[:16]}
        if len(keys) > 16:
            out["..."] = f"{len(keys)} keys"
        return out
    if depth >= 2:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    return {"type": f"{type(value).__module__}.{type(value).__qualname__}",
            "fields": fields_of(value, depth + 1)}


def fields_of(obj, depth=0):
    """The public attributes of an object (dataclass fields, slots or __dict__), summarised."""
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__"):
        names = list(vars(obj))
    else:
        names = [n for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
    out = {}
    for name in names:
        if name.startswith("__"):
            continue
        try:
            out[name] = short(getattr(obj, name), depth)
        except Exception as e:  # a property that refuses to be read is a fact too
            out[name] = f"<unreadable: {type(e).__name__}>"
    return out


class ProbeConnector(KVConnectorBase_V1):
    """No-op connector that logs the facts of each call (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.facts_path = extra["facts_path"]
        self.dump_path = extra.get("dump_path")
        self.counts: dict[str, int] = {}
        self.step = 0
        self.layer_names: list[str] = []
        self.first_layer_ptr = None
        self.dumped = False
        self.log("init", {
            "role": role.name,
            "pid": os.getpid(),
            "cache_block_size": vllm_config.cache_config.block_size,
            "kv_cache_config": short(kv_cache_config),
            "kv_transfer_config": short(vllm_config.kv_transfer_config),
        })

    def log(self, event, facts):
        n = self.counts.get(event, 0)
        self.counts[event] = n + 1
        if n >= MAX_PER_EVENT:
            return
        record = {"event": event, "n": n, "role": self.role.name, "pid": os.getpid(),
                  "t": time.time(), **facts}
        with open(self.facts_path, "a") as f:
            f.write(json.dumps(record, default=repr) + "\n")

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        layers = []
        for name, t in kv_caches.items():
            layers.append({"name": name, **tensor_facts(t)})
        ptrs = [x["data_ptr"] for x in layers]
        storages = {x["storage_ptr"] for x in layers}
        self.layer_names = list(kv_caches)
        self.first_layer_ptr = ptrs[0] if ptrs else None
        self.log("register_kv_caches", {
            "num_layers": len(layers),
            "layers": layers,
            "ptr_diffs": sorted({b - a for a, b in zip(ptrs, ptrs[1:])}),
            "distinct_storages": len(storages),
            "one_allocation": len(storages) == 1,
            "type": type(kv_caches).__name__,
        })

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        attn = getattr(forward_context, "attn_metadata", None)
        facts = {"kwargs": sorted(kwargs), "forward_context": fields_of(forward_context, 1),
                 "attn_metadata_type": type(attn).__name__}
        if isinstance(attn, dict) and attn:
            first = next(iter(attn.values()))
            facts["attn_metadata_keys"] = list(attn)[:4] + [f"... {len(attn)} keys"]
            facts["attn_metadata_one_object"] = len({id(v) for v in attn.values()}) == 1
            facts["attn_metadata_first"] = short(first)
        elif isinstance(attn, list):
            facts["attn_metadata_list_len"] = len(attn)
        layers = getattr(forward_context, "no_compile_layers", None) or {}
        if self.layer_names and self.layer_names[0] in layers:
            # the CPU attention kernel set it: "vec" (float32 on x86), "amx" (bf16), ...
            facts["attn_isa"] = getattr(layers[self.layer_names[0]], "isa", None)
        facts["metadata"] = short(self._connector_metadata)
        self.log("start_load_kv", facts)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.log("wait_for_layer_load", {"layer_name": layer_name, "step": self.step})

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        facts = {"layer_name": layer_name, "kv_layer": tensor_facts(kv_layer),
                 "kwargs": sorted(kwargs), "attn_metadata_type": type(attn_metadata).__name__,
                 "step": self.step}
        if self.counts.get("save_kv_layer", 0) == 0:
            facts["attn_metadata"] = short(attn_metadata)
        self.log("save_kv_layer", facts)
        if not self.dumped and self.dump_path and self.layer_names \
                and layer_name == self.layer_names[0]:
            self.dump_layer(kv_layer, attn_metadata)

    def dump_layer(self, kv_layer, attn_metadata):
        """Save this step's slots and the raw contents of the layer-0 blocks they fall in."""
        n = int(attn_metadata.num_actual_tokens)
        slots = attn_metadata.slot_mapping[:n].to(torch.long)
        bs = kv_layer.shape[2]
        blocks = torch.unique(slots // bs)
        torch.save({
            "slot_mapping": slots.clone(),
            "query_start_loc": attn_metadata.query_start_loc.clone(),
            "block_size": bs,
            "blocks": blocks,
            "raw": kv_layer[blocks].clone(),  # [len(blocks), heads, block_size, 2*head_dim]
        }, self.dump_path)
        self.dumped = True

    def wait_for_save(self):
        self.log("wait_for_save", {"step": self.step,
                                   "layer_loads_seen": self.counts.get("wait_for_layer_load", 0),
                                   "layer_saves_seen": self.counts.get("save_kv_layer", 0)})
        self.step += 1

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        prompt = list(request.prompt_token_ids or [])
        self.log("get_num_new_matched_tokens", {
            "request_id": request.request_id,
            "num_computed_tokens": num_computed_tokens,
            "prompt_len": len(prompt),
            "prompt_head": prompt[:12],
            "kv_transfer_params": request.kv_transfer_params,
            "extra_args": getattr(request.sampling_params, "extra_args", None),
            "request_fields": sorted(k for k in vars(request) if not k.startswith("__")),
            "block_hashes_len": len(getattr(request, "block_hashes", []) or []),
        })
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.log("update_state_after_alloc", {
            "request_id": request.request_id,
            "block_ids": short(blocks.get_block_ids()),
            "num_external_tokens": num_external_tokens,
            "blocks_type": type(blocks).__name__,
        })

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        new_reqs = [fields_of(r, 1) for r in scheduler_output.scheduled_new_reqs]
        self.log("build_connector_meta", {
            "fields": sorted(f.name for f in dataclasses.fields(scheduler_output)),
            "new_block_ids_to_zero": getattr(scheduler_output, "new_block_ids_to_zero", "ABSENT"),
            "num_scheduled_tokens": dict(scheduler_output.num_scheduled_tokens),
            "total_num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
            "scheduled_new_reqs": new_reqs,
            "scheduled_cached_reqs": fields_of(scheduler_output.scheduled_cached_reqs, 1),
            "finished_req_ids": sorted(scheduler_output.finished_req_ids),
        })
        meta = ProbeMetadata(self.step)
        self.step += 1
        return meta

    def request_finished(self, request, block_ids: list[int]):
        self.log("request_finished", {"request_id": request.request_id,
                                      "block_ids": short(block_ids),
                                      "kv_transfer_params": request.kv_transfer_params})
        return False, None
