"""The node's side of CacheBlend, one layer at a time, over any model's layer operations.

Shared by :mod:`kvblend.hf` (transformers' modules) and :mod:`kvblend.vllm.blend` (vLLM's
modules): both hand :func:`blend_layers` an object with the model's per-layer operations
and an open fuse session, and get back the hidden states of the rows still computed after
the last layer. The session does the rest (re-rotation of the stored chunks, the selection
at check layers, the merge). Imports torch; ``import kvblend`` does not import it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from . import host


class LayerOps(Protocol):
    """What :func:`blend_layers` needs of a model (one decoder layer at a time).

    ``device``: where the model computes; ``kv_dtype``: the torch dtype of the KV the
    daemon holds; ``num_layers``. ``begin(n)`` is called once per prompt of n tokens.
    ``embed(ids)`` -> hidden states [n, dim]; ``qkv(layer, h, rows)`` -> q [n, heads, d],
    k and v [n, kv_heads, d] of the tokens rows (positions = prompt indices), k and q
    after RoPE; ``attend(layer, h, q, keys, values, rows)`` finishes the layer for those
    rows over the layer's whole KV [N, kv_heads, d] with an exact causal mask in prompt
    order and returns the next hidden states. Optional (the question's preview computes
    its attention itself where they are there): ``scaling(layer)``, the softmax scale of
    the layer's attention, and ``finish(layer, h, a)``, the layer after its attention
    output a [n, heads * d] (the output projection, the MLP and their residuals).
    """

    device: torch.device
    kv_dtype: torch.dtype
    num_layers: int

    def begin(self, n: int) -> None: ...  # noqa: D102
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # noqa: D102
    def qkv(self, layer: int, h: torch.Tensor, rows: torch.Tensor) -> tuple: ...  # noqa: D102
    def attend(self, layer: int, h, q, keys, values, rows) -> torch.Tensor: ...  # noqa: D102


@dataclass
class LoopResult:
    """What :func:`blend_layers` leaves: final hidden states and rows, and the selections."""

    h: torch.Tensor
    rows: np.ndarray
    selections: list = field(default_factory=list)
    checked: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    #: seconds per phase of the pass (:data:`PHASES`), the batch's together (one dict
    #: shared by its prompts)
    phases: dict = field(default_factory=dict)


#: The pass's phases (:attr:`LoopResult.phases`): the embedding; per layer the rows'
#: norm, Q/K/V projections and RoPE (``qkv``); the waits for the daemon's landed layers
#: (``wait``); the rows' own K and V into the buffer and the metric's plane (``rows``);
#: the engine's prefix-cache rows read (``given``); the check layers' round trips to the
#: daemon (``check``); the stored and own rows
#: read for the attention (``gather``); the attention (``attention``); the output
#: projection and the MLP (``mlp``; with ``attention`` as one ``attend`` for ops that do
#: not split them).
PHASES = ("embed", "qkv", "wait", "given", "rows", "check", "gather", "attention", "mlp",
          "attend")


class _Clock:
    """Adds the time since the last mark to a phase of ``phases``."""

    def __init__(self, phases: dict) -> None:
        self.phases, self.t = phases, time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.t
        self.t = now


@dataclass
class Prompt:
    """One prompt of a batch (:func:`blend_batch`).

    Its open session, KV buffer, token ids, which tokens are stored chunk rows, and A for
    the attention metric (optional). ``recompute`` (sorted prompt indices: the fresh
    tokens and the chunk tokens the node selected) are the rows the node computes at
    every layer, with no check layer: ``sess`` is then a reuse-only landing session
    (waited for layer by layer), or None when ``buf`` holds every stored row already.
    """

    sess: Any
    buf: np.ndarray
    ids: np.ndarray
    cached: np.ndarray
    attention: np.ndarray | None = None
    recompute: np.ndarray | None = None
    #: The first ``given`` positions' KV come from the engine's cache (its prefix-cache
    #: hits): with no check layer the pass computes none of them, and ``fill(layer, out)``
    #: writes that layer's K and V of positions 0 .. given - 1 into ``out`` [2, given,
    #: kv_heads, head_dim] (the buffer's rows) once the daemon has landed the layer. With
    #: check layers (the daemon's selection reads every row) they are computed as before.
    given: int = 0
    fill: Callable[[int, np.ndarray], None] | None = None


def blend_layers(
    ops: LayerOps,
    sess: Any,
    buf: np.ndarray,
    ids: np.ndarray,
    cached: np.ndarray,
    checks: list[int],
    metric: str,
    landing: bool,
    keep_checks: bool = False,
    attention: np.ndarray | None = None,
    wait: Callable[[Any, int], None] | None = None,
) -> LoopResult:
    """Run every layer of one prompt through an open fuse session.

    Parameters
    ----------
    ops : LayerOps
        The model's layer operations.
    sess : FuseSession or LandingSession
        Open on the prompt's segments with ``checks`` (a landing session writes into
        ``buf``; a classic one returns fused layers into it).
    buf : ndarray
        The request's KV [layers, 2, N, kv_heads, d] in the model's dtype; holds the
        fused KV afterwards.
    ids, cached : ndarray
        Token ids [N] and which tokens are stored chunk rows.
    checks : list of int
        The session's check layers (empty: reuse only, the fresh rows computed).
    metric : str
        ``"value"``, ``"key"`` or ``"attention"`` (K and V go at check layers).
    landing : bool
        Whether ``sess`` is a landing session.
    keep_checks : bool
        Keep the planes sent at check layers (:attr:`LoopResult.checked`).
    attention : ndarray, optional
        A for the attention metric ([chunk tokens, kv_heads] float32,
        :mod:`kvblend.blend.preview`), given to the session before the first check.
    wait : callable, optional
        ``wait(sess, layer)`` waits for a landing session's layer (the vLLM worker's
        bounds it by the connector's ``timeout_ms`` and ends it when the daemon is gone);
        default ``sess.wait(layer, timeout=120)``.

    At a check layer the selection is final when the daemon answers, so only the rows it
    keeps finish the layer (attention and MLP): the others needed only their Q, K and V.
    """
    p = Prompt(sess, buf, ids, cached, attention)
    return blend_batch(ops, [p], checks, metric, landing, keep_checks, wait)[0]


class Ranks(Protocol):
    """Tensor-parallel ranks blending one batch together (see :func:`blend_batch`).

    ``agree(ok)``: whether every rank's ``ok`` is true (a collective every rank calls at
    the same point); ``sum(dev, ok)``: the ranks' per-row deviations summed, or None
    when a rank is not ok.
    """

    def agree(self, ok: bool) -> bool: ...  # noqa: D102
    def sum(self, dev: np.ndarray, ok: bool) -> np.ndarray | None: ...  # noqa: D102


class RankFailed(RuntimeError):
    """Another tensor-parallel rank's part of the pass failed, so this rank's stops too."""


def agreed(ranks: Ranks | None, err: BaseException | None) -> None:
    """Raise err (or RankFailed) unless every rank got through (one collective with ranks)."""
    if ranks is not None:
        if not ranks.agree(err is None):
            raise err if err is not None else RankFailed(
                "kvblend: another tensor-parallel rank's blend failed"
            )
    elif err is not None:
        raise err


def blend_batch(
    ops: LayerOps,
    prompts: list[Prompt],
    checks: list[int],
    metric: str,
    landing: bool,
    keep_checks: bool = False,
    wait: Callable[[Any, int], None] | None = None,
    ranks: Ranks | None = None,
    outputs: str = "all",
) -> list[LoopResult]:
    """Run every layer of several prompts together, each through its own open session.

    As :func:`blend_layers` for each prompt (the same check layers and metric for all),
    with one pass over the layers: per layer the rows of every prompt go through the
    projections and the MLP as one batch (``ops.qkv`` and, where ``ops`` has it,
    ``ops.attend_many(layer, hs, qs, keys, values, rows)``, which attends each prompt
    over its own KV; else ``ops.attend`` per prompt). The sessions are all open before
    the first layer, so the daemon lands every prompt's stored rows while the node
    computes. Returns one :class:`LoopResult` per prompt, in order.

    ``ranks``: tensor-parallel ranks running the same pass over their heads (landing
    sessions of head ranges; ``ops`` are the ranks' sharded modules, whose collectives
    every rank must reach together). Each check layer's selection is then made by the
    ranks' summed deviations (``check_deviation``, ``ranks.sum``, ``check_select``), so
    every rank computes the same rows; and the ranks agree after each layer's waits and
    each check, so that a failure on one stops all of them at the same point instead of
    leaving the others in a collective (landing only). The value and key metrics select
    at the check layers that way; prompts with their own rows (``recompute``: the question
    and anchored metrics, whose node selection the ranks made together from their summed
    previews) have no check layer. The attention metric is refused: its score weighs each
    head's deviation by that head's own A.

    ``outputs``: which final hidden states the caller reads (:attr:`LoopResult.h`):
    ``"all"`` (every recomputed row's), ``"last"`` (each prompt's last row's: the last
    layer's attention and MLP run for that row alone) or ``"none"`` (the KV only, as an
    engine's blend, whose logits the engine computes: the last layer's attention and MLP
    are skipped; ``h`` is None). The KV is the same in all three: a layer's K and V come
    from its input.
    """
    if outputs not in ("all", "last", "none"):
        raise ValueError(f"outputs {outputs!r}: 'all', 'last' or 'none'")
    if ranks is not None and (not landing or metric == "attention"):
        raise ValueError("tensor-parallel blending takes landing sessions and the value, "
                         "key, question or anchored metric")
    dev = ops.device
    first = checks[0] if checks else 0  # the first layer call of a classic session
    m = 1 if metric == "value" else 0
    phases: dict = {}
    clock = _Clock(phases)
    outs, kvs, hs = [], [], []
    for p in prompts:
        if p.recompute is not None:
            if checks:
                raise ValueError("a prompt with its own rows takes no check layers")
            rows = np.asarray(p.recompute, np.int64)
        elif p.sess is None:
            raise ValueError("a prompt without a session needs its own rows")
        else:
            rows = np.arange(p.ids.size) if checks else np.flatnonzero(~p.cached)
        if p.given and p.fill is not None and not checks:
            # the engine's own rows are read, not computed; one row at least (the last)
            rows = rows[rows >= p.given]
            if rows.size == 0:
                rows = np.array([p.ids.size - 1], np.int64)
            if p.recompute is not None:
                p.recompute = rows
        outs.append(LoopResult(h=None, rows=rows, phases=phases))
        kvs.append(host.tensor(p.buf, ops.kv_dtype))  # shares the buffer (the region)
        if p.attention is not None and p.recompute is None:
            p.sess.attention(p.attention)  # goes with the first check layer's call
    ops.begin(max(p.ids.size for p in prompts))
    ids = [p.ids[o.rows] for p, o in zip(prompts, outs)]
    hs = _split(ops.embed(torch.as_tensor(np.concatenate(ids), device=dev)), outs)
    clock.mark("embed")
    # the rows as tensors, made again only when a check layer changes them (the attention
    # may keep per-rows state, such as vLLM's request metadata, while they stay the same)
    rows_t = [torch.as_tensor(o.rows, device=dev) for o in outs]
    rows_c = [torch.from_numpy(o.rows) for o in outs]
    last_only = False  # the last layer for each prompt's last row alone (outputs "last")
    many = getattr(ops, "attend_many", None)
    # under tensor parallelism a rank's own failure must not leave the others in a
    # collective: every rank runs the same collectives in the same order, a failure is
    # carried to the next one (the waits' agreement, a check's, the attention's), and
    # there every rank raises together, before the layer's reducing projections
    # (ops that split the attention from the rest also say how long each part takes)
    split = hasattr(ops, "attention_of") and hasattr(ops, "finish")
    for li in range(ops.num_layers):
        err: BaseException | None = None
        try:
            q, k, v = ops.qkv(li, _cat(hs), _cat(rows_t))
            qs, ks, vs = _split(q, outs), _split(k, outs), _split(v, outs)
        except Exception as e:  # noqa: BLE001 - agreed on, then raised
            if ranks is None:
                raise
            err = e
        clock.mark("qkv")
        k_all, v_all = [], []
        for p in prompts:
            if landing and p.sess is not None:
                # the daemon's rows first (at once for ours)
                try:
                    if wait is None:
                        p.sess.wait(li, timeout=120)
                    else:
                        wait(p.sess, li)
                except Exception as e:  # noqa: BLE001 - agreed on, then raised
                    if ranks is None:
                        raise
                    err = err or e
        clock.mark("wait")
        for p in prompts:  # (after the landing: the daemon's rows of the prefix are replaced)
            if p.given and p.fill is not None and not checks and err is None:
                try:
                    p.fill(li, p.buf[li, :, : p.given])
                except Exception as e:  # noqa: BLE001 - agreed on, then raised
                    if ranks is None:
                        raise
                    err = e
        clock.mark("given")
        agreed(ranks, err)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            kv, new, plane = kvs[i], None, None
            try:
                kc, vc = ks[i].to("cpu", ops.kv_dtype), vs[i].to("cpu", ops.kv_dtype)
                kv[li, 0, rows_c[i]], kv[li, 1, rows_c[i]] = kc, vc
                if li in checks:  # what the daemon's check reads
                    plane = host.array(torch.stack((kc, vc), 1) if metric == "attention"
                                       else (kc, vc)[m])
            except Exception as e:  # noqa: BLE001 - agreed on, then raised
                if ranks is None:
                    raise
                err = err or e
            clock.mark("rows")
            if landing and li in checks and ranks is not None:
                new = _ranks_check(p.sess, li, plane, ranks, err, o.rows.size)
            elif landing and li in checks:
                p.sess.check(li, plane)
                new = p.sess.rows().astype(np.int64)
            elif not landing and li >= first and p.sess is not None:
                # fills the fused layer (own rows included) from the layer after the first
                # check layer on; at the first check layer the layer is the node's own
                p.sess.layer(li, host.array(kc), host.array(vc), k_out=p.buf[li, 0],
                             v_out=p.buf[li, 1])
                if li in checks:
                    new = p.sess.rows().astype(np.int64)
            clock.mark("check")
            try:  # under TP a failure here goes to the next agreement, as above
                if err is not None:
                    continue  # every rank raises at that agreement
                if new is not None and keep_checks:
                    o.checked[li], o.sent[li] = plane.copy(), o.rows.copy()
                k_all.append(kv[li, 0].to(dev, q.dtype))
                v_all.append(kv[li, 1].to(dev, q.dtype))
                if new is not None:  # the cheap check: only the kept rows finish the layer
                    keep = torch.as_tensor(np.searchsorted(o.rows, new), device=dev)
                    hs[i], qs[i], o.rows = hs[i][keep], qs[i][keep], new
                    rows_t[i] = torch.as_tensor(new, device=dev)
                    rows_c[i] = torch.from_numpy(new)
                    o.selections.append(new)
            except Exception as e:  # noqa: BLE001 - agreed on, then raised
                if ranks is None:
                    raise
                err = err or e
            clock.mark("gather")
        if li == ops.num_layers - 1 and outputs != "all":
            if outputs == "none":  # the KV is complete: the layer's output is not read
                agreed(ranks, err)
                hs = [None] * len(outs)
                break
            # the last row of each prompt alone finishes the last layer
            hs, qs = [x[-1:] for x in hs], [x[-1:] for x in qs]
            rows_t = [x[-1:] for x in rows_t]
            last_only = True
        if split:
            # the attention is the rank's own work; the output projection and the MLP
            # reduce across ranks: agree in between (without ranks, a failure raises here)
            a = None
            try:
                if err is None:
                    a = ops.attention_of(li, qs, k_all, v_all, rows_t)
            except Exception as e:  # noqa: BLE001 - agreed on, then raised
                if ranks is None:
                    raise
                err = e
            agreed(ranks, err)
            clock.mark("attention")
            h = ops.finish(li, _cat(hs), a)
            hs = list(torch.split(h, 1)) if last_only else _split(h, outs)
            clock.mark("mlp")
        else:
            agreed(ranks, err)
            hs = many(li, hs, qs, k_all, v_all, rows_t) if many is not None else [
                ops.attend(li, *x) for x in zip(hs, qs, k_all, v_all, rows_t)]
            clock.mark("attend")
    for o, h in zip(outs, hs):
        o.h = h
    return outs


def _ranks_check(
    sess: Any,
    layer: int,
    plane: np.ndarray | None,
    ranks: Ranks,
    err: BaseException | None,
    n: int,
) -> np.ndarray:
    """A check layer of tensor-parallel ranks: every rank selects by the summed deviation.

    ``n``: the rows sent (the same on every rank). ``err``: this rank failed before the
    check (``plane`` may then be None): it still takes part in the check's collectives,
    as not ok, and every rank raises there.
    """
    dev = None
    if err is None:
        try:
            dev = sess.check_deviation(layer, plane)
        except Exception as e:  # noqa: BLE001 - agreed on, then raised
            err = e
    total = ranks.sum(dev if dev is not None else np.zeros(n, np.float32), err is None)
    if total is None:
        agreed(None, err or RankFailed("kvblend: another tensor-parallel rank's check failed"))
    rows = None
    try:
        sess.check_select(layer, total)
        rows = sess.rows().astype(np.int64)
    except Exception as e:  # noqa: BLE001 - agreed on, then raised
        err = e
    agreed(ranks, err)
    return rows


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along rows (one tensor: itself, no copy)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _split(x: torch.Tensor, outs: list[LoopResult]) -> list[torch.Tensor]:
    """Split rows back per prompt, by each prompt's current rows."""
    if len(outs) == 1:
        return [x]
    return list(torch.split(x, [o.rows.size for o in outs]))


@torch.no_grad()
def prefill(ops: LayerOps, ids: np.ndarray, out: np.ndarray, lock: Any = None) -> None:
    """Prefill a token sequence alone, from position 0, and keep its KV: a chunk as kvblend
    stores it.

    ``out`` is [layers, 2, n, kv_heads, head_dim] in the model's KV dtype (``ops.kv_dtype``);
    each layer's K (after RoPE) and V of every token are written there. Every token
    attends causally to the ones before it, as in an engine's prefill of the same ids.
    ``lock`` (a context manager, optional) is held around each layer: a caller beside an
    engine takes the engine's steps' lock, so that the two never compute at once.
    """
    dev = ops.device
    n = ids.size
    kv = host.tensor(out, ops.kv_dtype)
    rows_t = torch.arange(n, device=dev)
    lock = lock if lock is not None else contextlib.nullcontext()
    ops.begin(n)
    with lock:
        h = ops.embed(torch.as_tensor(ids, device=dev))
    for li in range(ops.num_layers):
        with lock:
            q, k, v = ops.qkv(li, h, rows_t)
            kv[li, 0], kv[li, 1] = k.to("cpu", ops.kv_dtype), v.to("cpu", ops.kv_dtype)
            if li + 1 < ops.num_layers:  # the last layer's output is not needed
                h = ops.attend(li, h, q, k.to(q.dtype), v.to(q.dtype), rows_t)
