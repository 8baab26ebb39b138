"""The connector's worker half: chunks into vLLM's cache before the forward pass, out after.

Runs in each vLLM worker process. It keeps views of vLLM's cache
(:class:`kvblend.vllm.layout.PagedCache`), and with the cache in a kvblend region
(:class:`kvblend.vllm.landing.CacheRegion`) lets the daemon land loads straight into it;
other loads are copied from the daemon's reply, and blends run the blend pass over vLLM's
model (:mod:`kvblend.vllm.blend`). A failed load is reported to vLLM, which recomputes
its blocks. Stores gather a prefilled prompt's rows layer by layer and PUT them. Under
tensor parallelism each rank lands and writes its own KV heads of the chunks (stored with
all of them), and a store's heads are gathered to rank 0, which PUTs the chunk once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..blend import loop as blend_loop
from ..errors import KvblendError, ModelConflict, Unavailable
from . import blend, cost, plugin, selftest
from .config import ConnectorConfig, ModelClash, logger, model_clash, refuse
from .daemon import PROBE_MAX_S, WAIT_SLICE_S, DaemonLink, probe
from .landing import CacheRegion, DeviceLanding
from .layout import LayoutError, PagedCache, blocks_of
from .metadata import KvblendMetadata, KvblendWorkerMeta, LoadSpec
from .misses import MissStorer
from .plugin import ModelUnreachable, loaded_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Test hook: while the file this names exists, the worker's next load fails (and removes it);
#: a file reading ``rank N`` fails only tensor-parallel rank N's; one with ``layer L`` (after
#: ``rank N`` or alone) fails the next blend inside its pass, at layer L's attention, instead.
FAIL_LOAD_ENV = "KVBLEND_VLLM_FAIL_LOAD_FILE"

#: Test hook: while the file this names exists, loads are copied, not landed.
COPY_ENV = "KVBLEND_VLLM_COPY_FILE"

#: Debug hook: when set to a folder, the worker writes the raw cache blocks it filled in
#: each load there (``load-<n>.npz``), for tests that check the landed rows independently.
DUMP_ENV = "KVBLEND_VLLM_DUMP_DIR"


#: Longest wait for an asynchronous landing in a step that computes nothing (only loads
#: in flight): the engine sleeps on the progress word instead of stepping in a busy loop.
EARLY_IDLE_WAIT_S = 0.01


@dataclass
class _Early:
    """An asynchronous load the daemon is landing (:meth:`WorkerSide.get_finished`)."""

    load: LoadSpec
    session: Any
    t0: float  # when its open was sent
    held: float  # seconds it held the engine: the open, the looks (and the close)
    probed: float = 0.0  # when the daemon was last probed for it
    why: str | None = None  # why it failed, once it has
    dead: bool = False  # its daemon was found gone: no close


class KvblendOff(RuntimeError):
    """kvblend is off for good on this engine (:meth:`WorkerSide._turn_off`): no call made."""


class WorkerSide:
    """The worker's half of :class:`kvblend.vllm.KvblendConnector`.

    Parameters
    ----------
    config : ConnectorConfig
        The connector's configuration.
    daemon : DaemonLink
        The connection loads and stores go through (it registers the model).
    vllm_config : VllmConfig
        vLLM's configuration (its forward context, the model for blending).
    kv_cache_config : KVCacheConfig
        vLLM's KV-cache allocations.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        daemon: DaemonLink,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        self.config = config
        self.daemon = daemon
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.cache = PagedCache(config.model, config.block_size)
        self._blend_model: Any = None
        # FAIL_LOAD_ENV's "layer L" or "preview L", as ("layer", L): the next pass's
        self._fail_layer: tuple[str, int] | None = None
        self._load_errors: set[int] = set()
        self._gathered: dict[str, np.ndarray] = {}
        self._dump_dir = os.environ.get(DUMP_ENV)
        self._dumps = 0
        self._region: CacheRegion | None = None  # the cache in a kvblend region (landing)
        self._landing: dict[str, LoadSpec] = {}  # this step's loads the daemon lands
        # asynchronous loads (LoadSpec.early): landing between steps, and those that ended
        # (landed, copied or failed) since vLLM last asked (get_finished)
        self._early: dict[str, _Early] = {}
        self._early_done: set[str] = set()
        self._step_scheduled = 0  # tokens this step computes (0: only loads in flight)
        self._misses: MissStorer | None = None  # store on a miss
        # the cost model's samples (kvblend.vllm.cost), sent to the scheduler each step
        self._samples: list[tuple[str, int, float]] = []
        self._failed_tokens = 0
        self._step_t0: float | None = None
        self._step_tokens = 0
        # steps are timed on the CPU only: on a GPU the forward pass is asynchronous, and
        # its host-side time is not what it costs (no prefill samples: loads go ahead)
        self._time_steps = True
        # the RoPE self-test (kvblend.vllm.selftest): the rotary modules it still has to
        # check (run at start, or before the first load when the daemon was down then),
        # and why loads are refused for good when it failed
        self._rope_pending: list[tuple[str, Any]] | None = None
        self._rope_bad: str | None = None
        # the model registered once (a clash is told from an outage there: _register)
        self._registered = False
        # why kvblend is off for good (a clash or a failed self-test found after the
        # start), and whether the scheduler has been told
        self._off: str | None = None
        self._off_told = False
        # tensor parallelism: this rank, the ranks, and vLLM's group of them (None at 1)
        self._tp_rank, self._tp_size, self._tp_group = 0, 1, None

    def get_mem_pool_context(self) -> Any:
        """Place vLLM's one KV-cache allocation in a kvblend region (ipc:// daemons).

        Returns a context (see :mod:`kvblend.vllm.landing`) or None: vLLM then allocates
        as usual and loads take the copy path (one log line says why). Not on a GPU: the
        region is host memory; there vLLM allocates from its own pool and the daemon
        lands into that allocation (:class:`kvblend.vllm.landing.DeviceLanding`, set up
        by :meth:`register_kv_caches`).
        """
        dev = getattr(self._vllm_config.device_config, "device_type", "cpu")
        if dev != "cpu":
            return None
        sizes = {t.size for t in self._kv_cache_config.kv_cache_tensors}
        if len(sizes) != 1:
            logger.warning("kvblend: landing off: %d KV-cache allocations, not one", len(sizes))
            return None
        cfg = self.config
        self._region = CacheRegion(cfg.endpoint, cfg.timeout_ms, sizes.pop(), logger)
        return self._region.context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep K and V views of each layer's cache (kvblend.vllm.layout); register the model."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        devices = sorted({t.device.type for t in kv_caches.values()})
        if len(devices) != 1:
            raise refuse(f"KV cache layers on several devices {devices}")
        if devices != ["cpu"]:
            self._time_steps = False
            # vLLM's GPU layout (layout.INTERLEAVED, read from the views' strides); loads
            # landed by a kvblendd fusing on this GPU, else copied from its reply; the
            # blend pass with vLLM's FlashAttention (PyTorch's attention in float32)
            logger.warning(
                "kvblend: KV cache on %s: loads land in it when kvblendd fuses on this GPU "
                "(--device cuda), else are copied from host memory; blends run with "
                "vLLM's FlashAttention; this path is tested over CPU memory laid out as vLLM "
                "lays it out on a GPU (the daemon's landing on its emulated device), and "
                "has not yet run on a GPU (docs/vllm.md, \"On GPUs\")", devices[0],
            )
            if devices == ["cuda"] and self.config.device_landing:
                cfg = self.config
                self._region = DeviceLanding(cfg.endpoint, cfg.timeout_ms, logger)
            elif devices == ["cuda"]:
                logger.info("kvblend: device_landing 'off' (or a tcp:// endpoint): loads "
                            "are copied from the daemon's reply")
        self._tensor_parallel()
        try:
            self.cache.register(kv_caches, ctx)
        except LayoutError as e:
            raise refuse(str(e)) from None
        if self.config.blend is not None:
            try:
                self._blend_model = blend.worker_model(self._vllm_config)
            except (RuntimeError, AttributeError) as e:
                raise refuse(f"blending configured, but {e}") from None
        if self.config.store_on_miss:
            self._start_misses()
        self._start_self_test()
        if self._region is not None:
            layers = self.cache.layers_in_order()
            self._region.attach(
                layers, self.config.model, self.cache.block_size, self.cache.kind,
                self.cache.heads,
            )
        try:
            self.daemon.client()
        except KvblendError:
            pass  # the link logged it, and retries with a back-off

    def _tensor_parallel(self) -> None:
        """Take this rank's KV heads: rank r of t holds heads r * H/t .. (r + 1) * H/t - 1.

        Chunks are stored with all the model's heads (so that they serve every TP degree);
        each rank lands or writes its own range, and stores gather the ranks' ranges to
        rank 0, which PUTs the whole chunk once (:meth:`wait_for_save`).
        """
        size = self._vllm_config.parallel_config.tensor_parallel_size
        if size == 1:
            return
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        heads = self.config.model.num_kv_heads // size  # connector_config: size divides it
        self._tp_rank, self._tp_size, self._tp_group = g.rank_in_group, size, g
        self.cache.heads = (g.rank_in_group * heads, heads)
        logger.info(
            "kvblend: tensor-parallel rank %d of %d: KV heads %d..%d of %d",
            g.rank_in_group, size, g.rank_in_group * heads, (g.rank_in_group + 1) * heads - 1,
            self.config.model.num_kv_heads,
        )

    def _gather_heads(self, buf: np.ndarray | None, length: int) -> np.ndarray | None:
        """Rank 0: ``buf`` with every rank's heads; other ranks: None (they send theirs).

        Every rank calls it for each store of a step, in the metadata's order (the same on
        every rank), so the collective cannot cross another. A rank without the rows
        sends zeros, and rank 0 then stores nothing (``None``).
        """
        import torch.distributed as dist

        h0, hn = self.cache.heads
        model = self.config.model
        missing = buf is None
        if missing:
            buf = np.zeros(model.kv_shape(length), model.np_dtype)
        mine = np.ascontiguousarray(buf[:, :, :, h0 : h0 + hn])
        flag = torch.tensor([1 if missing else 0], dtype=torch.int32)
        g = self._tp_group
        dist.all_reduce(flag, group=g.cpu_group)
        parts = (
            [torch.empty(mine.nbytes, dtype=torch.uint8) for _ in range(self._tp_size)]
            if self._tp_rank == 0
            else None
        )
        dist.gather(torch.from_numpy(mine.reshape(-1).view(np.uint8)), parts,
                    dst=g.ranks[0], group=g.cpu_group)
        if self._tp_rank != 0 or int(flag.item()):
            return None
        for r, part in enumerate(parts):
            buf[:, :, :, r * hn : (r + 1) * hn] = part.numpy().view(buf.dtype).reshape(mine.shape)
        return buf

    def _start_self_test(self) -> None:
        """Register the model, then run the RoPE self-test: the start's checks.

        The self-test checks the daemon's re-rotation against vLLM's rotary modules
        (kvblend.vllm.selftest). A model-name clash (kvblendd holds another description
        under the model's name, :func:`kvblend.vllm.config.model_clash`) or a failed
        self-test refuses the start, in one line. With the daemon down, both run before
        the first load or store, and either then turns kvblend off for good
        (:meth:`_turn_off`).
        """
        model = self._blend_model
        try:
            if model is None:
                model = loaded_model(self._vllm_config)
            self._rope_pending = selftest.rotaries_of(model)
        except (ModelUnreachable, AttributeError) as e:
            logger.warning("kvblend: RoPE self-test not run (%s): loads trust the "
                           "model's description", e)
        try:
            self._self_test(self._register())
        except (ModelClash, selftest.SelfTestFailed) as e:
            raise refuse(str(e)) from None
        except KvblendError as e:
            self.daemon.failed(e)  # as any failed call: the link opens and backs off
            logger.info("kvblend: model registration and RoPE self-test deferred to the "
                        "first load (%s)", e)

    def _register(self) -> Any:
        """Return the link's client, the model registered on it at least once.

        The first registration is made here, on a connection the link makes without
        registering: kvblendd's ``model_conflict`` is a model-name clash, which the link
        would take for an outage (and retry after each pause, the scheduler claiming on).
        Later connections register through the link.

        Raises
        ------
        ModelClash
            kvblendd holds another description under the name; the message names the
            differing fields (:func:`kvblend.vllm.config.model_clash`).
        KvblendError
            The daemon could not be asked (the link opened).
        """
        link = self.daemon
        if self._registered:
            return link.client()
        model, link.model = link.model, None  # connect only
        try:
            client = link.client()
        finally:
            link.model = model
        try:
            client.model_register(self.config.model)
        except ModelConflict as e:
            why = model_clash(client, self.config.model, e.message)
            link.drop()
            raise ModelClash(why) from None
        except KvblendError as e:
            link.failed(e)
            raise
        self._registered = True
        return link.client()  # the link registers on it too (kvblendd answers "existed")

    def _self_test(self, client: Any) -> None:
        """Run the self-test if it has not passed yet (raises SelfTestFailed, KvblendError)."""
        if self._rope_bad is not None:
            raise selftest.SelfTestFailed(self._rope_bad)
        if self._rope_pending is None:
            return
        from vllm.config import set_current_vllm_config

        try:
            with set_current_vllm_config(self._vllm_config):
                # a seed of its own a rank: the ranks' tests run at once on one daemon
                line = selftest.run(
                    client, self.config.model, self._rope_pending, seed=self._tp_rank
                )
        except selftest.SelfTestFailed as e:
            self._rope_bad = str(e)
            self._rope_pending = None
            raise
        self._rope_pending = None
        logger.info("kvblend: %s", line)

    def _daemon_client(self) -> Any:
        """Return the client for a load or a store: the model registered, the self-test run.

        A clash or a failed self-test found here (the daemon was down at start) turns
        kvblend off for good.

        Raises
        ------
        KvblendOff
            kvblend is off for good (at once, without a call).
        KvblendError
            The daemon could not be asked (the link opened).
        """
        if self._off is not None:
            raise KvblendOff(self._off)
        try:
            client = self._register()
            self._self_test(client)
        except (ModelClash, selftest.SelfTestFailed) as e:
            self._turn_off(str(e))
            raise KvblendOff(str(e)) from None
        except ModelConflict as e:  # the link's registration on a later connection
            self._turn_off(f"model '{self.config.model.name}': {e}")
            raise KvblendOff(str(e)) from None
        return client

    def _turn_off(self, why: str) -> None:
        """Turn kvblend off for good on this engine, in one line.

        Loads fail at once (vLLM recomputes them), nothing is stored, and the scheduler
        is told with the next step's metadata (:meth:`build_worker_meta`): it claims
        nothing from then on, so every request is plain vLLM.
        """
        if self._off is not None:
            return
        self._off = why.removeprefix("kvblend: ")
        logger.error("kvblend: off for this engine: %s; every request is served as plain vLLM",
                     self._off)

    def _start_misses(self) -> None:
        """Start storing missed chunks (needs the model, as the blend pass; else one line)."""
        model = self._blend_model
        if model is None:
            try:
                model = blend.worker_model(self._vllm_config)
            except (RuntimeError, AttributeError) as e:
                logger.warning("kvblend: store on a miss off: %s", e)
                return
        # the thread computes only while vLLM's runner does not (kvblend.vllm.misses)
        why = plugin.lock_runner_steps()
        if why is not None:
            logger.warning("kvblend: store on a miss off: %s", why)
            return
        cfg = self.config
        link = DaemonLink(cfg.endpoint, cfg.timeout_ms, cfg.model, logger)
        self._misses = MissStorer(model, cfg.model, link, logger, cfg.store_idle_ms / 1000)
        idle = (
            f"; each layer after the engine idled {cfg.store_idle_ms} ms, or after "
            f"{plugin.PATIENCE_S * 1000:.0f} ms" if cfg.store_idle_ms else ""
        )
        logger.info(
            "kvblend: store on a miss on (at most %d tokens a step%s)",
            cfg.store_tokens_per_step, idle,
        )

    def step_begin(self, meta: KvblendMetadata | None = None) -> None:
        """vLLM bound this step's metadata: its forward pass follows.

        A step that loads nothing is timed (the prefill rate), on the CPU.
        """
        self._step_t0 = None
        self._step_scheduled = meta.scheduled_tokens if meta is not None else 0
        if (
            self._time_steps
            and meta is not None
            and not meta.loads
            and meta.scheduled_tokens >= cost.MIN_STEP_TOKENS
        ):
            self._step_tokens = meta.scheduled_tokens
            self._step_t0 = time.monotonic()

    def step_end(self) -> None:
        """vLLM cleared this step's metadata: the forward pass is over."""
        if self._step_t0 is not None:
            self._samples.append(
                (cost.PREFILL, self._step_tokens, time.monotonic() - self._step_t0)
            )
            self._step_t0 = None

    def build_worker_meta(self) -> KvblendWorkerMeta | None:
        """This step's cost samples and failed loads for the scheduler (None: nothing)."""
        if self._tp_rank:
            self._samples = []  # rank 0's: every rank times the same loads and steps
        off = None
        if self._off is not None and not self._off_told:
            off, self._off_told = self._off, True
        if not self._samples and not self._failed_tokens and off is None:
            return None
        out = KvblendWorkerMeta(self._samples, self._failed_tokens, off)
        self._samples, self._failed_tokens = [], 0
        return out

    def start_load_kv(self, meta: KvblendMetadata) -> None:
        """Land (or write) each claimed chunk, re-rotated to its position, in the request's blocks.

        With the cache in a region, a load whose chunks lie back to back from position 0
        gets a landing session: the daemon writes the layers itself, and
        wait_for_layer_load waits for each. Other loads are copied here from the
        daemon's reply.
        """
        cfg = self.config
        blends: list[LoadSpec] = []
        self._fail_layer = None  # the hook's "layer L" is for this step's pass only
        for ld in meta.loads:
            t0 = time.monotonic()
            if ld.fail is not None:  # an asynchronous claim vLLM took otherwise
                first = min((c.first for c in ld.chunks), default=0)
                bad = set(ld.block_ids[first // self.config.block_size:])
                self._load_errors |= bad
                logger.warning("kvblend: load for %s not started (%s); vLLM recomputes its "
                               "%d blocks", ld.req_id, ld.fail, len(bad))
                continue
            try:
                fail = os.environ.get(FAIL_LOAD_ENV)
                layer = None
                if fail and os.path.exists(fail):
                    layer = self._fail_hook_mine(fail, ld.blend is not None)
                    if layer == -1:
                        raise RuntimeError("load failure injected by " + FAIL_LOAD_ENV)
                # at once while the daemon is known down (the link's back-off) or kvblend
                # is off: the load fails without a call, and vLLM recomputes it
                client = self._daemon_client()
                if ld.blend is not None:
                    blends.append(ld)  # after the loop, all in one pass
                    if layer is not None:
                        self._fail_layer = layer
                    continue
                copy = os.environ.get(COPY_ENV)
                if self._region is not None and not (copy and os.path.exists(copy)):
                    if ld.early:  # lands between steps; get_finished says when it is in
                        got = self._region.start(cfg.model_name, ld.req_id, ld.chunks,
                                                 ld.block_ids)
                        if got is not None:
                            self._early[ld.req_id] = _Early(ld, got[0], t0, got[1])
                            continue
                    elif self._region.open(cfg.model_name, ld.req_id, ld.chunks, ld.block_ids):
                        self._landing[ld.req_id] = ld
                        continue
                # a tensor-parallel rank reads only its KV heads (a head range's GET)
                mine = self.cache.heads
                heads = mine if mine[1] < cfg.model.num_kv_heads else None
                for c in ld.chunks:
                    kv = client.get_rerotated(cfg.model_name, c.hash, pos=c.start, heads=heads)
                    part = kv[:, :, c.first - c.start : c.last - c.start]
                    self.cache.write_host(ld.block_ids, c.first, part)
            except (Unavailable, TimeoutError) as e:
                self.daemon.failed(e)  # opens the link: this step's other loads fail at once
                if isinstance(e, TimeoutError):  # the deadline passed: that is its cost
                    self._samples.append(
                        (cost.REUSE, sum(c.last - c.first for c in ld.chunks),
                         time.monotonic() - t0)
                    )
                self._load_failed(ld, str(e))
                continue
            except KvblendOff:
                self._load_failed(ld, "kvblend is off for this engine")
                continue
            except (KvblendError, ValueError, IndexError, RuntimeError) as e:
                self.daemon.drop()
                self._load_failed(ld, str(e))
                continue
            self._loaded(ld, t0)
        # an asynchronous load copied here, or failed, has ended: vLLM hears it this step
        self._early_done.update(
            ld.req_id for ld in meta.loads if ld.early and ld.req_id not in self._early
        )
        if self._tp_group is not None:
            blends = self._agreed_blends(meta.loads, blends)
        if blends:
            self._blend(blends)

    def get_finished(self) -> set[str]:
        """Return the asynchronous loads that ended since the last call; poll the rest.

        A landing session in flight is looked at without waiting (its progress word), but
        in a step that computes nothing (only loads in flight) the oldest is waited for
        up to :data:`EARLY_IDLE_WAIT_S`. One landed is closed and logged; one that stopped,
        that has not landed within ``timeout_ms`` of its open, or whose daemon is gone
        (probed, once a step, every :data:`~kvblend.vllm.daemon.WAIT_SLICE_S` once a load
        is late) fails: its blocks go to :meth:`get_block_ids_with_load_errors` in this
        same step, and vLLM recomputes them. A session is always closed before its load is
        reported, unless its daemon was found gone (once the close is answered the daemon
        writes nothing more, and vLLM may reuse the blocks as soon as it hears); a close
        that is not answered stays queued for the daemon, as a step's closes do
        (:meth:`kvblend.vllm.landing.CacheRegion.close_all`).
        """
        done, self._early_done = self._early_done, set()
        if not self._early:
            return done
        assert self._region is not None
        cfg = self.config
        timeout_s = cfg.timeout_ms / 1000
        last = cfg.model.num_layers - 1
        wait = EARLY_IDLE_WAIT_S if self._step_scheduled == 0 else 0.0
        probed: list[str | None] = []  # this call's probe of the daemon, once

        def gone() -> str | None:
            if not probed:
                probed.append(probe(cfg.endpoint, PROBE_MAX_S))
            return probed[0]

        for rid, e in list(self._early.items()):
            t = time.monotonic()
            try:
                e.session.wait(last, wait)
            except TimeoutError:
                now = time.monotonic()
                e.held += now - t
                if now - e.t0 < timeout_s:
                    if now - e.t0 < WAIT_SLICE_S or now - e.probed < WAIT_SLICE_S:
                        continue
                    e.probed = now
                    why = gone()
                    if why is None:
                        continue
                    e.why, e.dead = f"kvblendd gone while landing ({why})", True
                else:
                    e.why = f"not landed within timeout_ms ({cfg.timeout_ms} ms)"
                    self.daemon.failed(TimeoutError(e.why))
            except KvblendError as err:
                e.why = str(err)
            else:
                e.held += time.monotonic() - t
            wait = 0.0  # one wait a step at most
            st: dict = {}
            if not e.dead:
                t = time.monotonic()
                got, failed = self._region.close_one(e.session, rid)
                e.held += time.monotonic() - t
                if failed and e.why is None:
                    e.why = "its close was not answered" if got is None else "landing stopped"
                st = got or {}
            del self._early[rid]
            done.add(rid)
            ld = e.load
            tokens = sum(c.last - c.first for c in ld.chunks)
            # the cost model's sample: what the load cost, the time it held the engine
            # (open, looks, close) and the daemon's landing, not the steps it spent waiting
            # for them to be looked at
            self._samples.append((cost.REUSE, tokens, e.held + st.get("land_ms", 0.0) / 1000))
            if e.dead:
                self.daemon.failed(Unavailable(-111, e.why or "kvblendd gone"))
            if e.why is not None:
                self._load_failed(ld, e.why)
                continue
            self.daemon.ok()
            logger.info(
                "kvblend: loaded %d tokens of %s early in %.3f s (landed by kvblendd in "
                "vLLM's cache between the engine's steps; it held the engine %.3f s: open, "
                "looks, close; %d layers, daemon landing %.1f ms)",
                tokens, rid, time.monotonic() - e.t0, e.held,
                int(st.get("layers_landed", 0)), st.get("land_ms", 0.0),
            )
            if self._dump_dir:
                self._dump(ld, "landed")
        return done

    def _fail_hook_mine(self, path: str, blend: bool) -> int | None:
        """Whether this rank takes the failure hook's file (FAIL_LOAD_ENV), removing it.

        A file reading ``rank N`` is tensor-parallel rank N's alone; any other, the first
        rank's to remove it. ``layer L`` or ``preview L`` in it is for a blend (``blend``)
        only. Returns None (not taken), -1 (fail the load now), ``("layer", L)`` (fail the
        blend's pass at layer L) or ``("preview", L)`` (fail its preview at layer L: the
        question and anchored metrics').
        """
        try:
            with open(path) as f:
                words = f.read().split()
        except OSError:
            return None
        want = dict(zip(words[::2], words[1::2]))
        if "rank" in want and want["rank"] != str(self._tp_rank):
            return None
        at = next(((k, int(want[k])) for k in ("layer", "preview")
                   if want.get(k, "").isdigit()), None)
        if at is not None and not blend:
            return None
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None  # another rank took it first
        return -1 if at is None else at

    def _agreed_blends(self, loads: list[LoadSpec], mine: list[LoadSpec]) -> list[LoadSpec]:
        """The blends every tensor-parallel rank can run (each rank's own list may differ).

        A rank fails a load on its own (its link's back-off, an injected failure); the
        blend pass must run the same loads on every rank, so a load any rank failed fails
        on all (vLLM recomputes it), agreed by one all-reduce over the step's blend loads
        (the same on every rank: the scheduler sends each the same metadata).
        """
        import torch.distributed as dist

        every = [ld for ld in loads if ld.blend is not None]
        if not every:
            return []
        ok_ids = {id(ld) for ld in mine}
        mask = torch.tensor([1 if id(ld) in ok_ids else 0 for ld in every], dtype=torch.int32)
        dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=self._tp_group.cpu_group)
        agreed = []
        for ld, ok in zip(every, mask.tolist()):
            if ok:
                agreed.append(ld)
            elif id(ld) in ok_ids:
                self._load_failed(ld, "another tensor-parallel rank could not start its blend")
        return agreed

    def _blend(self, loads: list[LoadSpec]) -> None:
        """Blend this step's requests in one pass (:func:`kvblend.vllm.blend.load_blends`).

        The daemon gone or silent fails them all; any other failure of the pass runs them
        again one at a time, so that only the request at fault is recomputed by vLLM.
        """
        cfg = self.config
        t0 = time.monotonic()
        fail_layer, self._fail_layer = self._fail_layer, None
        try:
            ranks = None
            if self._tp_group is not None:
                ranks = blend.TensorRanks(self._tp_group, self.cache.heads)
                err = None
                try:
                    client = self.daemon.client()
                except KvblendError as e:
                    err = e
                blend_loop.agreed(ranks, err)  # every rank has its client, or none goes on
            else:
                client = self.daemon.client()
            res = blend.load_blends(
                self._blend_model,
                client,
                cfg.model,
                [(ld.blend, ld.block_ids) for ld in loads],
                self.cache,
                cfg.timeout_ms / 1000,
                ranks,
                fail_layer,
            )
        except (Unavailable, TimeoutError) as e:
            self.daemon.failed(e)
            for ld in loads:
                self._load_failed(ld, str(e))
            return
        except (KvblendError, ValueError, IndexError, RuntimeError) as e:
            if not isinstance(e, blend_loop.RankFailed):
                self.daemon.drop()
            if len(loads) == 1 or self._tp_group is not None:
                # under TP the ranks failed together (the pass agrees on it): all of the
                # pass's loads fail on every rank alike, with no retry one at a time that
                # ranks could take apart
                for ld in loads:
                    self._load_failed(ld, str(e))
                return
            logger.warning(
                "kvblend: a blend of %d requests failed (%s); one at a time", len(loads), e
            )
            for ld in loads:
                self._blend([ld])
            return
        # the claimed tokens, and the fit's two counts (kvblend.vllm.cost)
        self._samples.append(
            (cost.BLEND, sum(len(ld.blend.ids) - ld.blend.skip for ld in loads),
             time.monotonic() - t0,
             sum(int(sels[-1].size) if sels else ld.blend.fresh_tokens()
                 for ld, (sels, _) in zip(loads, res)),
             sum(len(ld.blend.ids) for ld in loads))
        )
        for ld in loads:
            self._loaded(ld, t0, len(loads))

    def _loaded(self, ld: LoadSpec, t0: float, batch: int = 1) -> None:
        """Log a load done (copied or blended here) and keep its blocks when asked to."""
        self.daemon.ok()
        tokens = sum(c.last - c.first for c in ld.chunks) + (
            len(ld.blend.ids) - ld.blend.skip if ld.blend else 0
        )
        secs = time.monotonic() - t0
        if ld.blend is None:
            self._samples.append((cost.REUSE, tokens, secs))
        logger.info(
            "kvblend: %s %d tokens of %s in %.3f s%s",
            "blended" if ld.blend is not None else "loaded",
            tokens,
            ld.req_id,
            secs,
            "" if ld.blend is not None else " (copied from the daemon's reply)",
        )
        if self._dump_dir:
            self._dump(ld, "blended" if ld.blend is not None else "copied", batch)

    def _spans(self, ld: LoadSpec) -> list[tuple[int, int]]:
        """The prompt positions a load writes, as (first, last) spans."""
        spans = [(c.first, c.last) for c in ld.chunks]
        if ld.blend is not None:
            spans.append((ld.blend.skip, len(ld.blend.ids)))
        return spans

    def _load_failed(self, ld: LoadSpec, why: str) -> None:
        """Report a load's blocks to vLLM, which recomputes them (policy 'recompute')."""
        bad = blocks_of(ld.block_ids, self._spans(ld), self.config.block_size)
        self._load_errors |= bad
        self._failed_tokens += sum(last - first for first, last in self._spans(ld))
        logger.warning(
            "kvblend: load for %s failed (%s); vLLM recomputes its %d blocks",
            ld.req_id,
            why,
            len(bad),
        )

    def _landed(self) -> None:
        """Close this step's landing sessions: log each load, report the failed ones."""
        assert self._region is not None
        for rid, (st, secs, failed) in self._region.close_all().items():
            ld = self._landing.pop(rid)
            # what the landing cost the engine: opening it, the time it waited for the layers
            # and closing it (a session that stopped at the deadline cost that much too)
            self._samples.append((cost.REUSE, sum(c.last - c.first for c in ld.chunks), secs))
            if failed:
                self._load_failed(ld, "landing stopped")
                continue
            logger.info(
                "kvblend: loaded %d tokens of %s in %.3f s (landed by kvblendd in vLLM's cache: "
                "the time it held the engine: open, waits, close; %d layers, daemon landing "
                "%.1f ms)",
                sum(c.last - c.first for c in ld.chunks),
                rid,
                secs,
                int(st.get("layers_landed", 0)),
                st.get("land_ms", 0.0),
            )
            if self._dump_dir:
                self._dump(ld, "landed")

    def _dump(self, ld: LoadSpec, how: str, batch: int = 1) -> None:
        """Write the raw blocks a load touched (debug hook for tests, DUMP_ENV).

        ``batch``: how many requests the load's blend pass ran together.
        """
        blocks = sorted(blocks_of(ld.block_ids, self._spans(ld), self.config.block_size))
        raw = self.cache.raw_blocks(blocks)
        rank = f"-rank{self._tp_rank}" if self._tp_rank else ""  # ranks' dumps apart
        path = os.path.join(self._dump_dir, f"load-{self._dumps}{rank}.npz")
        self._dumps += 1
        np.savez(
            path,
            early=ld.early,
            raw=raw,
            blocks=np.array(blocks),
            block_ids=np.array(ld.block_ids),
            block_size=self.config.block_size,
            chunks=np.array([[c.start, c.length, c.first, c.last] for c in ld.chunks]),
            hashes=np.array([c.hash.hex() for c in ld.chunks]),
            path=how,  # "landed", "copied" or "blended"
            batch=batch,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until this step's landing sessions have the layer in vLLM's cache.

        Copied loads were written in start_load_kv. A session that stops (an error, or
        past ``timeout_ms``) has its blocks recomputed by vLLM (reported at the step's end).
        """
        if self._region is None or not self._region.sessions:
            return
        self._region.wait(self.cache.layer_of[layer_name], self.config.timeout_ms / 1000)
        if self._region.stalled and not self.daemon.is_open:
            # a timeout, as the link sees it: its probe tells a dead daemon from a late one
            self.daemon.failed(TimeoutError("a landing wait timed out or found the daemon gone"))

    def save_kv_layer(self, layer_name: str, meta: KvblendMetadata) -> None:
        """Gather this layer's K and V of each storing request's chunk into host memory."""
        if not meta.stores:
            return
        model = self.config.model
        layer = self.cache.layer_of[layer_name]
        for st in meta.stores:
            buf = self._gathered.get(st.req_id)
            if buf is None:
                buf = np.empty(model.kv_shape(st.length), model.np_dtype)
                self._gathered[st.req_id] = buf
            self.cache.gather(layer, st.block_ids, st.length, buf[layer])

    def wait_for_save(self, meta: KvblendMetadata) -> None:
        """Close this step's landing sessions; PUT each chunk gathered this step (position 0)."""
        if self._region is not None and self._region.sessions:
            self._landed()
        if meta.misses and self._misses is not None and self._off is None:
            self._misses.submit(meta.misses)  # prefilled and stored on the thread
        for st in meta.stores:
            buf = self._gathered.pop(st.req_id, None)
            if self._tp_size > 1:
                buf = self._gather_heads(buf, st.length)  # rank 0 stores the whole chunk
            if buf is None:
                continue
            try:
                self._daemon_client().put(self.config.model_name, st.hash, buf, base_pos=0)
            except KvblendOff:
                continue
            except (Unavailable, TimeoutError) as e:
                self.daemon.failed(e)
                logger.warning("kvblend: storing %s failed: %s", st.req_id, e)
                continue
            except KvblendError as e:
                self.daemon.drop()
                logger.warning("kvblend: storing %s failed: %s", st.req_id, e)
                continue
            self.daemon.ok()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return the blocks whose load failed this step (vLLM recomputes them)."""
        bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        """Close the daemon connection (the region's client stays: vLLM's cache lives there)."""
        if self._region is not None and self._region.sessions:
            self._landed()
        for rid, e in list(self._early.items()):
            if not e.dead:
                self._region.close_one(e.session, rid)
        self._early = {}
        if self._misses is not None:
            self._misses.close()
        self.daemon.drop()
