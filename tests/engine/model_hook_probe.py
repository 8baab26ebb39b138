"""A v1 KV connector that transfers nothing and checks what kvblend's model hook hands it.

In each process it asks ``kvblend.vllm.plugin.loaded_model`` for the model of its
``vllm_config`` and appends one JSON object per observation to
``kv_connector_extra_config["facts_path"]``: in the worker (``register_kv_caches``) the
model's class, the kvblend package it came from, whether the attention module at each KV
cache's name inside that model is the very module vLLM registered for the layer, and the
children of a decoder layer (what a blend pass calls); at the first ``start_load_kv``,
whether the forward context's attention modules are that model's; in the scheduler
process, the error ``loaded_model`` raises where no model was loaded. With
``kv_connector_extra_config["blend"]`` (endpoint, model name, prompt ids, fuse segments,
check layers, ratios, metric, out path), the first ``start_load_kv`` also runs
``kvblend.vllm.blend.blend_prompt`` over that model against the daemon and saves the
fused KV and selections (``.npz``) with the seconds it took; with ``question`` (how many
of the prompt's last tokens are the question) also the connector's way with the
attention metric: the context up to the question blended with the question previewed,
its selection and A saved.
Used by test_vllm_model_hook.py only.
"""

import json
import os
import time
from typing import Any

import numpy as np

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

import kvblend
from kvblend.vllm import plugin


class _Meta(KVConnectorMetadata):
    pass


class ModelHookProbe(KVConnectorBase_V1):
    """No-op connector writing down what kvblend's model hook gives (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.facts_path = extra["facts_path"]
        self.blend = extra.get("blend")
        self.model = None
        self.checked_forward = False
        if role.name == "SCHEDULER":
            try:
                plugin.loaded_model(vllm_config)
                self.log("scheduler", {"error": None})
            except plugin.ModelUnreachable as e:
                self.log("scheduler", {"error": str(e)})

    def log(self, event, facts):
        with open(self.facts_path, "a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), **facts}) + "\n")

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        facts: dict[str, Any] = {"kvblend_file": kvblend.__file__}
        try:
            self.model = plugin.loaded_model(self._vllm_config)
        except plugin.ModelUnreachable as e:
            self.log("worker", {**facts, "error": str(e)})
            return
        static = self._vllm_config.compilation_config.static_forward_context
        same = [self.model.get_submodule(name) is static.get(name) for name in kv_caches]
        layer0 = self.model.get_submodule("model.layers.0")
        facts.update(
            error=None,
            model_class=f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            kv_cache_names=len(kv_caches),
            same_attention_modules=sum(same),
            decoder_layers=len(self.model.model.layers),
            layer_children=sorted(n for n, _ in layer0.named_children()),
            attn_children=sorted(n for n, _ in layer0.self_attn.named_children()),
        )
        self.log("worker", facts)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.checked_forward or self.model is None:
            return
        self.checked_forward = True
        layers = forward_context.no_compile_layers
        same = sum(self.model.get_submodule(n) is m for n, m in layers.items()
                   if n.startswith("model.layers."))
        self.log("forward", {"attention_layers": len(layers), "same": same})
        if self.blend:
            self.run_blend(self.blend)

    def run_blend(self, b):
        from kvblend.vllm import blend

        segs = [(bytes.fromhex(x), p) if isinstance(x, str) else (x, p) for x, p in b["segments"]]
        try:
            with kvblend.Client(b["endpoint"], timeout_ms=120000) as c:
                spec = c.model_get(b["name"])
                t0 = time.perf_counter()
                kv, sels, stats = blend.blend_prompt(
                    self.model, c, spec, b["ids"], segs, b["checks"], b["ratios"], b["metric"])
                secs = time.perf_counter() - t0
                att, q = {}, b.get("question", 0)
                if q:
                    n = len(b["ids"]) - q
                    _, sa, st = blend.blend_prompt(
                        self.model, c, spec, b["ids"][:n], segs[:-1], b["checks"], b["ratios"],
                        "attention", b["ids"][n:])
                    att = {"attention": st["attention"], "att_sel0": sa[0]}
            np.savez(b["out"], kv=kv.numpy(), **{f"sel{i}": x for i, x in enumerate(sels)}, **att)
            self.log("blend", {"error": None, "seconds": secs, "tokens": len(b["ids"]),
                               "question": q, "preview_ms": st["preview_ms"] if q else 0.0})
        except Exception as e:  # noqa: BLE001 - reported to the test, not raised into vLLM
            self.log("blend", {"error": f"{type(e).__name__}: {e}"})

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        pass

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return _Meta()
