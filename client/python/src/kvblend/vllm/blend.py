"""CacheBlend's blend pass over vLLM's own layer modules, in vLLM's worker process.

The building block of blending inside vLLM: given the model vLLM runs (reached through
kvblend's plugin, :mod:`kvblend.vllm.plugin`), a daemon and a prompt of stored chunks and
fresh tokens, :func:`blend_prompt` runs the node's side of CacheBlend with the model's
decoder layer modules (``input_layernorm``, ``self_attn.qkv_proj``, Qwen3's ``self_attn.
q_norm``/``k_norm``, ``self_attn.rotary_emb``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp``; Llama, Mistral, Qwen2, Qwen3:
:mod:`kvblend.blend.arch`) and attention over the whole context with an exact causal mask
in prompt order, the loop :mod:`kvblend.blend.loop` shares with :mod:`kvblend.hf`, and
returns the fused KV.

The connector's side (docs/vllm.md, "CacheBlend"): the blend settings are read by
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
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..blend import arch as _arch
from ..blend import host
from ..blend import loop as _loop
from ..blend.attention import causal_attention
from ..blend.preview import LayerWait, landed_preview, node_selection
from ..client import Client
from ..errors import KvblendError, Unavailable
from ..types import Model
from .attention import (
    PagedAttention,
    VarlenAttention,
    paged_attention_for,
    varlen_attention_for,
)
from .daemon import CLOSE_TIMEOUT_MS, wait_layer
from .layout import PagedCache
from .plan import NODE_SELECTS, BlendLoad
from .plugin import loaded_model

# Under "vllm." so that vLLM's logging configuration applies (as kvblend.vllm's lines).
logger = logging.getLogger(f"vllm.{__name__}")

#: Architectures (and vLLM model classes of the same name) whose decoder layers this pass
#: drives: the Llama family (:mod:`kvblend.blend.arch`).
SUPPORTED_MODELS = tuple(_arch.ARCHITECTURES)
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("qkv_proj", "rotary_emb", "o_proj", "q_size", "kv_size", "head_dim", "scaling")
#: Regions a client keeps between blends (:class:`RegionPool`): at most this many, each
#: for at most this long unused (well under the daemon's ``shm_idle``, 600 s by default,
#: after which it would release them itself), rounded up to this size.
POOL_REGIONS = 4
POOL_IDLE_S = 30.0
POOL_ROUND = 4 << 20


class RegionPool:
    """Shared-memory regions of one client, kept between blends for the next ones.

    A blend lands its context into a region (:meth:`kvblend.Client.region`). A fresh
    region's pages are mapped and zeroed on first touch, by the daemon landing into it and
    by the pass writing its rows: at 1K tokens of SmolLM2 (45 MB) that was 22-24 ms here,
    and its free 3-5 ms more, on every blend. A region given back is kept (at most
    :data:`POOL_REGIONS`, each at most :data:`POOL_IDLE_S` unused) and handed to the next
    blend it is large enough for, its pages already in place (a timer frees the ones
    unused that long while no blend comes). It is not zeroed again: a
    blend writes every row of every layer of its buffer before reading it (the daemon the
    stored rows, the pass its own). The regions die with the client (its close frees
    them), so one pool per client (:func:`regions_of`). A batch that fails frees the
    kept regions too (:func:`_blend_batch`): a daemon restarted, or one whose
    ``shm_idle`` is under :data:`POOL_IDLE_S`, no longer knows a kept region, which fails
    that batch once (the worker retries its requests one at a time on fresh regions;
    under tensor parallelism vLLM recomputes them).
    """

    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        self._idle: list[tuple[float, np.ndarray]] = []  # (given back at, region)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None  # expires kept regions while idle

    def take(self, nbytes: int) -> np.ndarray:
        """A region of at least ``nbytes``: the smallest kept one that fits, else a new one
        (rounded up to :data:`POOL_ROUND`); a refused size first frees the kept ones."""
        client = self._client()
        with self._lock:
            self._expire(client)
            fits = [i for i, (_, r) in enumerate(self._idle) if r.nbytes >= nbytes]
            if fits:
                i = min(fits, key=lambda j: self._idle[j][1].nbytes)
                return self._idle.pop(i)[1]
            size = -(-nbytes // POOL_ROUND) * POOL_ROUND
            try:
                return client.region(size)
            except Unavailable:
                raise
            except KvblendError:
                if not self._idle and size == nbytes:
                    raise
            # the daemon's shm budget: what is kept goes first, then the exact size (the
            # rounding may pass shm_max where the size itself fits)
            self._clear(client)
            return client.region(nbytes)

    def give(self, region: np.ndarray) -> None:
        """Keep a region a blend is done with (the oldest kept one freed past the limit)."""
        client = self._client()
        with self._lock:
            self._idle.append((time.monotonic(), region))
            while len(self._idle) > POOL_REGIONS:
                self._free(client, self._idle.pop(0)[1])
            self._expire(client)

    def _arm(self) -> None:
        """(The lock held.) A timer for the oldest kept region's expiry, none when none is
        kept: an engine left idle frees them too, with no blend to look."""
        if not self._idle:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is None:
            due = self._idle[0][0] + POOL_IDLE_S - time.monotonic()
            self._timer = threading.Timer(max(due, 0.0) + 0.05, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self) -> None:
        client = self._client()
        with self._lock:
            self._timer = None
            self._expire(client)

    def clear(self) -> None:
        """Free every kept region."""
        client = self._client()
        with self._lock:
            self._clear(client)

    def _clear(self, client: Client | None) -> None:
        while self._idle:
            self._free(client, self._idle.pop()[1])
        self._arm()

    def kept(self) -> int:
        """How many regions are kept."""
        return len(self._idle)

    def _expire(self, client: Client | None) -> None:
        """(The lock held.) Free the kept regions past :data:`POOL_IDLE_S`; arm the timer."""
        now = time.monotonic()
        while self._idle and now - self._idle[0][0] > POOL_IDLE_S:
            self._free(client, self._idle.pop(0)[1])
        self._arm()

    @staticmethod
    def _free(client: Client | None, region: np.ndarray) -> None:
        if client is None:
            return  # closed: its regions went with it
        try:
            client.free_region(region)
        except KvblendError:
            pass  # (the daemon's idle release, or gone: nothing left to free)


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def regions_of(client: Client) -> RegionPool:
    """The client's :class:`RegionPool` (made on first use; gone with the client)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(client)
        if pool is None:
            pool = _POOLS[client] = RegionPool(client)
        return pool


class BlendRefused(RuntimeError):
    """The model cannot be blended by this pass; the message says why."""


class VllmLlamaOps:
    """The layer operations of vLLM's Llama-family models (:class:`kvblend.blend.loop.LayerOps`).

    Raises
    ------
    BlendRefused
        A model class other than :data:`SUPPORTED_MODELS` or an option of it the pass
        does not reproduce (:func:`kvblend.blend.arch.for_vllm`), or a layer without the
        parts this pass calls. Under tensor parallelism the modules are the rank's shards
        (its heads; the output projection and the MLP reduce across ranks), so every rank
        runs the pass together (:class:`TensorRanks`).
    """

    def __init__(self, model: Any) -> None:
        try:
            self.arch = _arch.for_vllm(model)
        except _arch.ArchRefused as e:
            raise BlendRefused(str(e)) from None
        self.layers = model.model.layers
        for i, layer in enumerate(self.layers):
            missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
            missing += [f"self_attn.{p}" for p in _ATTN_PARTS if not hasattr(layer.self_attn, p)]
            if missing:
                raise BlendRefused(f"kvblend: decoder layer {i} has no {', '.join(missing)}")
        self.model = model
        self.num_layers = len(self.layers)
        self.device = next(model.parameters()).device
        self.kv_dtype = next(model.parameters()).dtype
        if self.kv_dtype not in host.NP_DTYPES:
            raise BlendRefused(f"kvblend: dtype {self.kv_dtype}; float32, float16 or bfloat16")
        a = self.layers[0].self_attn
        # vLLM's CPU attention kernel where it applies (several times faster than PyTorch's),
        # vLLM's FlashAttention on a GPU, PyTorch's fused attention otherwise
        shape = (self.device, a.num_heads, a.num_kv_heads, a.head_dim, self.kv_dtype)
        self.attention = (
            paged_attention_for(*shape) or varlen_attention_for(*shape) or causal_attention
        )

    #: Test hook (the worker's FAIL_LOAD_ENV with ``layer L``): the pass's attention at
    #: this layer raises, once.
    fail_layer: int | None = None
    #: Test hook (FAIL_LOAD_ENV with ``preview L``): the question or anchored metric's
    #: preview raises at this layer, once (:func:`kvblend.blend.preview.question_attention`).
    fail_preview: int | None = None

    def begin(self, n: int) -> None:
        pass

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def qkv(self, layer: int, h: torch.Tensor, rows: torch.Tensor) -> tuple:
        mod = self.layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(h)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        d = attn.head_dim
        n = x.shape[0]
        if self.arch.qk_norm:  # Qwen3: per head, before RoPE (as Qwen3Attention.forward)
            q, k = _arch.norm_qk(self.arch, attn, q.reshape(n, -1, d), k.reshape(n, -1, d))
            q, k = q.reshape(n, -1), k.reshape(n, -1)
        q, k = attn.rotary_emb(rows, q.contiguous(), k.contiguous())
        return q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)

    def attend(self, layer: int, h, q, keys, values, rows) -> torch.Tensor:
        return self.attend_many(layer, [h], [q], [keys], [values], [rows])[0]

    def attend_many(self, layer: int, hs, qs, keys, values, rows) -> list[torch.Tensor]:
        """Finish the layer for several prompts (lists, one entry a prompt).

        Each attends over its own KV (one kernel call where vLLM's applies); then the
        output projection and the MLP run over all their rows at once.
        """
        a = self.attention_of(layer, qs, keys, values, rows)
        h = self.finish(layer, hs[0] if len(hs) == 1 else torch.cat(hs), a)
        return [h] if len(hs) == 1 else list(torch.split(h, [x.shape[0] for x in hs]))

    def attention_of(self, layer: int, qs, keys, values, rows) -> torch.Tensor:
        """The attention output [sum of n, heads * d] of several prompts (lists, as
        :meth:`attend_many`): the rank's own heads, no collective (under tensor
        parallelism the ranks agree after it, before :meth:`finish` reduces)."""
        if layer == self.fail_layer:
            self.fail_layer = None
            raise RuntimeError(f"kvblend: a failure injected in the blend pass at layer {layer}")
        scaling = self.layers[layer].self_attn.scaling
        if isinstance(self.attention, (PagedAttention, VarlenAttention)):
            return self.attention.many(qs, keys, values, rows, scaling)
        return torch.cat([self.attention(*x, scaling) for x in zip(qs, keys, values, rows)])

    def scaling(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    def finish(self, layer: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: h + o_proj(a), then the MLP's residual."""
        mod = self.layers[layer]
        o, _ = mod.self_attn.o_proj(a)
        h = h + o
        return h + mod.mlp(mod.post_attention_layernorm(h))


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


@dataclass
class TensorRanks:
    """This worker's tensor-parallel group, for a blend pass every rank runs together.

    ``group`` is vLLM's tensor-parallel GroupCoordinator (its ``cpu_group`` carries these
    small collectives); ``heads`` the rank's KV heads (first, count). Implements
    :class:`kvblend.blend.loop.Ranks`, and :meth:`agree_min` for the batch's size.
    """

    group: Any
    heads: tuple[int, int]

    def _reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group.cpu_group)
        return t

    def agree(self, ok: bool) -> bool:
        return int(self._reduce(torch.tensor([0 if ok else 1], dtype=torch.int32)).item()) == 0

    def agree_min(self, n: int) -> int:
        import torch.distributed as dist

        return int(self._reduce(torch.tensor([n], dtype=torch.int64), dist.ReduceOp.MIN).item())

    def total(self, x: np.ndarray) -> np.ndarray:
        """The ranks' x summed, in float64 (a node selection's scores)."""
        return self._reduce(torch.from_numpy(np.array(x, np.float64))).numpy()

    def sum(self, dev: np.ndarray, ok: bool) -> np.ndarray | None:
        t = torch.empty(dev.size + 1, dtype=torch.float32)
        t[0] = 0.0 if ok else 1.0
        t[1:] = torch.from_numpy(np.ascontiguousarray(dev, np.float32))
        self._reduce(t)
        return None if float(t[0]) > 0 else t[1:].numpy()


@dataclass
class BlendJob:
    """One prompt of :func:`blend_prompts` (as :func:`blend_prompt` takes it)."""

    ids: Sequence[int]
    segments: Sequence[tuple]
    ratios: Sequence[float]
    question: Sequence[int] = ()


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

    b = _Batch()
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
            for x in b.sessions[n:]:
                _close_quietly(x, b)
            del b.sessions[n:], b.prompts[n:], b.previews[n:], b.pre_wait[n:], b.pending[n:]
        if b.pending:
            _node_previews(ops, metric, wait, ranks, b)
        try:
            rs = _loop.blend_batch(
                ops, b.prompts, list(check_layers), metric, True, False, wait, ranks
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
            quiet = down or ranks is not None
            stats = [_close_quietly(x, b) if quiet else x.close() for x in b.sessions]
            b.sessions = []
        out = []
        err = None
        try:
            for i, (p, r, st, t_pre, t_wait) in enumerate(
                zip(b.prompts, rs, stats, b.previews, b.pre_wait)
            ):
                if p.recompute is not None:
                    r.selections.append(p.recompute)
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
            _close_quietly(x, b)
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


@dataclass
class _Batch:
    """What :func:`_prepare` opened for a batch (closed and freed by its caller)."""

    regions: list = field(default_factory=list)
    sessions: list = field(default_factory=list)
    prompts: list = field(default_factory=list)
    previews: list = field(default_factory=list)  # each prompt's preview seconds
    pre_wait: list = field(default_factory=list)  # of each preview, seconds waiting for layers
    #: the question and anchored metrics' previews, run by _node_previews: per prompt
    #: (chunk spans, question ids, their positions, ratio)
    pending: list = field(default_factory=list)
    unclean: bool = False  # a session's close failed: its region may still be written


def _node_previews(
    ops: VllmLlamaOps,
    metric: str,
    wait: Callable[[Any, int], None],
    ranks: TensorRanks | None,
    b: _Batch,
) -> None:
    """Run the question or anchored metric's preview of each prompt of the batch, and
    give each prompt the node's selection. Under tensor parallelism every rank runs the
    same previews over its heads (its shards of the modules, whose collectives keep the
    ranks in step; the ranks agree after each layer's own work, its wait for the landed
    rows included, before the layer's collectives), and the selection is by A summed over
    every rank's heads."""
    for i, (spans, q, qpos, ratio) in enumerate(b.pending):
        p = b.prompts[i]
        t = time.perf_counter()
        ready = LayerWait(p.sess, wait)
        ops.begin(p.ids.size + q.size)
        p.attention, p.recompute = node_selection(
            ops,
            host.tensor(p.buf, ops.kv_dtype),
            p.cached,
            spans,
            q,
            qpos,
            metric,
            ratio,
            ready,
            None if ranks is None else ranks.total,
            None if ranks is None else functools.partial(_loop.agreed, ranks),
        )
        b.pre_wait[i] = ready.seconds
        b.previews[i] = time.perf_counter() - t


def _prepare(
    ops: VllmLlamaOps,
    client: Client,
    spec: Model,
    jobs: Sequence[BlendJob],
    check_layers: Sequence[int],
    metric: str,
    wait: Callable[[Any, int], None],
    ranks: TensorRanks | None,
    b: _Batch,
) -> None:
    """A region, a landing session (and a preview) for each job the daemon grants a region."""
    np_dtype = host.np_dtype(ops.kv_dtype)
    heads = ranks.heads if ranks is not None else None
    for job in jobs:
        ids = np.asarray(job.ids, np.int64)
        shape = spec.kv_shape(ids.size)
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
        cached = np.zeros(ids.size, bool)
        starts = [int(seg[1]) for seg in job.segments] + [ids.size]
        for i, seg in enumerate(job.segments):  # a chunk runs up to the next segment
            if not _fresh(seg):
                cached[starts[i] : starts[i + 1]] = True
        a, t_pre = None, time.perf_counter()
        q = np.asarray(job.question, np.int64)
        rows = np.flatnonzero(cached)
        qpos = ids.size + np.arange(q.size)
        if metric in NODE_SELECTS:
            # a reuse-only landing session (the rank's heads under TP): the preview
            # (_node_previews, once every prompt of the batch has its session) reads
            # each layer as it lands, then the pass recomputes the fresh tokens and the
            # chunk tokens the question reads most at every layer over the stored rows
            sess = client.fuse_open_into(
                spec.name, job.segments, buf[:, 0], buf[:, 1], heads=heads
            )
            b.sessions.append(sess)
            spans = [
                (starts[i], starts[i + 1] - starts[i])
                for i, seg in enumerate(job.segments)
                if not _fresh(seg)
            ]
            b.prompts.append(_loop.Prompt(sess, buf, ids, cached))
            b.pending.append((spans, q, qpos, job.ratios[-1]))
            b.pre_wait.append(0.0)  # both set by _node_previews
        else:
            if metric == "attention" and check_layers:
                ops.begin(ids.size + q.size)
                a, landed = landed_preview(
                    client, spec.name, job.segments, buf, ops, rows, q, qpos, wait
                )
                b.pre_wait.append(landed.get("preview_wait_ms", 0.0) / 1000)
            else:
                b.pre_wait.append(0.0)
            b.sessions.append(
                client.fuse_open_into(
                    spec.name,
                    job.segments,
                    buf[:, 0],
                    buf[:, 1],
                    list(check_layers),
                    list(job.ratios),
                    metric,
                    heads=heads,
                )
            )
            b.prompts.append(_loop.Prompt(b.sessions[-1], buf, ids, cached, a))
        b.previews.append(time.perf_counter() - t_pre)


def _shifted(
    sink: Callable[[int, torch.Tensor], None], first: int, i: int, kv: torch.Tensor
) -> None:
    sink(first + i, kv)


def _close_quietly(sess: Any, b: _Batch | None = None) -> dict:
    """Close a session; after a daemon failure its error is the pass's, not the close's
    (a failed close marks ``b`` unclean: its regions are not kept)."""
    try:
        return sess.close()
    except KvblendError:
        if b is not None:
            b.unclean = True
        return {}


def _fresh(seg: tuple) -> bool:
    """Whether a fuse segment is fresh tokens ``(count, pos)`` rather than ``(hash, pos)``."""
    return isinstance(seg[0], int)


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
    its block ids (vLLM holds the ones before). Returns each request's selections and
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
                "waiting for landed layers)",
                len(ld.ids),
                sels[-1].size if sels else int(sum(s[0] for s in ld.segments if _fresh(s))),
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
            )
            out[i] = (sels, stats)
    return out
