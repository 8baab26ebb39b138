"""Store on a miss: chunks a separator-split request missed, prefilled alone and stored.

kvblend stores every chunk as prefilled alone from position 0 (what re-rotation and the
blend assume). A request's own KV of a document is not that (it attended to what came
before it), so the worker prefills each missed chunk again, alone, over vLLM's own layer
modules (:func:`kvblend.blend.loop.prefill`, the blend pass's layer operations), and
PUTs it. That runs on a thread of its own, after the step that scheduled the request,
so the request's first token does not wait for it; its connection to the daemon is its
own (behind its own circuit breaker). A failed store is logged and changes no output.
The scheduler queues each missed chunk once (:class:`kvblend.vllm.scheduler.SchedulerSide`)
and hands the worker at most ``store_tokens_per_step`` tokens of them a step.

The thread and vLLM never compute at once. vLLM's CPU kernels keep state shared by every
call in the process: one oneDNN scratchpad and stream for all its matrix products, which
the attention's scheduler metadata resizes (frees and allocates again) when a step needs
more. The thread's layers use the same matrix products. A resize while the thread was in
one corrupted the heap (CI, 2026-12-03: ``malloc(): unsorted double linked list
corrupted`` in the first decode step after a request's misses were queued). The resize runs
in vLLM's input preparation, before the connector hears of the step. So
:func:`kvblend.vllm.plugin.lock_runner_steps` makes vLLM's model runner hold
:data:`kvblend.vllm.plugin.STEPS` around all of ``execute_model`` (inputs, attention
metadata, forward, logits) and ``sample_tokens``; the thread takes it around each layer.
It computes only while the worker waits for a step, and a step waits for at most one
layer of a missed chunk. Where the runner cannot be wrapped (another vLLM), store on a
miss is off, with the reason logged.

With ``store_idle_ms`` > 0 (default 0), requests come first: each layer waits until the
runner has computed nothing for that long (the engine has no step to run), or for
:data:`kvblend.vllm.plugin.PATIENCE_S` at most (:class:`kvblend.vllm.plugin.BetweenSteps`).
Measured (docs/benchmarks-history.md): first-sight requests barely faster, and far fewer chunks found,
since the stores lag: so off by default.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from ..blend import host
from ..blend.loop import prefill
from ..errors import KvblendError, Unavailable
from ..types import Model
from .daemon import DaemonLink
from .metadata import MissSpec
from .plugin import BetweenSteps

#: Missed chunks waiting on the worker's thread at most (more are dropped, logged).
MAX_WAITING = 256


class MissStorer:
    """The worker's thread that prefills missed chunks alone and stores them.

    Parameters
    ----------
    model : torch.nn.Module
        The model vLLM runs (:func:`kvblend.vllm.blend.worker_model`).
    spec : Model
        The model as registered in the daemon.
    link : DaemonLink
        A connection of the thread's own.
    logger : logging.Logger
        Where its lines go.
    """

    def __init__(
        self,
        model: Any,
        spec: Model,
        link: DaemonLink,
        logger: logging.Logger,
        idle_s: float = 0.0,
    ) -> None:
        self.model = model
        self.between = BetweenSteps(idle_s)
        self.spec = spec
        self.link = link
        self.log = logger
        self.stored = 0
        self.failed = 0
        self._q: queue.Queue[MissSpec | None] = queue.Queue(MAX_WAITING)
        self._thread: threading.Thread | None = None
        self._dropped_said = False

    def submit(self, misses: list[MissSpec]) -> None:
        """Queue chunks to store (returns at once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvblend-miss", daemon=True)
            self._thread.start()
        for m in misses:
            try:
                self._q.put_nowait(m)
            except queue.Full:
                if not self._dropped_said:
                    self._dropped_said = True
                    self.log.warning(
                        "kvblend: %d missed chunks already wait to be stored: more are "
                        "dropped (stored on a later miss)", MAX_WAITING
                    )

    def _run(self) -> None:
        from ..blend.attention import causal_attention
        from .blend import VllmLlamaOps

        ops = VllmLlamaOps(self.model)
        # PyTorch's fused attention, not vLLM's CPU kernel: that kernel is not safe to run
        # beside the engine's own forward pass (a thread here corrupted the stored KV)
        ops.attention = causal_attention
        np_dtype = host.np_dtype(ops.kv_dtype)
        while True:
            m = self._q.get()
            if m is None:
                return
            t0 = time.monotonic()
            try:
                buf = np.empty(self.spec.kv_shape(len(m.ids)), np_dtype)
                prefill(ops, np.asarray(m.ids, np.int64), buf, self.between)
                kv = host.tensor(buf, ops.kv_dtype)
                bad = kv.numel() - int(torch.isfinite(kv).sum())
                if bad:  # never stored: every later request would load it
                    raise ValueError(f"its prefill gave {bad} values that are not finite")
                self.link.client().put(self.spec.name, m.hash, buf, base_pos=0)
            except (Unavailable, TimeoutError) as e:
                self.link.failed(e)
                self.failed += 1
                self.log.warning("kvblend: storing a missed chunk failed: %s", e)
                continue
            except (KvblendError, RuntimeError, ValueError) as e:
                self.link.drop()
                self.failed += 1
                self.log.warning("kvblend: storing a missed chunk failed: %s", e)
                continue
            self.link.ok()
            self.stored += 1
            self.log.info(
                "kvblend: stored a missed chunk (%d tokens, %s...) in %.3f s",
                len(m.ids), m.hash.hex()[:12], time.monotonic() - t0,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the chunks it holds (at most ``timeout_s``)."""
        if self._thread is not None:
            try:
                self._q.put(None, timeout=timeout_s)
            except queue.Full:
                return
            self._thread.join(timeout_s)
        self.link.drop()
