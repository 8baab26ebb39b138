"""The connector's scheduler half: claims, block bookkeeping and the step's metadata.

Runs in vLLM's scheduler process. :meth:`SchedulerSide.get_num_new_matched_tokens` asks
the planner once (:func:`kvblend.vllm.plan.plan_request`: one parse, one hash, one
lookup) and keeps its :class:`~kvblend.vllm.plan.Plan`, which
:meth:`SchedulerSide.update_state_after_alloc` uses with the request's blocks: a load for
the worker, or a store to gather once the prompt is prefilled.
:meth:`SchedulerSide.build_connector_meta` hands both to the worker each step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..client import scoped_chunk_hash
from ..errors import KvblendError
from . import cost, plan
from .config import ConnectorConfig, logger
from .daemon import DaemonLink
from .layout import full_blocks
from .metadata import KvblendMetadata, KvblendWorkerMeta, LoadSpec, MissSpec, StoreSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


#: Test hook: while the file this names exists, loads are claimed synchronously even with
#: ``async_loads`` on (one engine can then test both).
SYNC_ENV = "KVBLEND_VLLM_SYNC_FILE"

#: A missed chunk is queued for storing at most once in this many seconds.
MISS_WINDOW_S = 120.0
#: Most missed chunks waiting to be stored (older ones are dropped first).
MAX_QUEUED_MISSES = 1024


def _us(spt: float | None) -> str:
    """Seconds per token for a log line."""
    return "unmeasured" if spt is None else f"{spt * 1e6:.0f} us"


@dataclass
class _Pending:
    """Scheduler-side state of a request that stores."""

    hash: bytes
    length: int
    block_ids: list[int]


class SchedulerSide:
    """The scheduler's half of :class:`kvblend.vllm.KvblendConnector`.

    Parameters
    ----------
    config : ConnectorConfig
        The connector's configuration.
    daemon : DaemonLink
        The connection the lookups go through.
    """

    def __init__(
        self, config: ConnectorConfig, daemon: DaemonLink, kv_cache_config: Any = None
    ) -> None:
        self.config = config
        self.daemon = daemon
        # vLLM sets its hash_block_size after the connector is made: read it per request
        self._kv_cache_config = kv_cache_config
        self._fenced: dict[str, tuple[int, list]] = {}  # rid: (first hash fenced, originals)
        self._said: dict[str, dict[str, int]] = {}  # rid: what the response will say
        # rid: the chunks it stores or waits on being stored (the response's "stores")
        self._storing: dict[str, list[bytes]] = {}
        # chunks missed by separator-split requests, to prefill alone and store
        self._misses: deque[MissSpec] = deque()
        self._missed: OrderedDict[bytes, float] = OrderedDict()  # hash: when it was queued
        self._logged: set[str] = set()
        self._plans: dict[str, plan.Plan] = {}  # the last answer, for update_state_after_alloc
        # requests whose load was claimed asynchronous (load_kv_async), until vLLM
        # allocates their blocks; then those whose asynchronous load is in flight, until
        # vLLM schedules them after it (update_state_after_alloc again, no external tokens)
        self._early_claims: set[str] = set()
        self._early_loading: set[str] = set()
        self._loads: list[LoadSpec] = []
        self._stores: dict[str, _Pending] = {}
        self.cost = cost.CostModel(config.load_cost_margin, config.load_cost_check)
        self._blend_declined_logged = -float("inf")
        self._totals: dict[str, int] = {}  # vLLM's connector stats (kvblend.vllm.stats)
        # why the worker turned kvblend off for good (KvblendWorkerMeta.off): no claims
        self._off: str | None = None

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("kvblend: " + msg, *args)

    def _parse(self, request: Request, num_computed_tokens: int, separator: Any,
               blend_cfg: Any) -> Any:
        """The request's parameters parsed (plan.parse_request), or None: malformed, logged
        once per request (vLLM asks again while the request waits for blocks)."""
        cfg = self.config
        try:
            parsed = plan.parse_request(
                request.kv_transfer_params,
                request.prompt_token_ids or [],
                num_computed_tokens,
                cfg.model.num_layers,
                separator,
                blend_cfg,
                plan.request_scope(request),
            )
            if cfg.tensor_parallel > 1 and parsed.blend is not None and \
                    parsed.blend.metric == "attention":
                raise plan.ParamError(
                    f"kvblend.blend.metric 'attention' under tensor parallelism "
                    f"({cfg.tensor_parallel} ranks): each head's deviation is weighed by "
                    "its own A (value, key, question and anchored blend under it)"
                )
        except plan.ParamError as e:
            self._log_once(
                "params:" + request.request_id,
                "request %s served without kvblend: %s",
                request.request_id,
                e,
            )
            return None
        return parsed

    def _parse_only(self, request: Request, num_computed_tokens: int) -> plan.Plan:
        """Parse the request's parameters (for a store); look nothing up, claim nothing."""
        if self._off is not None:
            return plan.Plan()
        # no separator split: its chunks would only be looked up; nor blended
        parsed = self._parse(request, num_computed_tokens, None, None)
        return plan.Plan() if parsed is None else plan.Plan(parsed=parsed)

    def _plan(self, request: Request, num_computed_tokens: int) -> plan.Plan:
        """Plan a request; a malformed one or a daemon error plans nothing (logged once).

        Once the worker turned kvblend off for good, nothing: plain vLLM, no lookup, no
        store (the worker logged why).
        """
        if self._off is not None:
            return plan.Plan()
        cfg = self.config
        if cfg.blend is None and plan.split_override(request.kv_transfer_params)[1] is not None:
            self._log_once(
                "override",
                "requests carry blend settings, but 'blend' is "
                "not configured (or refused): full reuse",
            )
        parsed = self._parse(request, num_computed_tokens, cfg.separator, cfg.blend)
        if parsed is None:
            return plan.Plan()
        if not parsed.hashes:
            # no chunk to look up (no kvblend parameters, no separator in the prompt):
            # plain vLLM, and the daemon is not asked (nor waited for when it is down)
            return plan.Plan(parsed=parsed)
        try:
            out = plan.lookup_plan(
                self.daemon.client(),
                cfg.model_name,
                cfg.model.num_layers,
                parsed,
                num_computed_tokens,
            )
        except KvblendError as e:
            # the link logs the outage once and fails at once during its back-off
            self.daemon.failed(e)
            return plan.Plan(parsed=parsed)
        self.daemon.ok()
        return out

    def _external_kv_skipped(self, request: Request) -> bool:
        """Whether vLLM will not read this request's external tokens, whatever we answer.

        vLLM 0.34's ``Request.skip_reading_external_kv`` (a bounded prefix-cache read:
        prompt logprobs, ``skip_reading_prefix_cache``); 0.32 and 0.33 drop the
        connector's answer for ``Request.skip_reading_prefix_cache`` (which prompt
        logprobs set unless the request says otherwise). Said once per engine at info,
        and per request at debug.
        """
        skip = getattr(request, "skip_reading_external_kv", None)
        if skip is None:
            skip = getattr(request, "skip_reading_prefix_cache", False)
        if not skip:
            return False
        if "skip-external" not in self._logged:
            self._logged.add("skip-external")
            logger.info(
                "kvblend: vLLM reads no external KV for requests with prompt logprobs or "
                "skip_reading_prefix_cache (%s): kvblend neither looks them up nor loads or "
                "blends for them (a request that asks to store its prompt still stores "
                "it); this line once per engine",
                request.request_id,
            )
        logger.debug("kvblend: request %s: external KV skipped by vLLM, no lookup",
                     request.request_id)
        return True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens from ``num_computed_tokens`` on that stored chunks provide.

        A request whose external tokens vLLM will not read (:meth:`_external_kv_skipped`)
        gets 0, no lookup, no fence and no missed chunk queued; its parameters are still
        parsed, so that one asking to store its prompt (computed in full) stores it.
        """
        rid = request.request_id
        if rid in self._early_loading:
            # asked again before it ran after its asynchronous load: the load failed and
            # vLLM computes the request (no second try of what just failed)
            self._early_loading.discard(rid)
            logger.debug("kvblend: request %s: its asynchronous load failed: computed", rid)
            p = self._parse_only(request, num_computed_tokens)
        elif self._external_kv_skipped(request):
            p = self._parse_only(request, num_computed_tokens)
        else:
            p = self._plan(request, num_computed_tokens)
        declined = 0
        if p.tokens > 0 and not self._worth_loading(p):
            declined = p.tokens
            p = plan.Plan(parsed=p.parsed, missing=p.missing)  # computed; misses still stored
        self._plans[request.request_id] = p  # kept for update_state_after_alloc
        self._storing.pop(request.request_id, None)  # as scheduled when it last starts
        self._fence(request, p, num_computed_tokens)
        n = len(request.prompt_token_ids or [])
        self._said[request.request_id] = {
            "prompt_tokens": n,
            "prefix_cached": num_computed_tokens,
            "reused": 0,
            "blended": 0,
            "computed": n - num_computed_tokens,
            "stored": 0,
            "load_declined": declined,
        }
        if p.blend is not None:  # the share of its chunk tokens the blend recomputes
            self._said[request.request_id]["blend_ratio"] = p.blend.config.ratios[-1] if (
                p.blend.config.ratios) else 0.0
        # a reuse load starts early (asynchronous) when so configured; a blend runs in the
        # request's own forward pass, so it never does
        # only a load the daemon can land (whole chunks back to back from position 0, a
        # local ipc:// daemon) gains from starting early; a copied one would take one more
        # step than copying it in the request's own
        early = (self._async_loads() and p.blend is None and p.tokens > 0
                 and self.config.endpoint.startswith("ipc://")
                 and plan.landable(p.loads) is not None)
        if early:
            self._early_claims.add(rid)
        else:
            self._early_claims.discard(rid)
        return p.tokens, early

    def _async_loads(self) -> bool:
        """``async_loads``, unless the test hook :data:`SYNC_ENV` says otherwise now."""
        if not self.config.async_loads:
            return False
        sync = os.environ.get(SYNC_ENV)
        return not (sync and os.path.exists(sync))

    def may_load_async(self, request: Request) -> bool:
        """Whether vLLM 0.34 may queue the request with the asynchronous loads.

        True with ``async_loads`` on for a request whose kvblend parameters ask for reuse,
        not a blend: :meth:`get_num_new_matched_tokens` then answers ``load_kv_async``
        for what it finds, and vLLM may start the load while the running batch is full
        (``--max-num-inflight-kv-loads``). False for a blend (it runs in the request's
        own forward pass, which needs a running slot), a request without chunk segments
        in its kvblend parameters (a separator-split one claims only after a prefix-cache
        hit), one whose external KV vLLM will not read, a ``tcp://`` daemon (loads are
        copied), while the daemon is known down, and once kvblend is off: such a request
        at the head of vLLM's asynchronous queue would hold the loads behind it. No
        daemon call.
        """
        if not self.config.async_loads or self._off is not None or self.daemon.is_open:
            return False
        if getattr(request, "skip_reading_external_kv", False):
            return False
        if not self.config.endpoint.startswith("ipc://"):
            return False  # loads are copied: they start in the request's own step
        kvp, override = plan.split_override(request.kv_transfer_params)
        if self.config.blend is not None and override is not False:
            return False
        inner = kvp.get("kvblend") if isinstance(kvp, dict) else None
        segs = inner.get("segments") if isinstance(inner, dict) else None
        # a chunk to look up (not only fresh segments, nor a store of the prompt alone)
        return isinstance(segs, list) and any(
            isinstance(x, (list, tuple)) and len(x) == 3 and x[2] == "chunk" for x in segs)

    def _worth_loading(self, p: plan.Plan) -> bool:
        """Whether loading the plan's tokens costs less than computing them (logged per change)."""
        if p.blend is not None:  # judged by its own share of stored tokens
            self._choose_ratio(p)
            computed = p.blend.predicted_computed()
            load, d, changed = self.cost.pays(cost.BLEND, p.tokens, len(p.blend.ids), computed)
            kind = cost.BLEND
            if self.cost.blend_coefficients() is None:
                pass  # the per-token rate decided: logged per change, as reuse
            elif d.pays:
                return load  # decided per request: no line per change
            else:  # one line a window, not one per change
                now = time.monotonic()
                if now - self._blend_declined_logged >= cost.PROBE_S:
                    self._blend_declined_logged = now
                    logger.info(
                        "kvblend: a blend of %d tokens recomputing %d costs %s a token, "
                        "prefill %s: computed instead (blends are judged per request; this "
                        "line at most every %.0f s)",
                        len(p.blend.ids), computed, _us(d.load_spt), _us(d.prefill_spt),
                        cost.PROBE_S,
                    )
                return load
        else:
            kind = cost.REUSE
            load, d, changed = self.cost.pays(kind, p.tokens)
        if changed:
            if d.pays:
                logger.info(
                    "kvblend: loading (%s) pays again: %s a token against prefill's %s",
                    kind, _us(d.load_spt), _us(d.prefill_spt),
                )
            else:
                logger.warning(
                    "kvblend: loading (%s) costs %s a token, prefill %s: computing instead "
                    "(one load every %.0f s measures the daemon again)",
                    kind, _us(d.load_spt), _us(d.prefill_spt), cost.PROBE_S,
                )
        return load

    def _choose_ratio(self, p: plan.Plan) -> None:
        """A blend asked for by a latency budget (``budget_ms``) gets its ratio here, from
        the cost model's fit (:meth:`kvblend.vllm.cost.CostModel.blend_ratio`)."""
        cfg = p.blend.config
        if cfg.budget_ms is None:
            return
        fresh, chunk = p.blend.computable()
        r, why = self.cost.blend_ratio(
            p.tokens, len(p.blend.ids), fresh, chunk, cfg.budget_ms / 1000, cfg.min_ratio,
            cfg.ratios[-1],
        )
        p.blend.config = dataclasses.replace(cfg, ratios=(r,))
        logger.debug("kvblend: a blend of %d tokens within %.0f ms: ratio %.3f (%s)",
                     len(p.blend.ids), cfg.budget_ms, r, why)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the workers' load and prefill times of the last step, and kvblend off.

        A worker that turned kvblend off for good (``KvblendWorkerMeta.off``) turns the
        scheduler's claims off too.
        """
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvblendWorkerMeta):
            self.cost.note(meta.samples)
            if meta.failed_tokens:
                self._count("recomputed_after_failure", meta.failed_tokens)
            if meta.off and self._off is None:
                self._off = meta.off

    def _count(self, key: str, n: int) -> None:
        self._totals[key] = self._totals.get(key, 0) + n

    def take_stats(self) -> dict[str, int] | None:
        """The figures of the requests finished since the last call (None: none)."""
        if not any(self._totals.values()):
            return None
        out, self._totals = self._totals, {}
        return out

    def _fence(self, request: Request, p: plan.Plan, num_computed_tokens: int = 0) -> None:
        """Keep the blocks a load makes inexact out of vLLM's prefix cache.

        vLLM caches a request's full blocks under ``request.block_hashes``: hash i
        fingerprints the prompt's tokens up to the end of block i (chained), and a later
        request with the same tokens gets the block as if computed after that prefix.
        From the block holding :attr:`kvblend.vllm.plan.Plan.first_inexact` on, the KV
        is not that, so those hashes are replaced by hashes of their own (the original
        and the request's id through BLAKE2b): vLLM still caches the blocks, under names
        no other request has, and the hashes of blocks appended later chain from them.
        The exact prefix before (a system prompt, a chat header, a chunk at position 0)
        keeps its hashes and vLLM's prefix caching. vLLM may ask again before it
        schedules the request: the originals are put back first, so the fence follows the
        latest plan. Except for a request asked again after its fenced blocks were computed
        (preempted, then resumed): when vLLM's prefix cache gave it back its own blocks past
        the fence (``num_computed_tokens``), their KV is still the load's, and the fence
        stays.
        """
        rid = request.request_id
        hashes = request.block_hashes
        hbs = getattr(self._kv_cache_config, "hash_block_size", None) or self.config.block_size
        old = self._fenced.pop(rid, None)
        if old is not None:
            k, orig = old
            if num_computed_tokens > k * hbs:
                self._fenced[rid] = old  # its own inexact blocks again: they stay fenced
                return
            hashes[k : k + len(orig)] = orig
        first = p.first_inexact
        if first is None or not self.config.prefix_caching:
            return
        k = first // hbs
        if k >= len(hashes):
            return  # no full block there yet: later hashes chain from the request's own
        orig = list(hashes[k:])
        salt = rid.encode()
        hashes[k:] = [
            type(h)(hashlib.blake2b(bytes(h) + b"kvblend-fence" + salt,
                                    digest_size=len(h)).digest())
            for h in orig
        ]
        self._fenced[rid] = (k, orig)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the request's blocks and claim; note a request that stores.

        Uses the plan :meth:`get_num_new_matched_tokens` kept (no second lookup); a
        request vLLM did not ask about this time has its parameters parsed here.
        """
        rid = request.request_id
        p = self._plans.pop(rid, None)
        if p is None and num_external_tokens == 0 and rid in self._early_loading:
            # scheduled after its asynchronous load: decided when the load was claimed
            self._early_loading.discard(rid)
            return
        if p is not None and p.missing and self.config.store_on_miss:
            queued, storing = self._queue_misses(p)
            if queued and rid in self._said:
                self._said[rid]["stored"] += queued
            if storing:
                self._storing[rid] = storing
        block_ids = list(blocks.get_block_ids()[0])
        bs = self.config.block_size
        if num_external_tokens > 0:
            early = rid in self._early_claims  # as get_num_new_matched_tokens answered
            self._early_claims.discard(rid)
            if p is None or p.tokens != num_external_tokens:
                self._log_once("claim", "claim changed under vLLM for %s: no load", rid)
                if early:
                    # vLLM waits for this load's end (WAITING_FOR_REMOTE_KVS): a load that
                    # fails at once (its blocks recomputed) ends it; vLLM trims a claim to
                    # whole blocks in some configurations (0.34's prefix replay)
                    self._early_loading.add(rid)
                    self._loads.append(LoadSpec(rid, p.loads if p is not None else [],
                                                block_ids, bs, early=True,
                                                fail="the claim changed under vLLM"))
                return
            said = self._said.get(rid)
            if said is not None:
                said["blended" if p.blend is not None else "reused"] = num_external_tokens
                said["computed"] -= num_external_tokens
            if p.blend is not None:
                self._loads.append(LoadSpec(rid, [], block_ids, bs, p.blend))
                return
            if early:
                self._early_loading.add(rid)
            self._loads.append(LoadSpec(rid, p.loads, block_ids, bs, early=early))
            return
        self._early_claims.discard(rid)  # no external tokens after all
        ids = request.prompt_token_ids or []
        if p is not None:
            params = p.parsed.params if p.parsed is not None else None
        else:
            try:
                params = plan.parse_params(
                    plan.split_override(request.kv_transfer_params)[0], len(ids)
                )
            except plan.ParamError:
                return
        if params is None or not params.store:
            return
        why = plan.store_shape_error(params, len(ids))
        if why:
            logger.warning("kvblend: request %s not stored: %s", rid, why)
            return
        # the planner hashed the one chunk, which is the whole prompt
        if p is not None:
            h = p.parsed.hashes[0]
        else:
            try:
                h = scoped_chunk_hash(ids, plan.request_scope(request))
            except plan.ParamError as e:  # its adapter cannot be keyed: not stored
                logger.warning("kvblend: request %s not stored: %s", rid, e)
                return
        self._stores[rid] = _Pending(h, len(ids), block_ids)
        self._storing[rid] = [h]
        if rid in self._said:
            self._said[rid]["stored"] = len(ids)

    def _queue_misses(self, p: plan.Plan) -> tuple[int, list[bytes]]:
        """Queue the chunks a separator-split request missed, each once.

        A chunk queued in the last :data:`MISS_WINDOW_S` seconds is not queued again
        (concurrent requests that miss the same document store it once; one whose store
        failed is tried again after the window). Returns the tokens this request queued,
        and the hashes of every chunk it missed that is queued (by it or, within the
        window, by an earlier request): what a client waits for (the response's
        ``stores``).
        """
        if p.parsed is None or not p.parsed.by_separator:
            return 0, []
        now = time.monotonic()
        while self._missed and next(iter(self._missed.values())) < now - MISS_WINDOW_S:
            self._missed.popitem(last=False)
        ids = p.parsed.ids
        queued, storing = 0, []
        for h, start, length in p.missing:
            if length < 1:
                continue
            storing.append(h)
            if h in self._missed:
                continue
            self._missed[h] = now
            self._misses.append(MissSpec(h, ids[start : start + length]))
            queued += length
        while len(self._misses) > MAX_QUEUED_MISSES:  # the oldest go first
            self._missed.pop(self._misses.popleft().hash, None)
        return queued, [h for h in storing if h in self._missed]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvblendMetadata:
        """Return this step's loads, completed stores and missed chunks to store; loaded
        blocks are not zeroed."""
        meta = KvblendMetadata(
            loads=self._loads, scheduled_tokens=scheduler_output.total_num_scheduled_tokens
        )
        self._loads = []
        budget = self.config.store_tokens_per_step
        while self._misses and (not meta.misses or len(self._misses[0].ids) <= budget):
            m = self._misses.popleft()
            meta.misses.append(m)
            budget -= len(m.ids)
        overwritten: set[int] = set()
        for ld in meta.loads:
            spans = [(c.first, c.last) for c in ld.chunks]
            if ld.blend is not None:
                spans.append((ld.blend.skip, len(ld.blend.ids)))
            for first, last in spans:
                for b in full_blocks(first, last, ld.block_size):
                    overwritten.add(ld.block_ids[b])
        zero = scheduler_output.new_block_ids_to_zero
        if zero and overwritten:
            scheduler_output.new_block_ids_to_zero = [b for b in zero if b not in overwritten]
        scheduled = scheduler_output.num_scheduled_tokens
        progress: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id in self._stores:
                self._stores[r.req_id].block_ids = list(r.block_ids[0])
                progress[r.req_id] = r.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.32 and 0.33 send a request resumed after preemption as a cached one whose
        # new_block_ids is its whole block list; 0.34 sends it again as a new request
        # (scheduled_new_reqs, above) and has no resumed_req_ids
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            if rid in self._stores:
                new = cached.new_block_ids[i]
                if rid in resumed:
                    # Resumed after preemption: new_block_ids is its whole block list.
                    self._stores[rid].block_ids = list(new[0]) if new else []
                elif new:
                    self._stores[rid].block_ids.extend(new[0])
                progress[rid] = cached.num_computed_tokens[i]
        for rid, done in progress.items():
            st = self._stores[rid]
            if done + scheduled.get(rid, 0) >= st.length:
                spec = StoreSpec(rid, st.hash, st.length, st.block_ids, self.config.block_size)
                meta.stores.append(spec)
                del self._stores[rid]
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        """Forget the request; its blocks are vLLM's to free at once.

        Returns the request's ``kv_transfer_params`` for its response (vLLM hands them to
        the client): ``{"kvblend": {"prompt_tokens", "prefix_cached" (vLLM's own prefix
        cache), "reused" (chunks loaded as stored, keys re-rotated), "blended" (the
        context of a CacheBlend load, its selected tokens recomputed by the pass),
        "computed" (by vLLM after the claim), "stored" (tokens this request stores: its
        prompt with ``store``, or the chunks it missed, queued to be stored on a miss),
        "load_declined" (tokens stored chunks could have provided, computed instead
        because loading them costs more than computing them: :mod:`kvblend.vllm.cost`),
        and for a request that stores: "stores" ({"model": the model name, "chunks": the
        hex hashes of the chunks it stores, or missed and are queued to be stored},
        which :func:`kvblend.vllm.documents.wait_for_stores` waits for)}}``, as scheduled
        when the request last started (a resumed request: its last start).
        """
        rid = request.request_id
        said = self._said.pop(rid, None)
        storing = self._storing.pop(rid, None)
        if said is not None:
            self._count("requests", 1)
            for k, v in said.items():
                if k != "blend_ratio":  # a share, not a count (the stats sum counts)
                    self._count(k, v)
        self._plans.pop(rid, None)
        self._stores.pop(rid, None)
        self._fenced.pop(rid, None)
        self._early_claims.discard(rid)
        self._early_loading.discard(rid)
        self._logged.discard("params:" + rid)
        if said is None:
            return False, None
        out: dict[str, Any] = dict(said)
        if storing:
            out["stores"] = {"model": self.config.model_name,
                             "chunks": [h.hex() for h in storing]}
        return False, {"kvblend": out}

