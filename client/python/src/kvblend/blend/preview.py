"""The question's preview for the attention metric (question-aware selection, issue 24).

Before the blend pass the node runs only the question tokens through every layer over
the stored chunks' KV, re-rotated to the prompt (plain reuse for the question), and sums
A[j, h]: the question's softmax attention on chunk token j, over its queries, over
layers :data:`PREVIEW_FROM` .. L-1 and over the query heads that read KV head h. The
daemon weighs each chunk token's K and V deviation at the check layer by A
(docs/fuse.md, "The attention metric"). The definition is eval/qsel.py's ``preview``
(the NumPy node's), which tests/engine/test_hf_blend.py holds this one to.

The question metric (A³-style, arXiv 2511.17560; eval/RULES.md's "A alone") uses A with
no check layer at all: :func:`top_rows` picks the chunk tokens the question reads most,
and the pass recomputes those at every layer over the landed rows.

:func:`land_chunks` puts the re-rotated chunk rows of every layer into the request's KV
buffer through a reuse-only fuse session; :func:`question_attention` runs the preview
over them with a model's :class:`kvblend.blend.loop.LayerOps`. Shared by
:mod:`kvblend.hf` and :mod:`kvblend.vllm.blend`. Imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import host
from . import metrics as _metrics

#: The first layer A sums (layers 0 and 1 attend broadly; eval/qsel.py's PREVIEW_FROM).
PREVIEW_FROM = 2
#: Most question tokens the preview reads: a longer tail (everything after the blended
#: context up to the question's end) is previewed by its last this many tokens, which
#: read the chunks and each other as the whole tail's would (the tokens before them are
#: then not computed, as the other fresh tokens are not). Bounds the preview's work,
#: O(this x (chunk tokens + this)) a layer.
PREVIEW_MAX_QUESTION = 1024
#: Most float32 scores the preview holds at once, all heads together (64 MiB): the
#: question's rows are scored in blocks of ``SCORE_ELEMENTS // (heads x keys)`` rows (at
#: least one), so the scores, their softmax and the causal mask never grow with the
#: square of the question.
SCORE_ELEMENTS = 1 << 24


def land_chunks(
    client: Any,
    model: str,
    segments: Sequence[tuple],
    buf: np.ndarray,
    landing: bool,
    wait: Callable[[Any, int], None] | None = None,
) -> dict:
    """Fill the stored chunks' rows of every layer of ``buf`` with the rows re-rotated.

    ``buf`` is the request's KV [layers, 2, N, kv_heads, head_dim] (in a
    :meth:`Client.region` when ``landing``); ``segments`` the fuse segments, ``(hash,
    pos)`` or ``(count, pos)``. A reuse-only session (no check layers): a landing one
    writes every layer into ``buf`` itself; a classic one returns each fused layer for
    fresh rows of zeros (their rows in ``buf`` are zeros afterwards: the blend pass
    computes them). Raises what the fuse calls raise (``NotFound`` for a chunk not stored).
    ``wait(sess, layer)`` waits for a landed layer (default ``sess.wait(layer, timeout=120)``).
    Returns the session's statistics (:meth:`FuseSession.close`).
    """
    nl = buf.shape[0]
    if landing:
        sess = client.fuse_open_into(model, segments, buf[:, 0], buf[:, 1])
        try:
            ready = LayerWait(sess, wait)
            for layer in range(nl):
                ready(layer)
        except BaseException:
            _close_after_failure(sess)
            raise
        return sess.close()
    sess = client.fuse_open(model, segments, [], [])
    try:
        zeros = np.zeros((sess.rows().size,) + buf.shape[3:], buf.dtype)
        for layer in range(nl):
            sess.layer(layer, zeros, zeros, k_out=buf[layer, 0], v_out=buf[layer, 1])
    except BaseException:
        _close_after_failure(sess)
        raise
    return sess.close()


class LayerWait:
    """``ready(layer)`` for a landing session: returns once that layer has landed.

    ``wait(sess, layer)`` waits (default ``sess.wait(layer, timeout=120)``); the seconds
    spent waiting add up in :attr:`seconds`.
    """

    def __init__(self, sess: Any, wait: Callable[[Any, int], None] | None = None) -> None:
        self.sess, self.wait, self.seconds = sess, wait, 0.0

    def __call__(self, layer: int) -> None:
        """Wait until ``layer`` has landed."""
        t = time.perf_counter()
        if self.wait is None:
            self.sess.wait(layer, timeout=120)
        else:
            self.wait(self.sess, layer)
        self.seconds += time.perf_counter() - t


def _close_after_failure(sess: Any) -> None:
    """Close a session after a failure, which stays the one the caller hears of."""
    try:
        sess.close()
    except Exception:  # noqa: BLE001 - the first failure is the one to report
        pass


@torch.no_grad()
def question_attention(
    ops: Any,
    kv: torch.Tensor,
    cached: np.ndarray,
    question: np.ndarray,
    positions: np.ndarray,
    first: int = PREVIEW_FROM,
    ready: Callable[[int], None] | None = None,
    view: np.ndarray | None = None,
    last: int | None = None,
    agree: Callable[[BaseException | None], None] | None = None,
) -> np.ndarray:
    """Return A [chunk tokens, kv_heads] float32: where the question reads each chunk token.

    Parameters
    ----------
    ops : LayerOps
        The model's layer operations (``begin`` must have been called for a prompt
        covering ``positions``).
    kv : torch.Tensor
        The request's KV [layers, 2, N, kv_heads, head_dim] (CPU) whose rows ``cached``
        hold the stored chunks re-rotated to their positions (:func:`land_chunks`).
    cached : ndarray
        Prompt indices of the chunk tokens, increasing: A's rows, in that order.
    question, positions : ndarray
        The question's token ids and their prompt positions, increasing and after every
        chunk token. The question's queries read the chunk tokens and the question only
        (the other fresh tokens are not computed), causally. Only the last
        :data:`PREVIEW_MAX_QUESTION` are read; their rows are scored in blocks
        (:data:`SCORE_ELEMENTS`), with the same result as all at once up to float
        rounding.
    first : int
        The first layer summed into A.
    ready : callable, optional
        ``ready(layer)`` returns once that layer's chunk rows are in ``kv`` (a landing
        session still writing the later ones: :func:`landed_preview`).
    view, last : optional
        The compressed preview (QCFuse-style, :func:`anchors`): the question runs through
        layers 0 .. ``last`` only, reading on the layers before ``last`` only the chunk
        tokens ``view`` (prompt indices, a subset of ``cached``); on ``last`` it reads
        every chunk token, and A is its attention there alone (``first`` unused).
    agree : callable, optional
        Tensor-parallel ranks previewing together: ``agree(err)`` after each layer's own
        work (its Q, K and V, the wait for its landed rows, the scores) and before the
        layer's collectives (output projection, MLP), with that work's exception or None;
        it raises on every rank when any rank failed, so that none is left in a
        collective the others never reach.
    """
    dev = ops.device
    nc, nq = len(cached), len(question)
    if nq == 0:
        raise ValueError("the attention metric needs question tokens (none after the chunks)")
    if nc and int(positions[0]) <= int(cached[-1]):
        raise ValueError("the question must come after every chunk token")
    if nq > PREVIEW_MAX_QUESTION:
        question = question[-PREVIEW_MAX_QUESTION:]
        positions = positions[-PREVIEW_MAX_QUESTION:]
        nq = PREVIEW_MAX_QUESTION
    stop = ops.num_layers - 1 if last is None else int(last)
    if not 0 <= stop < ops.num_layers:
        raise ValueError(f"preview layer {stop}: in 0..{ops.num_layers - 1}")
    cached_t = torch.as_tensor(cached, dtype=torch.long)
    view_t = cached_t if view is None else torch.as_tensor(view, dtype=torch.long)
    if last is not None and not np.isin(view_t.numpy(), cached).all():
        raise ValueError("the preview's view must be chunk tokens")
    pos_t = torch.as_tensor(positions, dtype=torch.long, device=dev)
    # the question's rows among the keys: after every chunk token, or after the view's
    locals_ = {m: torch.arange(m, m + nq, device=dev) for m in {nc, len(view_t)}}
    h = ops.embed(torch.as_tensor(question, dtype=torch.long, device=dev))
    a = torch.zeros(kv.shape[3], nc, dtype=torch.float64, device=dev)
    # With ops.finish the preview's own softmax is the layer's attention too (one bmm
    # more), instead of a second pass over the keys by the model's attention kernel.
    fused = hasattr(ops, "finish") and hasattr(ops, "scaling")
    buf_k = buf_v = None
    for layer in range(stop + 1):
        err: BaseException | None = None
        try:
            if getattr(ops, "fail_preview", None) == layer:  # a test hook (VllmLlamaOps)
                ops.fail_preview = None
                raise RuntimeError(f"kvblend: a failure injected in the preview at layer {layer}")
            q, k, v = ops.qkv(layer, h, pos_t)
            if ready is not None:
                ready(layer)
            if buf_k is None:  # one buffer for every layer: chunk rows, then the question's
                buf_k = torch.empty((nc + nq,) + tuple(k.shape[1:]), dtype=q.dtype, device=dev)
                buf_v = torch.empty_like(buf_k)
            rows = cached_t if last is None or layer == stop else view_t
            m = len(rows)
            keys, values = buf_k[: m + nq], buf_v[: m + nq]
            keys[:m].copy_(kv[layer, 0, rows])
            values[:m].copy_(kv[layer, 1, rows])
            keys[m:], values[m:] = k, v
            scored = bool(nc) and (layer == stop if last is not None else layer >= first)
            # a local layer's sliding window (Gemma 3, ops.window): by the keys' positions
            window = ops.window(layer) if hasattr(ops, "window") else None
            local = None
            if window is not None:
                if not fused:
                    raise ValueError("a preview over a sliding window needs ops.finish")
                local = (torch.cat((rows.to(dev), pos_t)), pos_t, window)
            att = None
            if scored or (fused and layer < stop):
                scale = ops.scaling(layer) if fused else q.shape[2] ** -0.5
                # the layer's attention output too, the rank's own work (finish reduces)
                att = _question_rows(q, keys, values, m, scale, a if scored else None,
                                     fused and layer < stop, local)
                att = att.to(h.dtype) if att is not None else None
        except Exception as e:  # noqa: BLE001 - agreed on by the ranks, then raised
            if agree is None:
                raise
            err = e
        if agree is not None:
            agree(err)
        if layer == stop:  # the last layer's output is not needed
            break
        if fused:
            h = ops.finish(layer, h, att)
        else:
            h = ops.attend(layer, h, q, keys, values, locals_[m])
    return np.ascontiguousarray(a.T.float().cpu().numpy())


def _question_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, m: int,
                   scale: float, a: torch.Tensor | None, out: bool,
                   local: tuple | None = None) -> torch.Tensor | None:
    """Compute the question's softmax attention in float32, a block of its rows at a time.

    ``q`` [question, heads, d]; ``keys``, ``values`` [m + question, kv heads, d]: the m
    chunk rows, then the question's own, which query i reads up to its own (causally).
    Per KV head the queries of the heads that read it (head = kv head x rep + r) are the
    rows. Adds the attention on the chunk rows, summed over the rows, to ``a`` [kv heads,
    m] (float64) when given; returns the attention output [question, heads x d] when
    ``out``, else None.

    ``local``: a local layer's (key positions [m + question], question positions
    [question], window): query i also reads no key at a position <= its own - window
    (transformers' sliding-window mask).

    A block of b question rows [i0, i1) is scored against the keys up to its last row's
    own (m + i1: the later ones are masked for all of them, so leaving them out changes
    nothing), ``kv heads x rep x b x (m + i1)`` scores, with b the most rows that keep
    that within :data:`SCORE_ELEMENTS` (at least 1).
    """
    nq, kvh, d = q.shape[0], keys.shape[1], q.shape[2]
    rep = q.shape[1] // kvh
    dev = q.device
    block = max(1, min(nq, SCORE_ELEMENTS // (kvh * rep * (m + nq))))
    qg = q.float().reshape(nq, kvh, rep, d).permute(1, 2, 0, 3)  # [kv heads, rep, q, d]
    kt = keys.float().permute(1, 2, 0)  # [kv heads, d, m + question]
    vg = values.float().permute(1, 0, 2) if out else None  # [kv heads, m + question, d]
    o = torch.empty(nq, kvh, rep, d, dtype=torch.float32, device=dev) if out else None
    for i0 in range(0, nq, block):
        i1 = min(nq, i0 + block)
        b, end = i1 - i0, m + i1
        s = torch.bmm(qg[:, :, i0:i1].reshape(kvh, rep * b, d), kt[:, :, :end]).mul_(scale)
        # -inf after each query's own key among the question's
        after = torch.arange(i1, device=dev)[None, :] > torch.arange(i0, i1, device=dev)[:, None]
        s.view(kvh, rep, b, end)[..., m:].masked_fill_(after, float("-inf"))
        if local is not None:
            kpos, qpos, window = local
            out_of = kpos[None, :end] <= qpos[i0:i1, None] - window
            s.view(kvh, rep, b, end).masked_fill_(out_of, float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        if a is not None:
            a += p[:, :, :m].sum(dim=1).double()
        if o is not None:
            ob = torch.bmm(p, vg[:, :end])  # [kv heads, rep x b, d]
            o[i0:i1] = ob.reshape(kvh, rep, b, d).permute(2, 0, 1, 3)
    return o.reshape(nq, -1) if o is not None else None


#: The compressed preview (QCFuse-style): one anchor every ANCHOR_EVERY chunk tokens, each
#: chunk's first included (eval/rules.py's qcfuse).
ANCHOR_EVERY = 32


def anchors(spans: Sequence[tuple[int, int]], every: int = ANCHOR_EVERY) -> np.ndarray:
    """Return the anchor tokens of the chunks at ``spans`` ((start, length) in the prompt).

    In each chunk its first token and one every ``every`` tokens after it, increasing.
    """
    parts = [np.arange(s, s + n, every, dtype=np.int64) for s, n in spans]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def critical_layer(num_layers: int) -> int:
    """Return the compressed preview's layer for a model of ``num_layers`` layers.

    One fifth of the way in, at least layer 2 (layer 6 of SmolLM2's 30, which
    ``run_qsel.py --profile-critical`` picked; eval/RULES.md).
    """
    return min(max(2, round(num_layers / 5)), num_layers - 1)


def select_count(ratio: float, n: int) -> int:
    """Return how many of n chunk tokens a ratio recomputes.

    floor(ratio n), at least 1 when ratio > 0, at most n (the daemon's HKVD count,
    docs/fuse.md).
    """
    if not ratio > 0 or n <= 0:
        return 0
    return min(max(int(np.floor(ratio * n)), 1), n)


def top_rows(a: np.ndarray, cached: np.ndarray, ratio: float) -> np.ndarray:
    """Return the question metric's selection: the chunk tokens the question reads most.

    ``a`` is :func:`question_attention`'s A [chunk tokens, kv_heads] for the prompt
    indices ``cached`` (increasing). Returns the :func:`select_count` of them with the
    largest A summed over heads (ties to the lower index), as sorted prompt indices
    (int64).
    """
    cached = np.asarray(cached, np.int64)
    if a.shape[0] != cached.size:
        raise ValueError(f"A has {a.shape[0]} rows for {cached.size} chunk tokens")
    k = select_count(ratio, cached.size)
    score = a.astype(np.float64).sum(axis=1)
    order = np.argsort(-score, kind="stable")[:k]
    return np.sort(cached[order])


def landed_preview(
    client: Any,
    model: str,
    segments: Sequence[tuple],
    buf: np.ndarray,
    ops: Any,
    cached: np.ndarray,
    question: np.ndarray,
    positions: np.ndarray,
    wait: Callable[[Any, int], None] | None = None,
) -> tuple[np.ndarray, dict]:
    """Land the stored chunks into ``buf`` and run the preview as the layers arrive.

    As :func:`land_chunks` with ``landing`` followed by :func:`question_attention`, but
    each layer of the preview waits only for its own landed layer, so the daemon's
    landing overlaps the question's pass. Returns (A, the landing session's statistics
    with ``preview_wait_ms``: the time the preview waited for landed layers).
    """
    sess = client.fuse_open_into(model, segments, buf[:, 0], buf[:, 1])
    ready = LayerWait(sess, wait)
    try:
        kv = host.tensor(buf, ops.kv_dtype)
        a = question_attention(ops, kv, cached, question, positions, ready=ready)
    except BaseException:
        _close_after_failure(sess)
        raise
    stats = sess.close()
    stats["preview_wait_ms"] = ready.seconds * 1000
    return a, stats


def node_selection(
    ops: Any,
    kv: torch.Tensor,
    cached: np.ndarray,
    chunk_spans: Sequence[tuple[int, int]],
    question: np.ndarray,
    positions: np.ndarray,
    metric: str,
    ratio: float,
    ready: Callable[[int], None] | None = None,
    total: Callable[[np.ndarray], np.ndarray] | None = None,
    agree: Callable[[BaseException | None], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return the question or anchored metric's preview and the node's own selection.

    ``cached`` is the prompt's mask of stored chunk rows, ``chunk_spans`` the chunks'
    (start, length); ``question``, ``positions`` and ``ready`` as
    :func:`question_attention`, which runs over every layer (``"question"``) or as the
    compressed preview (``"anchored"``: :func:`anchors`, :func:`critical_layer`). Returns
    (A, the rows the pass recomputes at every layer: the fresh tokens and
    :func:`top_rows` at ``ratio``, sorted). ``total``, under tensor parallelism: A summed
    over this rank's heads [chunk tokens] float64 -> the same summed over every rank's
    (an all-reduce every rank calls), so that the ranks select alike by all the heads;
    ``agree`` as :func:`question_attention`'s.
    """
    rows = np.flatnonzero(cached)
    view = last = None
    if _metrics.METRICS[metric].preview == "anchored":
        view, last = anchors(chunk_spans), critical_layer(ops.num_layers)
    a = question_attention(
        ops, kv, rows, question, positions, ready=ready, view=view, last=last, agree=agree
    )
    score = a if total is None else total(a.astype(np.float64).sum(axis=1))[:, None]
    return a, np.union1d(np.flatnonzero(~cached), top_rows(score, rows, ratio))
