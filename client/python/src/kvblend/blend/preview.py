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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: The first layer A sums (layers 0 and 1 attend broadly; eval/qsel.py's PREVIEW_FROM).
PREVIEW_FROM = 2


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
            for layer in range(nl):
                if wait is None:
                    sess.wait(layer, timeout=120)
                else:
                    wait(sess, layer)
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
        (the other fresh tokens are not computed), causally.
    first : int
        The first layer summed into A.
    """
    dev = ops.device
    nc, nq = len(cached), len(question)
    if nq == 0:
        raise ValueError("the attention metric needs question tokens (none after the chunks)")
    if nc and int(positions[0]) <= int(cached[-1]):
        raise ValueError("the question must come after every chunk token")
    cached_t = torch.as_tensor(cached, dtype=torch.long)
    pos_t = torch.as_tensor(positions, dtype=torch.long, device=dev)
    local = torch.arange(nc, nc + nq, device=dev)  # the question's rows among the keys
    h = ops.embed(torch.as_tensor(question, dtype=torch.long, device=dev))
    a = torch.zeros(kv.shape[3], nc, dtype=torch.float64, device=dev)
    mask = torch.arange(nc + nq, device=dev)[None, :] > local[:, None]
    for layer in range(ops.num_layers):
        q, k, v = ops.qkv(layer, h, pos_t)
        keys = torch.cat([kv[layer, 0, cached_t].to(dev, q.dtype), k])
        values = torch.cat([kv[layer, 1, cached_t].to(dev, q.dtype), v])
        if layer >= first and nc:
            rep = q.shape[1] // keys.shape[1]
            kt = keys.repeat_interleave(rep, dim=1).permute(1, 2, 0)  # [heads, d, keys]
            s = torch.matmul(q.transpose(0, 1).float(), kt.float()) * (q.shape[2] ** -0.5)
            p = torch.softmax(s.masked_fill(mask[None], float("-inf")), dim=-1)
            on_chunks = p[:, :, :nc].sum(dim=1)  # [heads, chunk tokens]
            a += on_chunks.reshape(keys.shape[1], rep, nc).sum(dim=1).double()
        h = ops.attend(layer, h, q, keys, values, local)
    return np.ascontiguousarray(a.T.float().cpu().numpy())


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
