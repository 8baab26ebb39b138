"""CacheBlend's node side, independent of any engine: the blend pass over a model's layers.

- :mod:`~kvblend.blend.driver`: the one driver from prompts to the layer loop (sessions,
  previews, closes) that :mod:`kvblend.hf` and :mod:`kvblend.vllm.blend` both call;
- :mod:`~kvblend.blend.metrics`: the selection metrics, defined once;
- :mod:`~kvblend.blend.loop`: the layer loop over an open fuse session
  (:func:`~kvblend.blend.loop.blend_layers`) and the layer operations it asks of a model
  (:class:`~kvblend.blend.loop.LayerOps`);
- :mod:`~kvblend.blend.attention`: the attention of some rows over a layer's KV, causal
  in prompt order;
- :mod:`~kvblend.blend.preview`: the question's preview for the attention metric;
- :mod:`~kvblend.blend.arch`: what each architecture (the Llama family, Phi-3, Qwen3-MoE,
  Gemma 3) asks of the pass;
- :mod:`~kvblend.blend.host`: host KV buffers as torch tensors and back (bfloat16 too).

Used by :mod:`kvblend.hf` (transformers' modules) and :mod:`kvblend.vllm` (vLLM's). This
package imports nothing itself: ``driver``, ``loop``, ``attention``, ``preview`` and ``host`` import torch when
imported, ``arch`` and ``metrics`` only the standard library; ``import kvblend`` imports none of them.
"""
