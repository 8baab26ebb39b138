"""CacheBlend's blend pass over vLLM's own layer modules, in vLLM's worker process.

By concern: the layer operations are :mod:`kvblend.vllm.ops`, the tensor-parallel group
:mod:`kvblend.vllm.ranks`, the regions kept between blends :mod:`kvblend.vllm.regions`,
the driver shared with :mod:`kvblend.hf` :mod:`kvblend.blend.driver`; this module is the
pass: batches, their regions and failures, and the writes into vLLM's cache.

The building block of blending inside vLLM: given the model vLLM runs (reached through
kvblend's plugin, :mod:`kvblend.vllm.plugin`), a daemon and a prompt of stored chunks and
fresh tokens, :func:`blend_prompt` runs the node's side of CacheBlend with the model's
decoder layer modules (``input_layernorm``, ``self_attn.qkv_proj``, Qwen3's ``self_attn.
q_norm``/``k_norm``, ``self_attn.rotary_emb``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp``; Llama, Mistral, Qwen2, Qwen3:
:mod:`kvblend.blend.arch`) and attention over the whole context with an exact causal mask
in prompt order, the loop :mod:`kvblend.blend.loop` shares with :mod:`kvblend.hf`, and
returns the fused KV.

The connector's side (docs/vllm-reference.md, "CacheBlend"): the blend settings are read by
:mod:`kvblend.vllm.config`, the scheduler's claim (the context up to the end of the last
stored chunk found) is the planner's (:mod:`kvblend.vllm.plan`); :func:`worker_model` and
:func:`load_blends` are the worker's (blend a step's requests in one pass, then write
the fused rows into vLLM's paged cache). Tested in real engines by tests/engine/test_vllm_model_hook.py and
test_vllm_blend.py against kvblend.hf's blend of the same prompt.
"""


from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..blend import driver as _driver
from ..blend import host
from ..blend import loop as _loop
from ..blend.driver import Job as BlendJob
from ..client import Client
from ..errors import KvblendError, Unavailable
from ..types import Model
from .daemon import CLOSE_TIMEOUT_MS, wait_layer
from .layout import PagedCache
from .ops import SUPPORTED_MODELS, BlendRefused, VllmLlamaOps
from .plan import BlendLoad
from .plugin import loaded_model
from .ranks import TensorRanks
from .regions import RegionPool, regions_of

__all__ = [
    "SUPPORTED_MODELS",
    "BlendJob",
    "BlendRefused",
    "RegionPool",
    "TensorRanks",
    "VllmLlamaOps",
    "blend_prompt",
    "blend_prompts",
    "load_blends",
    "regions_of",
    "worker_model",
]

# Under "vllm." so that vLLM's logging configuration applies (as kvblend.vllm's lines).
logger = logging.getLogger(f"vllm.{__name__}")


@torch.no_grad()
def blend_prompt(
    model: Any,
    client: Client,
    spec: Model,
    ids: Sequence[int],
    segments: Sequence[tuple],
    check_layers: Sequence[int],
    ratios: Sequence[float],
    metric: str = "value",
    question: Sequence[int] = (),
    wait_s: float = 120.0,
) -> tuple[torch.Tensor, list[np.ndarray], dict]:
    """Blend a prompt over vLLM's model with a landing session; return the fused KV.

    Parameters
    ----------
    model : torch.nn.Module
        The model vLLM runs (``kvblend.vllm.plugin.loaded_model``).
    client : Client
        The daemon, on an ``ipc://`` endpoint (the request's KV lands in a region).
    spec : Model
        The model as registered in the daemon (its chunks are stored under that name).
    ids : sequence of int
        The prompt's tokens (the context to blend: up to the last fresh span).
    segments : sequence of tuple
        The fuse segments in prompt order, one after another from position 0: ``(hash,
        pos)`` for a stored chunk, ``(count, pos)`` for fresh tokens.
    check_layers, ratios, metric
        As :meth:`Client.fuse_open_into`.
    question : sequence of int
        The attention metric's question: the prompt's tokens right after ``ids`` (what
        vLLM computes after the blend). Before the pass they run alone through every
        layer over the stored chunks re-rotated (landed by a reuse-only session first)
        and give A (:func:`kvblend.blend.preview.question_attention`), which goes to
        the daemon with the first check layer.
    wait_s : float
        The longest wait for one landed layer (the connector's ``timeout_ms``); a daemon
        found gone ends the wait at once (:func:`kvblend.vllm.daemon.wait_layer`).

    Returns
    -------
    (kv, selections, stats)
        The fused KV [layers, 2, N, kv_heads, head_dim] (CPU, the model's dtype), the
        selection after each check layer, the daemon's session statistics; with the
        attention metric also ``stats["attention"]`` (A, [chunk tokens, kv_heads]) and
        ``stats["preview_ms"]`` (landing and preview).

    Raises
    ------
    ValueError
        The attention metric with check layers and no question tokens.
    """
    job = BlendJob(ids, segments, ratios, question)
    return blend_prompts(model, client, spec, [job], check_layers, metric, wait_s)[0]



@torch.no_grad()
def blend_prompts(
    model: Any,
    client: Client,
    spec: Model,
    jobs: Sequence[BlendJob],
    check_layers: Sequence[int],
    metric: str = "value",
    wait_s: float = 120.0,
    sink: Callable[[int, torch.Tensor], None] | None = None,
    ranks: TensorRanks | None = None,
    fail_layer: tuple[str, int] | None = None,
) -> list[tuple[torch.Tensor | None, list[np.ndarray], dict]]:
    """Blend several prompts in one pass over the layers (:func:`kvblend.blend.loop.blend_batch`).

    Returns what :func:`blend_prompt` returns, for each prompt, in order.

    Every prompt has its own region and landing session, all open before the first
    layer; the prompts share the check layers and the metric (each has its ratios). A
    region the daemon refuses (its ``shm_max``) ends the batch there: the prompts after
    it run in the next pass. The daemon gone or silent fails the whole call.

    ``sink(i, kv)``, when given, is called with prompt i's fused KV where it lies (in the
    region, valid only during the call) instead of returning a copy (``kv`` is None).

    ``ranks``: under tensor parallelism, every rank calls this with the same jobs; each
    lands and blends its KV heads (``kv`` then holds those), the ranks select together,
    and a batch runs as many prompts as every rank got regions for. ``fail_layer``: a
    test hook, ``("layer", L)`` (:attr:`VllmLlamaOps.fail_layer`) or ``("preview", L)``
    (:attr:`VllmLlamaOps.fail_preview`).
    """
    ops = VllmLlamaOps(model)
    where, at = fail_layer if fail_layer is not None else (None, None)
    ops.fail_layer = at if where == "layer" else None
    ops.fail_preview = at if where == "preview" else None
    out: list = []
    while len(out) < len(jobs):
        first = len(out)
        put = None if sink is None else functools.partial(_shifted, sink, first)
        out += _blend_batch(
            ops, client, spec, jobs[first:], check_layers, metric, wait_s, put, ranks
        )
    return out


def _blend_batch(
    ops: VllmLlamaOps,
    client: Client,
    spec: Model,
    jobs: Sequence[BlendJob],
    check_layers: Sequence[int],
    metric: str,
    wait_s: float,
    sink: Callable[[int, torch.Tensor], None] | None,
    ranks: TensorRanks | None = None,
) -> list[tuple[torch.Tensor | None, list[np.ndarray], dict]]:
    """Blend the first prompts of ``jobs`` whose regions the daemon grants (one at least)."""
    endpoint = client.endpoint
    if ranks is not None:
        if metric == "attention":
            raise ValueError("kvblend: metric 'attention' under tensor parallelism (its "
                             "score weighs each head's deviation by that head's A)")
        spec = dataclasses.replace(spec, num_kv_heads=ranks.heads[1])  # the rank's buffers

    def wait(sess: Any, layer: int) -> None:
        wait_layer(sess, layer, wait_s, endpoint)

    b = _driver.Batch()
    done = down = False
    try:
        err: BaseException | None = None
        try:
            _prepare(ops, client, spec, jobs, check_layers, metric, wait, ranks, b)
        except Exception as e:  # noqa: BLE001 - agreed on by the ranks, then raised
            if ranks is None:
                raise
            err = e
        if ranks is not None:
            # every rank runs as many prompts as the one with the fewest regions
            n = ranks.agree_min(0 if err is not None else len(b.prompts))
            if n == 0:
                raise err if err is not None else _loop.RankFailed(
                    "kvblend: another tensor-parallel rank could not open its blends"
                )
            b.keep(n, functools.partial(_driver.close_quietly, b=b))
        if b.pending:
            _driver.node_previews(
                ops,
                metric,
                b,
                wait,
                None if ranks is None else ranks.total,
                None if ranks is None else functools.partial(_loop.agreed, ranks),
            )
        try:
            # vLLM computes the logits from its own forward: the pass leaves the KV only
            rs = _loop.blend_batch(
                ops, b.prompts, list(check_layers), metric, True, False, wait, ranks,
                outputs="none",
            )
        except (Unavailable, TimeoutError):
            # the daemon is gone or not answering: the closes below must not each wait
            # the whole timeout, and their errors are this one's
            down = True
            client.set_timeout(CLOSE_TIMEOUT_MS)
            raise
        finally:
            # under TP a close that fails on one rank must not take it out of step with
            # the others (its layers are in place: the pass waited for each)
            stats = _driver.close_all(b, quiet=down or ranks is not None)
        out = []
        err = None
        try:
            for i, (p, r, st, t_pre, t_wait) in enumerate(
                zip(b.prompts, rs, stats, b.previews, b.pre_wait)
            ):
                if p.recompute is not None:
                    r.selections.append(p.recompute)
                st["phases_ms"] = {k: v * 1000 for k, v in r.phases.items()}  # the batch's
                if p.attention is not None:
                    st.update(
                        attention=p.attention,
                        preview_ms=t_pre * 1000,
                        preview_wait_ms=t_wait * 1000,
                    )
                kv = host.tensor(p.buf, ops.kv_dtype)
                if sink is not None:
                    sink(i, kv)
                out.append((kv.clone() if sink is None else None, r.selections, st))
        except Exception as e:  # noqa: BLE001 - agreed on by the ranks, then raised
            if ranks is None:
                raise
            err = e
        if ranks is not None:
            # the batch's last collective: a rank that failed after the pass fails them all
            _loop.agreed(ranks, err)
        done = True
        return out
    except (Unavailable, TimeoutError):
        down = True
        client.set_timeout(CLOSE_TIMEOUT_MS)  # (the preview's landing, the closes) as above
        raise
    finally:
        for x in b.sessions:  # opened before a failure: closed without a word
            if x is not None:
                _driver.close_quietly(x, b)
        pool = regions_of(client)
        if done and not b.unclean:
            for region in b.regions:  # every session closed: kept for the next blends
                pool.give(region)
        else:
            # a failed batch gives its regions back to the daemon (a session whose close
            # failed might still be landing into its region), and the kept ones too: one
            # of them may be what failed (released by a daemon whose shm_idle is shorter
            # than POOL_IDLE_S), and the worker's retry one at a time takes fresh ones
            # (the failure is what the caller hears of, not a free that fails after it)
            pool.clear()
            for region in b.regions:
                try:
                    client.free_region(region)
                except KvblendError:
                    pass


def _prepare(
    ops: VllmLlamaOps,
    client: Client,
    spec: Model,
    jobs: Sequence[BlendJob],
    check_layers: Sequence[int],
    metric: str,
    wait: Callable[[Any, int], None],
    ranks: TensorRanks | None,
    b: _driver.Batch,
) -> None:
    """A region and a landing session (and a preview) for each job the daemon grants a
    region (:func:`kvblend.blend.driver.open_job`)."""
    np_dtype = host.np_dtype(ops.kv_dtype)
    heads = ranks.heads if ranks is not None else None
    for job in jobs:
        shape = spec.kv_shape(len(job.ids))
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        try:
            b.regions.append(regions_of(client).take(nbytes))
        except Unavailable:
            raise
        except KvblendError:
            if not b.regions:
                raise
            break  # the daemon's shm_max: the rest in the next pass
        buf = b.regions[-1][:nbytes].view(np_dtype).reshape(shape)
        _driver.open_job(ops, client, spec.name, job, buf, check_layers, metric, b, wait, heads)


def _shifted(
    sink: Callable[[int, torch.Tensor], None], first: int, i: int, kv: torch.Tensor
) -> None:
    sink(first + i, kv)



def _gather(
    cache: PagedCache, block_ids: Sequence[int], n: int, layer: int, out: np.ndarray
) -> None:
    """A layer's K and V of a request's first n positions, read from vLLM's cache."""
    cache.gather(layer, block_ids, n, out)


def worker_model(vllm_config: Any) -> Any:
    """Return the model vLLM runs in this worker, checked for the blend pass.

    Raises
    ------
    ModelUnreachable, BlendRefused
        With the message to refuse the start with.
    """
    model = loaded_model(vllm_config)
    VllmLlamaOps(model)  # refuses what the pass cannot drive
    return model


def load_blends(
    model: Any,
    client: Client,
    spec: Model,
    loads: Sequence[tuple[BlendLoad, Sequence[int]]],
    cache: PagedCache,
    wait_s: float = 120.0,
    ranks: TensorRanks | None = None,
    fail_layer: tuple[str, int] | None = None,
) -> list[tuple[list[np.ndarray], dict]]:
    """Blend requests' contexts, batched, and write the fused rows into vLLM's paged cache.

    ``loads``: each request's :class:`BlendLoad` and its vLLM block ids. Requests with the
    same check layers and metric run in one pass (:func:`blend_prompts`). ``cache`` holds
    the worker's views of vLLM's cache (:class:`kvblend.vllm.layout.PagedCache`); a
    request's rows go to prompt positions ``load.skip`` .. ``len(load.ids) - 1`` through
    its block ids (vLLM holds the ones before: its prefix-cache hits, which the pass reads
    from its cache instead of computing them, where the metric has no check layer). Returns each request's selections and
    the daemon's statistics, in order. ``wait_s``: the longest wait for one landed layer.
    Any failure fails the call (the caller may run the requests one at a time). ``ranks``:
    under tensor parallelism every rank calls it with the same loads, and each writes its
    heads (:func:`blend_prompts`); a failure on one rank fails the call on all.
    ``fail_layer``: a test hook, ``("layer", L)``: the pass fails at layer L, or
    ``("preview", L)``: the preview does (once; :func:`blend_prompts`).
    """
    out: list = [None] * len(loads)
    groups: dict[tuple, list[int]] = {}
    for i, (ld, _) in enumerate(loads):
        groups.setdefault((tuple(ld.config.check_layers), ld.config.metric), []).append(i)
    for (checks, metric), idx in groups.items():
        t0 = time.perf_counter()
        writes = [0.0]

        def sink(j: int, kv: torch.Tensor, idx: list[int] = idx, writes: list = writes) -> None:
            t = time.perf_counter()
            ld, block_ids = loads[idx[j]]
            cache.write(block_ids, ld.skip, kv[:, :, ld.skip :])  # vLLM has the rows before
            writes[0] += time.perf_counter() - t

        jobs = [
            BlendJob(
                loads[i][0].ids,
                loads[i][0].segments,
                loads[i][0].config.ratios,
                loads[i][0].question,
                # vLLM's prefix-cache hits: read from its cache, not computed again
                given=loads[i][0].skip,
                fill=functools.partial(_gather, cache, loads[i][1], loads[i][0].skip),
            )
            for i in idx
        ]
        res = blend_prompts(
            model, client, spec, jobs, checks, metric, wait_s, sink, ranks, fail_layer
        )
        fail_layer = None
        secs = time.perf_counter() - t0
        for i, (_, sels, stats) in zip(idx, res):
            ld = loads[i][0]
            logger.info(
                "kvblend: blend of %d tokens (%d recomputed after layer %d): pass %.3f s for "
                "%d requests (daemon: session %.0f ms, load %.1f ms, landing %.1f ms, compute "
                "%.2f ms), cache write %.3f s; metric %s, preview %.0f ms (%.0f ms of it "
                "waiting for landed layers); pass phases ms: %s",
                len(ld.ids),
                sels[-1].size if sels else ld.fresh_tokens(),
                checks[-1] if checks else -1,
                secs - writes[0],
                len(idx),
                stats.get("lifetime_ms", float("nan")),
                stats.get("load_ms", float("nan")),
                stats.get("land_ms", float("nan")),
                stats.get("compute_ms", float("nan")),
                writes[0],
                metric,
                stats.get("preview_ms", 0.0),
                stats.get("preview_wait_ms", 0.0),
                " ".join(f"{k} {v:.1f}" for k, v in stats.get("phases_ms", {}).items()),
            )
            out[i] = (sels, stats)
    return out
