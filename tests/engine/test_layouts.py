"""kvblend.vllm.layout in vLLM's GPU cache layouts, on CPU tensors (ctest test_vllm_layouts).

No GPU and no engine: each layer's cache is made by vLLM's own ``create_kv_cache_views``
(vllm/v1/kv_cache_interface.py) over one int8 allocation in a kvblend region, in the
physical orders ``KVCacheLayout`` gives the GPU backends: LBNHC ("NHD", FlashAttention's
default), LBHNC ("HND", FlashInfer) and BLNHC (block-outermost); beside them the CPU
backend's "vec" cache over the same kind of allocation, the layout the connector runs on
today. For each GPU layout (kvblend.vllm.layout.INTERLEAVED):

(a) PagedCache.write of rows at prompt positions through a shuffled block table puts
    each token's K at ``view[block, head, slot, :head_dim]`` and its V after it, as
    vLLM's GPU kernels read them (vLLM's view indexed directly), and gather reads the
    same rows back;
(b) a landing (reuse only, two chunks of BS + 5 and BS + 2 tokens, the second re-rotated by
    BS + 5 positions: chunks and blocks do not line up) through region_views and
    a real kvblendd lands, in every layer, rows byte for byte equal to those the same
    landing puts in the CPU "vec" cache;
(c) the refusals: head_dim not contiguous, a CPU ISA other than "vec";
(d) bfloat16 (what models run in on GPUs) in the LBNHC layout: a chunk copied into the
    cache as the worker's copy path does it (GET re-rotated, PagedCache.write_host) holds
    the daemon's bits exactly, gather (the store's path) reads them back as raw bits, and
    rows of raw bits instead of bfloat16 are refused rather than converted as numbers;
(e) the connector's device landing (kvblend.vllm.landing.DeviceLanding, what the worker
    runs on a GPU's cache) against a kvblendd on its emulated device (host memory standing
    in for device memory: a sealed memfd handed over by descriptor, mapped by the handle
    the daemon gives for it, as CUDA IPC maps a cudaIpcGetMemHandle): vLLM's views over the "device" allocation
    in LBNHC and LBHNC, described by layout.device_cache, a load opened, waited for layer
    by layer and closed as the worker does: the load's rows, read back through vLLM's
    views, equal the host landing's of (b) byte for byte; a kvblendd with no device
    refuses the first open, which turns landing off for good with one line (the worker
    then copies). Only the CUDA export of vLLM's allocation (PyTorch's IPC handle, the
    driver's bus id) is left to a GPU.

Every check runs for blocks of 16, 48, 64 (vLLM 0.34's default) and 128 tokens (a request
of three blocks in a shuffled block table each time), each line prefixed with the size.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import numpy as np
import torch

import kvblend  # noqa: E402
from harness import Daemon  # noqa: E402
from kvblend.vllm import layout as L  # noqa: E402

MODEL = kvblend.Model("layout-test", 4, 2, 16, dtype="f32", rope_theta=1e4)
#: The block sizes every check runs with: vLLM 0.32's default, 0.34's, a larger one and
#: one that is no power of two.
BLOCK_SIZES = (16, 48, 64, 128)
NB = 9  # blocks a layer
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL.num_layers)]
TABLE = [7, 2, 5]  # the request's block table: TA + TB tokens in 3 blocks
BS = TA = TB = 0  # tokens a block, the two chunks' tokens: set by block_size()
failures = []


def block_size(bs):
    """Run the checks with blocks of ``bs`` tokens: chunk a crosses a block boundary, chunk b
    starts inside a block and ends inside the third (2 * bs + 7 tokens in 3 blocks)."""
    global BS, TA, TB
    BS, TA, TB = bs, bs + 5, bs + 2


def check(what, ok, detail=""):
    what = f"bs {BS}: {what}"
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""))
    if not ok:
        failures.append(what)


class Attn:
    """A forward-context entry: vLLM's CPU attention modules carry ``isa``."""

    def __init__(self, isa=None):
        if isa is not None:
            self.isa = isa


def spec(dtype=torch.float32):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=MODEL.num_kv_heads,
                             head_size=MODEL.head_dim, dtype=dtype)


def views(buf, layout, dtype=torch.float32):
    """Each layer's cache as vLLM makes it in ``layout`` over ``buf`` (int8)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    page = spec(dtype).page_size_bytes
    n = len(NAMES)
    if layout.is_layer_compact:
        t = KVCacheTensor(size=page * NB * n, layers=NAMES, layer_stride=page * NB,
                          block_stride=page)
    else:
        t = KVCacheTensor(size=page * NB * n, layers=NAMES, layer_stride=page,
                          block_stride=page * n)
    return (dict(zip(NAMES, create_kv_cache_views(buf, spec(dtype), NB, layout, t))),
            page * NB * n)


def check_bf16(c, rng):
    """(d): a bfloat16 cache in vLLM's GPU layout, through the worker's copy path."""
    from kvblend.blend import host
    from vllm.v1.kv_cache_layout import KVCacheLayout

    m = kvblend.Model("layout-bf16", MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim,
                      dtype="bf16", rope_theta=1e4)
    c.model_register(m)
    kv = torch.from_numpy(rng.standard_normal((m.num_layers, 2, TB, 2, 16)).astype(np.float32))
    raw = host.array(kv.to(torch.bfloat16))  # the chunk as kvblend holds it: raw bits
    h = kvblend.chunk_hash(list(range(90, 90 + TB)))
    c.put(m.name, h, raw)
    got = c.get_rerotated(m.name, h, pos=TA)  # the chunk at TA..TA+TB-1, as a copied load
    check("(d) bf16: GET answers raw bits", got.dtype == np.uint16, str(got.dtype))
    buf = torch.zeros(spec(torch.bfloat16).page_size_bytes * NB * len(NAMES), dtype=torch.int8)
    cache_v, _ = views(buf, KVCacheLayout.LBNHC, torch.bfloat16)
    cache = L.PagedCache(m, BS)
    cache.register(cache_v, {n: Attn() for n in NAMES}, kind=L.INTERLEAVED)
    cache.write_host(TABLE, TA, got)
    bits = all(
        np.array_equal(host.array(cache_v[NAMES[i]][TABLE[p // BS], :, p % BS, :16].clone()),
                       got[i, 0, p - TA])
        and np.array_equal(host.array(cache_v[NAMES[i]][TABLE[p // BS], :, p % BS, 16:].clone()),
                           got[i, 1, p - TA])
        for i in range(m.num_layers) for p in range(TA, TA + TB))
    check("(d) bf16: the copied rows hold the daemon's bits in vLLM's view", bits)
    back = np.zeros((m.num_layers, 2, TA + TB, 2, 16), np.uint16)
    for i in range(m.num_layers):
        cache.gather(i, TABLE, TA + TB, back[i])
    check("(d) bf16: gather reads the raw bits back", np.array_equal(back[:, :, TA:], got))
    check("(d) bf16: the V rows are the stored ones, the K rows re-rotated",
          np.array_equal(got[:, 1], raw[:, 1]) and not np.array_equal(got[:, 0], raw[:, 0]))
    try:
        cache.write(TABLE, TA, torch.from_numpy(got.view(np.int16)))
        check("(d) bf16: raw bits as rows are refused", False)
    except L.LayoutError as e:
        check("(d) bf16: raw bits as rows are refused", "bfloat16" in str(e), str(e))


def land(c, cache, region, size, segs):
    """Land segs (reuse only) into cache's region; each layer's rows, gathered back."""
    k, v = L.region_views(region, size, cache.layers_in_order(), MODEL, BS, cache.kind)
    region[:size] = 0
    s = c.fuse_open_into(MODEL.name, segs, k, v, pages=TABLE)
    for layer in range(MODEL.num_layers):
        s.wait(layer, timeout=10)
    landed = s.close()["layers_landed"]
    out = np.zeros((MODEL.num_layers, 2, TA + TB, MODEL.num_kv_heads, MODEL.head_dim),
                   np.float32)
    for layer in range(MODEL.num_layers):
        cache.gather(layer, TABLE, TA + TB, out[layer])
    return landed, out


def emulated_allocation(size, endpoint):
    """A "device" allocation of the emulated device: a sealed memfd, mapped here, its
    descriptor handed to the daemon at endpoint (the handle names it for this process
    only)."""
    import fcntl
    import mmap

    from kvblend.vllm.landing import DeviceAllocation

    fd = os.memfd_create("kvb-test-device", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    mem = mmap.mmap(fd, size)
    t = torch.frombuffer(mem, dtype=torch.int8)
    with kvblend.Client(endpoint, timeout_ms=10000) as c:
        handle = c.device_handle_from_fd(fd)
    return t, mem, fd, DeviceAllocation(t.data_ptr(), size, handle, "emulated")


def check_device(d, c, segs, want, ha, hb):
    """(e): the worker's device landing on the emulated device."""
    import logging

    from harness import Daemon
    from kvblend.vllm.landing import DeviceLanding
    from kvblend.vllm.plan import ChunkLoad
    from vllm.v1.kv_cache_layout import KVCacheLayout

    size = spec().page_size_bytes * NB * len(NAMES)
    chunks = [ChunkLoad(ha, 0, TA, 0, TA), ChunkLoad(hb, TA, TB, TA, TA + TB)]
    emu = Daemon("--device", "emulated")
    log = logging.getLogger("test_layouts")
    try:
        with kvblend.Client(emu.endpoint, timeout_ms=10000) as ce:
            ce.model_register(MODEL)
            for h in (ha, hb):
                ce.put(MODEL.name, h, c.get(MODEL.name, h))
        for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC):
            name = layout.name
            t, mem, fd, alloc = emulated_allocation(size, emu.endpoint)
            try:
                kv, _ = views(t, layout)
                cache = L.PagedCache(MODEL, BS)
                cache.register(kv, {n: Attn() for n in NAMES}, kind=L.INTERLEAVED)
                dl = DeviceLanding(emu.endpoint, 10000, log, export=lambda _l, _c, a=alloc: a)
                dl.attach(cache.layers_in_order(), MODEL, BS, cache.kind)
                check(f"(e) {name}: device landing on", dl.active)
                opened = dl.open(MODEL.name, "req-0", chunks, TABLE)
                check(f"(e) {name}: the load's device session opened", opened)
                failed = []
                for layer in range(MODEL.num_layers):
                    failed += dl.wait(layer, 10)
                out = dl.close_all()
                st, _, bad = out["req-0"]
                check(f"(e) {name}: every layer landed, none failed",
                      not failed and not bad and st.get("layers_landed") == MODEL.num_layers,
                      f"{st.get('layers_landed')} layers, failed {failed or bad}")
                got = np.zeros_like(want)
                for layer in range(MODEL.num_layers):
                    cache.gather(layer, TABLE, TA + TB, got[layer])
                check(f"(e) {name}: the rows in the device allocation equal the host "
                      "landing's, byte for byte", got.tobytes() == want.tobytes(),
                      f"max diff {float(np.abs(got - want).max()):.3g}")
                again = dl.open(MODEL.name, "req-1", chunks, TABLE)  # its word came back
                for layer in range(MODEL.num_layers):
                    dl.wait(layer, 10)
                check(f"(e) {name}: a second load of the step lands too", again
                      and not dl.close_all()["req-1"][2])
                dl.off("test over")
                del kv, cache, t
            finally:
                mem.close()
                os.close(fd)
        # memory PyTorch cannot export by CUDA IPC (here: CPU memory): off at attach
        kv, _ = views(torch.zeros(size, dtype=torch.int8), KVCacheLayout.LBNHC)
        cache = L.PagedCache(MODEL, BS)
        cache.register(kv, {n: Attn() for n in NAMES}, kind=L.INTERLEAVED)
        dl = DeviceLanding(emu.endpoint, 10000, log)  # PyTorch's CUDA export
        dl.attach(cache.layers_in_order(), MODEL, BS, cache.kind)
        check("(e) an allocation that cannot be exported: landing off at start",
              not dl.active and dl.said_off and not dl.open(MODEL.name, "r", chunks, TABLE))
        # no device: the first open is refused, and landing goes off for good
        t, mem, fd, alloc = emulated_allocation(size, d.endpoint)
        try:
            kv, _ = views(t, KVCacheLayout.LBNHC)
            cache = L.PagedCache(MODEL, BS)
            cache.register(kv, {n: Attn() for n in NAMES}, kind=L.INTERLEAVED)
            dl = DeviceLanding(d.endpoint, 10000, log, export=lambda _l, _c, a=alloc: a)
            dl.attach(cache.layers_in_order(), MODEL, BS, cache.kind)
            refused = not dl.open(MODEL.name, "req-2", chunks, TABLE)
            check("(e) a kvblendd with no device: the open is refused and landing is off "
                  "(the worker copies)", refused and not dl.active and dl.said_off
                  and not dl.open(MODEL.name, "req-3", chunks, TABLE))
            del kv, cache, t
        finally:
            mem.close()
            os.close(fd)
    finally:
        emu.stop()


def test_layouts():
    for bs in BLOCK_SIZES:
        block_size(bs)
        run()
    print("test_layouts: " + ("FAILED " + ", ".join(failures) if failures else "passed"))
    assert not failures, "failed: " + "; ".join(failures)


def run():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    rng = np.random.default_rng(3)
    shape = (MODEL.num_layers, 2)
    kv_a = rng.standard_normal((*shape, TA, 2, 16)).astype(np.float32)
    kv_b = rng.standard_normal((*shape, TB, 2, 16)).astype(np.float32)
    ha, hb = kvblend.chunk_hash(list(range(TA))), kvblend.chunk_hash(list(range(50, 50 + TB)))
    d = Daemon()
    try:
        with kvblend.Client(d.endpoint, timeout_ms=10000) as c:
            c.model_register(MODEL)
            c.put(MODEL.name, ha, kv_a)
            c.put(MODEL.name, hb, kv_b)
            segs = [(ha, 0), (hb, TA)]
            # the reference: the CPU backend's cache (contiguous per layer), vec ISA
            size = spec().page_size_bytes * NB * len(NAMES)
            region = c.region(size)
            buf = torch.from_numpy(region[:size]).view(torch.int8)
            vec_views, _ = views(buf, KVCacheLayout.LBHNC)
            vec = L.PagedCache(MODEL, BS)
            vec.register(vec_views, {n: Attn("vec") for n in NAMES})
            check("the CPU cache is CPU_VEC", vec.kind == L.CPU_VEC)
            landed, want = land(c, vec, region, size, segs)
            check("the CPU 'vec' landing lands every layer", landed == MODEL.num_layers,
                  str(landed))
            check("its chunk a rows are the stored ones (position 0: no rotation)",
                  np.array_equal(want[:, :, :TA], kv_a))
            check("its chunk b V rows are the stored ones, its K rows re-rotated",
                  np.array_equal(want[:, 1, TA:], kv_b[:, 1])
                  and not np.array_equal(want[:, 0, TA:], kv_b[:, 0]))
            rows = rng.standard_normal((*shape, TA + TB, 2, 16)).astype(np.float32)
            for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC):
                name = layout.name
                kv, _ = views(buf, layout)
                cache = L.PagedCache(MODEL, BS)
                cache.register(kv, {n: Attn() for n in NAMES}, kind=L.INTERLEAVED)
                # (a) rows where vLLM's GPU kernels read them
                region[:size] = 0
                cache.write(TABLE, 0, torch.from_numpy(rows))
                placed = all(
                    torch.equal(kv[NAMES[i]][TABLE[p // BS], :, p % BS, :16],
                                torch.from_numpy(rows[i, 0, p]))
                    and torch.equal(kv[NAMES[i]][TABLE[p // BS], :, p % BS, 16:],
                                    torch.from_numpy(rows[i, 1, p]))
                    for i in range(MODEL.num_layers) for p in range(TA + TB))
                check(f"(a) {name}: each token's K then V at view[block, head, slot]", placed)
                back = np.zeros_like(rows)
                for i in range(MODEL.num_layers):
                    cache.gather(i, TABLE, TA + TB, back[i])
                check(f"(a) {name}: gather reads the written rows back",
                      np.array_equal(back, rows))
                # (b) the daemon lands where the CPU path's landing does
                landed, got = land(c, cache, region, size, segs)
                check(f"(b) {name}: every layer landed", landed == MODEL.num_layers,
                      str(landed))
                check(f"(b) {name}: landed rows equal the CPU 'vec' landing's, byte for byte",
                      got.tobytes() == want.tobytes(),
                      f"max diff {float(np.abs(got - want).max()):.3g}")
            # (c) refusals
            kv, _ = views(buf, KVCacheLayout.LBNHC)
            bad = {n: t.transpose(2, 1) for n, t in kv.items()}  # heads and slots swapped
            try:
                L.PagedCache(MODEL, BS).register(bad, {}, kind=L.INTERLEAVED)
                check("(c) a view of another shape is refused", False)
            except L.LayoutError as e:
                check("(c) a view of another shape is refused", "shape" in str(e), str(e))
            hd2 = 2 * MODEL.head_dim
            odd = {n: torch.zeros(NB, MODEL.num_kv_heads, BS, 2 * hd2)[..., ::2] for n in NAMES}
            try:
                L.PagedCache(MODEL, BS).register(odd, {}, kind=L.INTERLEAVED)
                check("(c) head_dim not contiguous is refused", False)
            except L.LayoutError as e:
                check("(c) head_dim not contiguous is refused", "contiguous" in str(e), str(e))
            try:
                L.PagedCache(MODEL, BS).register(vec_views, {n: Attn("amx") for n in NAMES})
                check("(c) a CPU ISA other than 'vec' is refused", False)
            except L.LayoutError as e:
                check("(c) a CPU ISA other than 'vec' is refused", "'amx'" in str(e), str(e))
            check_bf16(c, rng)
            check_device(d, c, segs, want, ha, hb)
            del buf, kv, vec_views, bad, odd, vec, cache
            c.free_region(region)
    finally:
        d.stop()
