"""Landing into device memory from Python (Client.fuse_open_into_device) through a real
kvblendd on the emulated device: the node's "GPU allocation" is a memfd sealed against
shrinking, handed to the daemon by descriptor (Client.device_handle_from_fd), which the
emulated device maps (as blend/nodemem.c makes them), laid out as vLLM's GPU backends
lay out their cache (each token's K then V per head, paged), and every byte must equal
what fuse_open_into lands into a region with the same layout. A daemon without a
device refuses with the reason. And a head range (a tensor-parallel rank's share)."""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os

import numpy as np
import pytest

import kvblend
from conftest import running_daemon

L, H, D, PT, BLOCKS = 3, 2, 16, 4, 12
ES = 2  # f16


@pytest.fixture(scope="module")
def emu_daemon():
    with running_daemon("kvb-py-dev-", "--device", "emulated") as d:
        yield d


@pytest.fixture
def nodemem():
    """A node's stand-in allocation: a memfd sealed against shrinking, mapped shared; its
    descriptor is what the node hands to the daemon."""
    fd = os.memfd_create("kvb-nodemem", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    nbytes = L * BLOCKS * PT * H * 2 * D * ES
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    mm = mmap.mmap(fd, nbytes)
    arr = np.frombuffer(mm, dtype=np.uint8)
    yield fd, arr
    os.close(fd)  # the mapping goes with the last view of it


def _store(c: kvblend.Client, name: str, **rope) -> list:
    m = kvblend.Model(name, num_layers=L, num_kv_heads=H, head_dim=D, dtype="f16", **rope)
    c.model_register(m)
    rng = np.random.default_rng(7)
    segs = []
    pos = 0
    for i, n in enumerate((9, 14)):
        kv = rng.standard_normal((L, 2, n, H, D)).astype(np.float16)
        h = kvblend.chunk_hash(np.arange(n, dtype=np.uint32) + 1000 * i)
        c.put(name, h, kv, base_pos=3 * i)
        segs.append(kvblend.Segment.chunk(h, pos))
        pos += n
        if i == 0:
            segs.append(kvblend.Segment.fresh(3, pos))
            pos += 3
    return segs


def _cache(c: kvblend.Client, fd: int, arr: np.ndarray) -> kvblend.DeviceCache:
    handle = c.device_handle_from_fd(fd)
    page_stride = PT * H * 2 * D * ES
    return kvblend.DeviceCache(
        base=arr.ctypes.data, nbytes=arr.nbytes, ipc_handle=handle, pci="emulated",
        k_offset=0, v_offset=D * ES, layer_stride=BLOCKS * page_stride,
        token_stride=H * 2 * D * ES, head_stride=2 * D * ES, page_tokens=PT,
        page_stride=page_stride,
    )


def test_device_landing_equals_host_landing(emu_daemon, nodemem):
    fd, dev = nodemem
    pages = (np.arange(BLOCKS) * 5 + 2) % BLOCKS
    with kvblend.Client(emu_daemon.endpoint, timeout_ms=10000) as c:
        segs = _store(c, "gpu_lm")
        region = c.region(dev.nbytes + 4096)
        host = region[: dev.nbytes]
        # the host landing's arrays: [layers, blocks, page_tokens, heads, 2, head_dim]
        cache = host.view(np.float16).reshape(L, BLOCKS, PT, H, 2, D)
        host[:] = 0xA5
        dev[:] = 0xA5
        with c.fuse_open_into("gpu_lm", segs, cache[..., 0, :], cache[..., 1, :],
                              pages=pages) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)
        with c.fuse_open_into_device("gpu_lm", segs, _cache(c, fd, dev),
                                     region[dev.nbytes : dev.nbytes + 4],
                                     pages=pages) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)
        assert np.array_equal(dev, host)
        assert np.count_nonzero(dev != 0xA5) > L * 2 * 23 * H * D * ES // 2


def test_local_layers_land_with_their_own_base(emu_daemon, nodemem):
    """A model whose layers rotate with two bases (Gemma 3's local and full-attention
    layers): the device landing equals the host landing byte for byte, and each layer's
    keys are the daemon's GET re-rotated of that layer (test_fuse.py checks that against
    NumPy per base); a local layer's keys differ from the full layers' rotation."""
    fd, dev = nodemem
    pages = np.arange(BLOCKS)
    local = {"rope_theta": 1e6, "rope_local_theta": 1e4, "full_every": 3}
    with kvblend.Client(emu_daemon.endpoint, timeout_ms=10000) as c:
        segs = _store(c, "gpu_local", **local)
        _store(c, "gpu_local_as_full", rope_theta=1e6)
        region = c.region(dev.nbytes + 4096)
        host = region[: dev.nbytes]
        cache = host.view(np.float16).reshape(L, BLOCKS, PT, H, 2, D)
        host[:] = 0
        dev[:] = 0
        with c.fuse_open_into("gpu_local", segs, cache[..., 0, :], cache[..., 1, :],
                              pages=pages) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)
        with c.fuse_open_into_device("gpu_local", segs, _cache(c, fd, dev),
                                     region[dev.nbytes : dev.nbytes + 4], pages=pages) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)
        assert np.array_equal(dev, host)
        keys = cache[..., 0, :].reshape(L, BLOCKS * PT, H, D)
        chunks = [(sg.hash, sg.pos) for sg in segs if sg.hash is not None]
        for layer in range(L):
            for h, pos in chunks:
                want = c.get_rerotated("gpu_local", h, pos, layers=(layer, layer + 1))[0, 0]
                one_base = c.get_rerotated("gpu_local_as_full", h, pos,
                                           layers=(layer, layer + 1))[0, 0]
                got = keys[layer, pos : pos + len(want)]
                assert np.array_equal(got, want), layer
                if h == chunks[-1][0]:  # stored at 3, placed at 12: its keys turn
                    # layers 0 and 1 are local, layer 2 full (full_every 3)
                    assert np.array_equal(got, one_base) == (layer == 2), layer


def test_daemon_without_device_refuses(daemon, nodemem):
    fd, dev = nodemem
    with kvblend.Client(daemon.endpoint, timeout_ms=10000) as c:
        segs = _store(c, "gpu_lm_cpu")
        region = c.region(4096)
        with pytest.raises(kvblend.BadArgument, match="CUDA device"):
            c.fuse_open_into_device("gpu_lm_cpu", segs, _cache(c, fd, dev), region[:4],
                                    pages=np.arange(BLOCKS))
        c.ping()


def test_a_handle_by_path_is_refused(emu_daemon, nodemem):
    """Memory named by a path (emu:/proc/PID/fd/N: any local process could name it) is
    refused with the reason; the descriptor's own handle lands."""
    fd, dev = nodemem
    with kvblend.Client(emu_daemon.endpoint, timeout_ms=10000) as c:
        segs = _store(c, "gpu_lm_path")
        region = c.region(4096)
        good = _cache(c, fd, dev)
        assert good.ipc_handle.startswith(b"kvbfd:")
        assert c.device_handle_from_fd(fd) == good.ipc_handle  # the same file: one handle
        by_path = dataclasses.replace(
            good, ipc_handle=f"emu:/proc/{os.getpid()}/fd/{fd}".encode().ljust(64, b"\0"))
        with pytest.raises(kvblend.BadArgument, match="naming memory by a path"):
            c.fuse_open_into_device("gpu_lm_path", segs, by_path, region[:4],
                                    pages=np.arange(BLOCKS))
        with c.fuse_open_into_device("gpu_lm_path", segs, good, region[:4],
                                     pages=np.arange(BLOCKS)) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)


def test_segments_land_like_one_allocation(emu_daemon):
    """Memory in segments (device_handle_from_fds: one memfd a layer, a page unmapped
    between them, as vLLM 0.34's growable cache backs each layer by its own allocation):
    every layer equals the host landing's."""
    layer = BLOCKS * PT * H * 2 * D * ES
    seg = -(-layer // 4096) * 4096
    stride = seg + 4096
    fds, maps = [], []
    for _ in range(L):
        fd = os.memfd_create("kvb-seg", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, seg)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        fds.append(fd)
        maps.append(np.frombuffer(mmap.mmap(fd, seg), dtype=np.uint8))
    pages = (np.arange(BLOCKS) * 5 + 2) % BLOCKS
    try:
        with kvblend.Client(emu_daemon.endpoint, timeout_ms=10000) as c:
            segs = _store(c, "gpu_lm_seg")
            region = c.region(L * layer + 4096)
            host = region[: L * layer]
            cache = host.view(np.float16).reshape(L, BLOCKS, PT, H, 2, D)
            host[:] = 0xA5
            for m in maps:
                m[:] = 0xA5
            with c.fuse_open_into("gpu_lm_seg", segs, cache[..., 0, :], cache[..., 1, :],
                                  pages=pages) as s:
                for i in range(L):
                    s.wait(i, timeout=10)
            handle = c.device_handle_from_fds(fds, [i * stride for i in range(L)], [seg] * L)
            page_stride = PT * H * 2 * D * ES
            dc = kvblend.DeviceCache(
                base=maps[0].ctypes.data, nbytes=(L - 1) * stride + seg, ipc_handle=handle,
                pci="emulated", k_offset=0, v_offset=D * ES, layer_stride=stride,
                token_stride=H * 2 * D * ES, head_stride=2 * D * ES, page_tokens=PT,
                page_stride=page_stride)
            with c.fuse_open_into_device("gpu_lm_seg", segs, dc,
                                         region[L * layer : L * layer + 4], pages=pages) as s:
                for i in range(L):
                    s.wait(i, timeout=10)
            for i in range(L):
                assert np.array_equal(maps[i][:layer], host[i * layer : (i + 1) * layer])
                assert np.all(maps[i][layer:] == 0xA5)
    finally:
        for fd in fds:
            os.close(fd)


def test_head_range_lands_a_ranks_heads(daemon):
    """heads=(h, 1): a tensor-parallel rank's cache holds stored head h alone, equal to
    that head of a full landing; fresh tokens' rows untouched. Blends check in two steps:
    the ranks' summed deviations select what one session of every head selects."""
    with kvblend.Client(daemon.endpoint, timeout_ms=10000) as c:
        segs = _store(c, "gpu_lm_tp")
        n = 26
        reg = c.region(2 * L * n * H * D * ES + 2 * L * n * D * ES)
        full = reg[: 2 * L * n * H * D * ES].view(np.float16).reshape(2, L, n, H, D)
        one = reg[2 * L * n * H * D * ES :].view(np.float16).reshape(2, L, n, 1, D)
        with c.fuse_open_into("gpu_lm_tp", segs, full[0], full[1]) as s:
            for layer in range(L):
                s.wait(layer, timeout=10)
        cached = np.r_[0:9, 12:26]
        for h in range(H):
            one[...] = np.float16(7.0)
            with c.fuse_open_into("gpu_lm_tp", segs, one[0], one[1], heads=(h, 1)) as s:
                for layer in range(L):
                    s.wait(layer, timeout=10)
            assert np.array_equal(one[:, :, cached, 0], full[:, :, cached, h])
            assert np.all(one[:, :, 9:12] == np.float16(7.0))
        with pytest.raises(kvblend.BadArgument, match="recompute"):
            c.fuse_open_into("gpu_lm_tp", segs, one[0], one[1], heads=(0, 1), recompute=[0])
        # a blend (layer 1, r = 0.5): every head's session against one session a head
        rng = np.random.default_rng(5)
        plane = rng.standard_normal((n, H, D)).astype(np.float16)
        ranks = reg[2 * L * n * H * D * ES :].view(np.float16).reshape(2, L, n, 1, D)
        with c.fuse_open_into("gpu_lm_tp", segs, full[0], full[1], [1], [0.5]) as s:
            s.check(1, plane)
            want = s.rows()
        devs = []
        for h in range(H):
            with c.fuse_open_into("gpu_lm_tp", segs, ranks[0], ranks[1], [1], [0.5],
                                  heads=(h, 1)) as s:
                with pytest.raises(kvblend.BadArgument, match="check_mode"):
                    s.check(1, plane[:, h : h + 1])
                devs.append(s.check_deviation(1, plane[:, h : h + 1]))
                assert s.rows().size == n  # nothing selected yet
        total = np.sum(devs, axis=0, dtype=np.float32)
        for h in range(H):
            with c.fuse_open_into("gpu_lm_tp", segs, ranks[0], ranks[1], [1], [0.5],
                                  heads=(h, 1)) as s:
                s.check_deviation(1, plane[:, h : h + 1])
                s.check_select(1, total)
                assert np.array_equal(s.rows(), want)
                assert 0 < want.size < n
