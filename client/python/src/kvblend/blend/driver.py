"""The blend pass's driver: from prompts of stored chunks and fresh tokens to the layer loop.

One driver for :mod:`kvblend.hf` and :mod:`kvblend.vllm.blend`. For each prompt
(:class:`Job`) and its KV buffer, :func:`open_job` opens the daemon's fuse session (a
landing one where the buffer is a region, a classic one otherwise) and runs the preview
its metric needs before the pass (the attention metric's, over a reuse-only landing);
:func:`node_previews` runs the node metrics' previews once every prompt of the batch
has its session, so the daemon lands them all while the node computes; the layer loop
(:func:`kvblend.blend.loop.blend_batch`) then runs the batch, and :func:`close_all`
closes its sessions. The callers own the buffers (a region pool, tensor parallelism and
the daemon's failures are vLLM's worker's concern; one buffer per blender is
:mod:`kvblend.hf`'s).

Imports numpy and torch (through :mod:`kvblend.blend.preview`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import host
from . import metrics as _metrics
from .loop import Prompt
from .preview import LayerWait, land_chunks, landed_preview, node_selection, question_attention


@dataclass
class Job:
    """One prompt to blend.

    ``ids``: the tokens whose KV the buffer holds; ``segments``: the fuse segments in
    prompt order from position 0, ``(hash, pos)`` for a stored chunk and ``(count,
    pos)`` for fresh tokens (a segment runs up to the next one); ``ratios``: per check
    layer, or the one ratio of a node metric; ``question``: the tokens the previews read
    from, at ``question_pos`` (default: right after ``ids``, which vLLM computes after
    the blend; :mod:`kvblend.hf`'s question is the prompt's last segment, inside ``ids``).
    """

    ids: Sequence[int]
    segments: Sequence[tuple]
    ratios: Sequence[float]
    question: Sequence[int] = ()
    question_pos: Sequence[int] | None = None
    #: The first ``given`` positions' KV are the engine's (its prefix-cache hits), read by
    #: ``fill`` instead of computed where the metric has no check layer
    #: (:class:`kvblend.blend.loop.Prompt`).
    given: int = 0
    fill: Callable[[int, np.ndarray], None] | None = None


def is_fresh(seg: tuple) -> bool:
    """Whether a fuse segment is fresh tokens ``(count, pos)`` rather than ``(hash, pos)``."""
    return isinstance(seg[0], (int, np.integer))


def chunk_layout(n: int, segments: Sequence[tuple]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The prompt's mask of stored chunk rows [n] and the chunks' (start, length)."""
    cached = np.zeros(n, bool)
    starts = [int(seg[1]) for seg in segments] + [n]
    spans = []
    for i, seg in enumerate(segments):
        if not is_fresh(seg):
            cached[starts[i] : starts[i + 1]] = True
            spans.append((starts[i], starts[i + 1] - starts[i]))
    return cached, spans


@dataclass
class Batch:
    """What :func:`open_job` opened for a batch, one entry a prompt (closed by its caller).

    ``sessions`` holds None for a prompt with no session (a node metric's classic blend:
    its rows were landed before the pass, :attr:`landed` holds that session's statistics).
    """

    regions: list = field(default_factory=list)  # the caller's: what the buffers lie in
    sessions: list = field(default_factory=list)
    prompts: list = field(default_factory=list)
    landed: list = field(default_factory=list)  # a closed landing's statistics, or None
    previews: list = field(default_factory=list)  # each prompt's preview seconds
    pre_wait: list = field(default_factory=list)  # of each preview, seconds waiting for layers
    #: the node metrics' previews, run by node_previews: per prompt (chunk spans, question
    #: ids, their positions, ratio, positions the ops begin with)
    pending: list = field(default_factory=list)
    unclean: bool = False  # a session's close failed: its buffer may still be written

    def keep(self, n: int, close: Callable[[Any], Any]) -> None:
        """Keep the first n prompts; close the sessions of the others with ``close``."""
        for x in self.sessions[n:]:
            if x is not None:
                close(x)
        for xs in (self.sessions, self.prompts, self.landed, self.previews, self.pre_wait):
            del xs[n:]
        del self.pending[n:]


def open_job(
    ops: Any,
    client: Any,
    model: str,
    job: Job,
    buf: np.ndarray,
    check_layers: Sequence[int],
    metric: str,
    b: Batch,
    wait: Callable[[Any, int], None] | None = None,
    heads: tuple[int, int] | None = None,
    landing: bool = True,
) -> None:
    """Open ``job``'s fuse session into ``buf`` [layers, 2, N, kv_heads, d]; append to ``b``.

    ``landing``: ``buf`` lies in a region of the client's and the daemon lands into it
    (else a classic session). A node metric (:data:`kvblend.blend.metrics.NODE_SELECTS`)
    gets a reuse-only session and a pending preview (:func:`node_previews`); the
    attention metric with check layers runs its preview here, over a reuse-only landing
    of its own, before its session opens. ``wait(sess, layer)`` waits for a landed layer;
    ``heads``: the tensor-parallel rank's KV heads (first, count). Raises what the
    client's fuse calls raise.
    """
    ids = np.asarray(job.ids, np.int64)
    cached, spans = chunk_layout(ids.size, job.segments)
    q = np.asarray(job.question, np.int64)
    if job.question_pos is None:
        qpos = ids.size + np.arange(q.size)
    else:
        qpos = np.asarray(job.question_pos, np.int64)
    begin = max(ids.size, int(qpos.max()) + 1 if qpos.size else 0)
    t_pre = time.perf_counter()
    kw = {} if heads is None else {"heads": heads}
    if _metrics.node_selects(metric):
        # the preview (node_previews, once every prompt of the batch has its session)
        # reads each layer as it lands, then the pass recomputes the fresh tokens and the
        # chunk tokens the question reads most at every layer over the stored rows
        sess, landed = None, None
        if landing:
            sess = client.fuse_open_into(model, job.segments, buf[:, 0], buf[:, 1], **kw)
        else:
            landed = land_chunks(client, model, job.segments, buf, False)
        b.sessions.append(sess)
        b.landed.append(landed)
        b.prompts.append(Prompt(sess, buf, ids, cached, given=job.given, fill=job.fill))
        b.pending.append((spans, q, qpos, float(job.ratios[-1]), begin))
        b.pre_wait.append(0.0)  # both set by node_previews
    else:
        a, waited = None, 0.0
        if metric == "attention" and check_layers:
            rows = np.flatnonzero(cached)
            ops.begin(begin)
            if landing:  # the preview runs as the layers land
                a, st = landed_preview(client, model, job.segments, buf, ops, rows, q, qpos, wait)
                waited = st.get("preview_wait_ms", 0.0) / 1000
            else:
                land_chunks(client, model, job.segments, buf, False)
                a = question_attention(ops, host.tensor(buf, ops.kv_dtype), rows, q, qpos)
        b.pre_wait.append(waited)
        checks, ratios = list(check_layers), list(job.ratios)
        if landing:
            sess = client.fuse_open_into(
                model, job.segments, buf[:, 0], buf[:, 1], checks, ratios, metric, **kw
            )
        else:
            sess = client.fuse_open(model, job.segments, checks, ratios, metric)
        b.sessions.append(sess)
        b.landed.append(None)
        b.prompts.append(Prompt(sess, buf, ids, cached, a, given=job.given, fill=job.fill))
    b.previews.append(time.perf_counter() - t_pre)


def node_previews(
    ops: Any,
    metric: str,
    b: Batch,
    wait: Callable[[Any, int], None] | None = None,
    total: Callable[[np.ndarray], np.ndarray] | None = None,
    agree: Callable[[BaseException | None], None] | None = None,
) -> None:
    """Run the node metric's preview of each prompt of ``b`` and give it the selection.

    Each preview waits for a layer of its prompt's landing as it needs it. ``total`` and
    ``agree``: under tensor parallelism, as :func:`kvblend.blend.preview.node_selection`
    takes them (A summed over every rank's heads; the ranks agreeing after each layer).
    """
    for i, (spans, q, qpos, ratio, begin) in enumerate(b.pending):
        p = b.prompts[i]
        t = time.perf_counter()
        ready = None if p.sess is None else LayerWait(p.sess, wait)
        ops.begin(begin)
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
            total,
            agree,
        )
        b.pre_wait[i] = 0.0 if ready is None else ready.seconds
        b.previews[i] = time.perf_counter() - t


def close_quietly(sess: Any, b: Batch | None = None) -> dict:
    """Close a session whose error would not be the one to report (after a failure);
    a failed close marks ``b`` unclean (its buffers may still be written)."""
    from ..errors import KvblendError

    try:
        return sess.close()
    except KvblendError:
        if b is not None:
            b.unclean = True
        return {}


def close_all(b: Batch, quiet: bool = False) -> list[dict]:
    """Close every session of ``b`` (``quiet``: as :func:`close_quietly`); return each
    prompt's statistics (a landed one's for a prompt without a session)."""
    stats = []
    for sess, landed in zip(b.sessions, b.landed):
        if sess is None:
            stats.append(dict(landed or {}))
        else:
            stats.append(close_quietly(sess, b) if quiet else sess.close())
    b.sessions = []
    return stats


def close_after_failure(b: Batch) -> None:
    """Close the sessions still open in ``b`` without a word (a failure is being raised)."""
    for sess in b.sessions:
        if sess is not None:
            try:
                sess.close()
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                b.unclean = True
    b.sessions = []
