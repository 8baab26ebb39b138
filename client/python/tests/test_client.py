"""Every Client method against a real kvblendd, through libkvblend."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import kvblend
from kvblend import _lib

RNG = np.random.default_rng(11)


def rand_kv(m: kvblend.Model, tokens: int, rng=RNG) -> np.ndarray:
    shape = m.kv_shape(tokens)
    if m.dtype == "bf16":  # finite bfloat16 values, as raw bits
        f = rng.standard_normal(shape).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return rng.standard_normal(shape).astype(m.np_dtype)


def test_ping(client):
    v = client.ping()
    assert isinstance(v, str) and v


def test_connect_nobody_times_out(tmp_path):
    with pytest.raises(kvblend.Timeout) as e:
        kvblend.Client(f"ipc://{tmp_path}/nobody.sock", timeout_ms=200)
    assert e.value.code == -110 and e.value.name == "ETIMEDOUT"
    assert "within" in e.value.message or "answer" in e.value.message
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, kvblend.Unavailable)


def test_too_old_library_is_named(tmp_path):
    """A libkvblend that lacks this package's functions: ImportError naming them, not
    an AttributeError on first use."""
    import sys

    # Any shared library without kvb_*: zlib, which Python itself loads.
    env = dict(os.environ, KVBLEND_LIB="libz.so.1")
    p = subprocess.run(
        [sys.executable, "-c", "import kvblend"], env=env, capture_output=True, text=True
    )
    assert p.returncode != 0
    assert "ImportError" in p.stderr and "too old for this package: no kvb_" in p.stderr
    assert "AttributeError" not in p.stderr


def test_abi_is_checked():
    """The loaded library's functions carry the version node of the ABI this package is
    written for; a library without it (soname 0 had none) is named as another ABI."""
    import ctypes

    assert _lib._abi_mismatch(_lib.lib) is None
    why = _lib._abi_mismatch(ctypes.CDLL("libz.so.1"))
    assert why is not None and _lib._VERSION_NODE in why and _lib._VERSION_NODE == "KVBLEND_1"


def test_bad_endpoint():
    with pytest.raises(kvblend.BadArgument):
        kvblend.Client("bogus://x", timeout_ms=200)


def test_closed_client_refuses(daemon):
    c = kvblend.Client(daemon.endpoint)
    c.close()
    c.close()  # idempotent
    assert c.closed
    with pytest.raises(kvblend.BadArgument, match="closed"):
        c.ping()


def test_models(client):
    m = kvblend.Model(
        "py-llama",
        num_layers=4,
        num_kv_heads=2,
        head_dim=32,
        dtype="bf16",
        rope_theta=500000.0,
        rope_style="gptj",
        rotary_dim=16,
        scaling="llama3:8,1,4,8192",
        k_pre_rope=True,
    )
    assert client.model_register(m) is False
    assert client.model_register(m) is True  # identical: existed
    got = client.model_get("py-llama")
    assert got == m
    assert any(x == m for x in client.model_list())
    y = kvblend.Model("py-yarn", 2, 1, 16, "f32", scaling="yarn:4,64")
    client.model_register(y)
    # libkvblend formats the SPEC with the default betas spelled out
    assert client.model_get("py-yarn").scaling == "yarn:4,64,32,1"
    with pytest.raises(kvblend.ModelConflict) as e:
        client.model_register(kvblend.Model("py-llama", 4, 2, 64, "bf16"))
    assert e.value.name == "model_conflict" and e.value.code == -1009
    with pytest.raises(kvblend.UnknownModel, match="no-such-model") as e:
        client.model_get("no-such-model")
    assert e.value.name == "unknown_model"
    with pytest.raises(kvblend.BadArgument, match="SPEC"):
        client.model_register(kvblend.Model("bad", 1, 1, 16, scaling="llama3:8"))
    with pytest.raises(kvblend.BadArgument):
        client.model_register(kvblend.Model("x" * 65, 1, 1, 16))
    client.ping()  # still serving


def test_models_with_local_layers(client):
    """Two RoPE bases (Gemma 3's local and full-attention layers): registered through
    kvb_model_register_layers, read back by model_get and model_list, part of the model's
    identity (a registration without them conflicts, naming the field); the daemon refuses
    what it cannot describe, naming the field; the store keeps them with a codec too."""
    m = kvblend.Model("py-gemma", 6, 1, 32, "bf16", rope_theta=1e6, rotary_dim=32,
                      rope_local_theta=1e4, full_every=3)
    assert client.model_register(m) is False
    assert client.model_register(m) is True
    assert client.model_get(m.name) == m
    assert [x for x in client.model_list() if x.name == m.name] == [m]
    assert [m.is_local(layer) for layer in range(6)] == [True, True, False] * 2
    with pytest.raises(kvblend.ModelConflict, match="rope_local_theta"):
        client.model_register(kvblend.Model("py-gemma", 6, 1, 32, "bf16", rope_theta=1e6))
    q = kvblend.Model("py-gemma-int8", 4, 1, 32, "f16", 1e4, rotary_dim=32, store="int8",
                      rope_local_theta=1e4, full_every=2)
    client.model_register(q)
    assert client.model_get(q.name) == q
    for every, theta, why in ((1, 1e4, "full_every 1 out of range 2..6"),
                              (7, 1e4, "full_every 7 out of range 2..6"),
                              (3, float("nan"), "rope_local_theta must be a positive number"),
                              (3, float("inf"), "rope_local_theta must be a positive number")):
        with pytest.raises(kvblend.BadArgument, match=why):
            client.model_register(kvblend.Model(f"py-bad-{every}", 6, 1, 32,
                                                rope_local_theta=theta, full_every=every))
    with pytest.raises(kvblend.BadArgument, match="go together"):
        client.model_register(kvblend.Model("py-bad", 6, 1, 32, rope_local_theta=1e4))
    for every in (-3, 2.5, True, 1 << 32):  # refused here, before ctypes could wrap them
        with pytest.raises(kvblend.BadArgument, match=f"full_every must be an int.*{every!r}"):
            client.model_register(kvblend.Model("py-bad", 6, 1, 32, rope_local_theta=1e4,
                                                full_every=every))
    client.ping()


@pytest.mark.parametrize("store", ["int8", "fp8", "int4", "int4:64"])
def test_quantized_store(client, store):
    """A model stored quantized: the codec is part of its identity; GET gives back the
    model's dtype within the codec's error; the chunk is stored smaller."""
    m = kvblend.Model(f"q-{store.replace(':', '-')}", 2, 2, 64, "f16", store=store)
    client.model_register(m)
    got = client.model_get(m.name)
    assert got.store == (store if ":" in store or store != "int4" else "int4:32")
    with pytest.raises(kvblend.ModelConflict):
        client.model_register(kvblend.Model(m.name, 2, 2, 64, "f16"))
    kv = rand_kv(m, 40)
    h = kvblend.chunk_hash(range(7000, 7040))
    client.put(m.name, h, kv)
    back = client.get(m.name, h).astype(np.float32)
    x = kv.astype(np.float32)
    scale = np.abs(x).max()
    assert np.abs(back - x).max() <= scale * {"int8": 1 / 127, "fp8": 1 / 16}.get(store, 1 / 15)
    assert not np.array_equal(back, x)  # lossy: really quantized
    info = client.lookup(m.name, [h])[0]
    assert info.stored_bytes < info.raw_bytes * (0.6 if store.startswith("int4") else 0.7)
    with pytest.raises(kvblend.BadArgument, match="store"):
        kvblend.Model("bad-store", 1, 1, 16, store="int3")._to_c()


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_put_get_roundtrip(client, dtype):
    m = kvblend.Model(f"rt-{dtype}", 3, 2, 16, dtype)
    client.model_register(m)
    kv = rand_kv(m, 7)
    h = kvblend.chunk_hash(range(100, 107))
    assert client.put(m.name, h, kv, base_pos=5) is False
    assert client.put(m.name, h, kv, base_pos=5) is True  # immutable: a no-op
    back = client.get(m.name, h)
    assert back.dtype == m.np_dtype and back.shape == kv.shape
    assert back.tobytes() == kv.tobytes()
    part = client.get(m.name, kvblend.hash_hex(h), layers=(1, 3))
    assert part.shape == (2, 2, 7, 2, 16) and np.array_equal(part, kv[1:3])
    assert np.array_equal(client.get(m.name, h, layers=slice(2, 3)), kv[2:3])
    info = client.lookup(m.name, [h])[0]
    assert (info.found, info.num_tokens, info.base_pos, info.num_layers) == (True, 7, 5, 3)
    assert info.raw_bytes == kv.nbytes and info.hash == h


def test_put_non_contiguous_and_dtype_arg(client, model):
    kv = rand_kv(model, 5)
    # A transposed copy viewed back: same values, not C-contiguous.
    strided = np.asfortranarray(kv)
    assert not strided.flags.c_contiguous
    h = os.urandom(32)
    client.put(model.name, h, strided, dtype="f16")
    assert np.array_equal(client.get(model.name, h), kv)
    with pytest.raises(kvblend.BadArgument, match="does not hold"):
        client.put(model.name, os.urandom(32), kv, dtype="f32")


def test_lookup_list_delete(client, model):
    hs = [os.urandom(32) for _ in range(3)]
    for i, h in enumerate(hs[:2]):
        client.put(model.name, h, rand_kv(model, 4 + i))
    infos = client.lookup(model.name, hs)
    assert [i.found for i in infos] == [True, True, False]
    assert [i.num_tokens for i in infos[:2]] == [4, 5]
    assert client.lookup(model.name, []) == []
    listed = {c.hash: c for c in client.list(model.name)}
    assert set(listed) == set(hs[:2])
    assert listed[hs[1]].num_tokens == 5 and listed[hs[1]].stored_bytes > 0
    client.delete(model.name, hs[0])
    assert not client.lookup(model.name, [hs[0]])[0].found
    with pytest.raises(kvblend.NotFound) as e:
        client.delete(model.name, hs[0])
    assert e.value.code == -1010 and e.value.name == "not_found" and e.value.message
    assert [c.hash for c in client.list(model.name)] == [hs[1]]


def test_pin_unpin(client, model):
    h = os.urandom(32)
    client.put(model.name, h, rand_kv(model, 3))
    client.pin(model.name, h, 60)
    client.pin(model.name, h, 120)  # again: resets the TTL
    client.unpin(model.name, h)
    with pytest.raises(kvblend.NotFound):
        client.unpin(model.name, h)  # not pinned any more
    with pytest.raises(kvblend.BadArgument) as e:
        client.pin(model.name, h, 0)
    assert e.value.message
    with pytest.raises(kvblend.NotFound):
        client.pin(model.name, os.urandom(32), 60)


def test_stats(client, model):
    before = client.stats()
    assert before and all(isinstance(k, str) and isinstance(v, float) for k, v in before.items())
    client.put(model.name, os.urandom(32), rand_kv(model, 3))
    after = client.stats()
    grown = [k for k in before if after.get(k, 0) > before[k]]
    assert grown, "no counter moved after a put"


def test_errors_carry_the_daemons_message(client, model):
    h = os.urandom(32)
    with pytest.raises(kvblend.NotFound) as e:
        client.get(model.name, h)
    assert e.value.name == "not_found" and e.value.message != "not_found"
    with pytest.raises(kvblend.NotFound):
        client.get(model.name, h, out=np.empty(model.kv_shape(3), np.float16))
    with pytest.raises(kvblend.UnknownModel) as e:
        client.put("nope", h, rand_kv(model, 2))
    assert e.value.code == -1005 and "nope" in e.value.message
    # 3 heads where the model has 2: 5-D and pairs of K, V, so the daemon judges it.
    bad = np.zeros((3, 2, 4, 3, 16), np.float16)
    with pytest.raises(kvblend.BadShape) as e:
        client.put(model.name, h, bad)
    assert e.value.code == -1004 and e.value.message
    with pytest.raises(kvblend.DtypeMismatch) as e:
        client.put(model.name, h, np.zeros(model.kv_shape(4), np.float32))
    assert e.value.name == "dtype_mismatch"
    with pytest.raises(kvblend.BadArgument, match="layers, 2, tokens"):
        client.put(model.name, h, np.zeros((2, 4, 2, 16), np.float16))
    with pytest.raises(kvblend.BadArgument, match="32 bytes"):
        client.put(model.name, b"short", rand_kv(model, 2))
    with pytest.raises(kvblend.BadArgument, match="hex"):
        client.get(model.name, "zz" * 32)
    client.put(model.name, h, rand_kv(model, 2))
    with pytest.raises(kvblend.BufferSize) as e:
        client.get(model.name, h, out=np.empty(model.kv_shape(3), np.float16))
    assert e.value.name == "ENOBUFS"
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvblend.KvblendError)
    assert client.ping()  # the daemon still serves


def test_get_into_caller_array_no_copy(client, model):
    kv = rand_kv(model, 9)
    h = os.urandom(32)
    client.put(model.name, h, kv)
    out = np.full(kv.shape, np.nan, np.float16)
    ptr = out.ctypes.data
    got = client.get(model.name, h, out=out)
    assert got is out and out.ctypes.data == ptr
    assert np.array_equal(out, kv)
    part = np.zeros(model.kv_shape(9, 1), np.float16)
    client.get(model.name, h, layers=(2, 3), out=part)
    assert np.array_equal(part, kv[2:3])
    # A non-contiguous target is still filled (through a temporary).
    t = np.zeros(kv.shape[::-1], np.float16).T
    assert not t.flags.c_contiguous
    client.get(model.name, h, out=t)
    assert np.array_equal(t, kv)


def test_shared_buffer_zero_copy(client, frames_client, model):
    kv = rand_kv(model, 6)
    buf = client.shared_buffer(kv.nbytes)
    assert buf is not None and buf.dtype == np.uint8 and buf.nbytes >= kv.nbytes
    staged = buf[: kv.nbytes].view(np.float16).reshape(kv.shape)
    staged[...] = kv
    h = os.urandom(32)
    client.put(model.name, h, staged)
    staged[...] = 0
    got = client.get(model.name, h, out=staged)
    assert got.ctypes.data == buf.ctypes.data and np.array_equal(staged, kv)
    assert frames_client.shared_buffer(1024) is None


SIXTEEN_MIB = kvblend.Model("big", num_layers=8, num_kv_heads=8, head_dim=128, dtype="f16")


@pytest.mark.parametrize("which", ["client", "frames_client"])
def test_16mib_roundtrip(request, which):
    c = request.getfixturevalue(which)
    c.model_register(SIXTEEN_MIB)
    kv = rand_kv(SIXTEEN_MIB, 1024 // 2)
    assert kv.nbytes == 16 << 20
    h = os.urandom(32)
    c.put(SIXTEEN_MIB.name, h, kv)
    back = c.get(SIXTEEN_MIB.name, h)
    assert back.tobytes() == kv.tobytes()
    into = np.empty_like(kv)
    c.get(SIXTEEN_MIB.name, h, out=into)
    assert np.array_equal(into, kv)


@pytest.mark.parametrize("which", ["client", "frames_client"])
def test_get_layers_leaves_the_frames(request, which):
    c = request.getfixturevalue(which)
    c.model_register(SIXTEEN_MIB)
    kv = rand_kv(SIXTEEN_MIB, 1024 // 2)
    h = os.urandom(32)
    c.put(SIXTEEN_MIB.name, h, kv)
    # Under AddressSanitizer (run_tests.sh preloads libasan) malloc is not glibc's.
    assert kvblend.malloc_tune() is ("libasan" not in os.environ.get("LD_PRELOAD", ""))
    with c.get_layers(SIXTEEN_MIB.name, h, layers=(2, 6)) as got:
        assert (got.layer_begin, got.layer_end) == (2, 6) and got.info.num_tokens == 512
        assert len(got.k) == len(got.v) == 4
        for i in range(4):
            assert got.k[i].shape == (512, 8, 128) and got.k[i].dtype == np.float16
            assert not got.k[i].flags.writeable
            assert np.array_equal(got.k[i], kv[2 + i, 0])
            assert np.array_equal(got.v[i], kv[2 + i, 1])
    assert got.k == [] and got.v == []
    got.close()  # idempotent
    # Without close, an array keeps the frames alive after the Layers is dropped.
    last_v = c.get_layers(SIXTEEN_MIB.name, h).v[-1]
    assert np.array_equal(last_v, kv[7, 1])
    with pytest.raises(kvblend.NotFound):
        c.get_layers(SIXTEEN_MIB.name, os.urandom(32))
    with pytest.raises(kvblend.BadArgument):
        c.get_layers(SIXTEEN_MIB.name, h, layers=(6, 2))


def test_frames_client_covers_every_bulk_call(frames_client):
    m = kvblend.Model("frames", 2, 2, 16, "bf16")
    frames_client.model_register(m)
    kv = rand_kv(m, 5)
    h = os.urandom(32)
    frames_client.put(m.name, h, kv, base_pos=3)
    assert np.array_equal(frames_client.get(m.name, h), kv)
    moved = frames_client.get_rerotated(m.name, h, 3)
    assert np.array_equal(moved, kv)  # to the positions it was stored at: unchanged


def test_get_rerotated(client):
    m = kvblend.Model("rot", 2, 1, 8, "f32")
    client.model_register(m)
    rng = np.random.default_rng(3)
    kv = rng.standard_normal(m.kv_shape(4)).astype(np.float32)
    h = os.urandom(32)
    client.put(m.name, h, kv, base_pos=0)
    same = client.get_rerotated(m.name, h, 0)
    np.testing.assert_allclose(same, kv, rtol=0, atol=1e-6)
    moved = client.get_rerotated(m.name, h, 10)
    # Values carry no position; keys turn, each (j, j + 4) pair keeping its length.
    assert np.array_equal(moved[:, 1], kv[:, 1])
    assert not np.allclose(moved[:, 0], kv[:, 0], atol=1e-3)
    k0, k1 = kv[:, 0], moved[:, 0]
    n0 = k0[..., :4] ** 2 + k0[..., 4:] ** 2
    n1 = k1[..., :4] ** 2 + k1[..., 4:] ** 2
    np.testing.assert_allclose(n1, n0, rtol=1e-5, atol=1e-6)
    # Rotating by 10 from 0 then is the same as storing at 0 and asking for 10 twice.
    out = np.empty_like(kv)
    assert client.get_rerotated(m.name, h, 10, out=out) is out
    assert np.array_equal(out, moved)
    assert np.array_equal(client.get_rerotated(m.name, h, 10, layers=(1, 2)), moved[1:2])


@pytest.mark.parametrize("which", ["client", "frames_client"])
def test_get_heads(request, which):
    """A head range's GET: the heads axis cut to the range, re-rotated or not."""
    c = request.getfixturevalue(which)
    c.model_register(SIXTEEN_MIB)
    kv = rand_kv(SIXTEEN_MIB, 64)
    h = os.urandom(32)
    c.put(SIXTEEN_MIB.name, h, kv, base_pos=2)
    for hb, hc in ((0, 1), (2, 3), (4, 4)):
        got = c.get(SIXTEEN_MIB.name, h, heads=(hb, hc))
        assert got.shape == (8, 2, 64, hc, 128)
        assert np.array_equal(got, kv[:, :, :, hb : hb + hc])
        into = np.empty((2, 2, 64, hc, 128), np.float16)
        assert c.get(SIXTEEN_MIB.name, h, layers=(3, 5), out=into, heads=(hb, hc)) is into
        assert np.array_equal(into, kv[3:5, :, :, hb : hb + hc])
        moved = c.get_rerotated(SIXTEEN_MIB.name, h, 40)
        part = c.get_rerotated(SIXTEEN_MIB.name, h, 40, heads=(hb, hc))
        assert np.array_equal(part, moved[:, :, :, hb : hb + hc])
    with pytest.raises(kvblend.BadArgument, match="beyond the model's 8 KV heads"):
        c.get(SIXTEEN_MIB.name, h, heads=(6, 3))
    with pytest.raises(kvblend.BadArgument, match="count >= 1"):
        c.get(SIXTEEN_MIB.name, h, heads=(0, 0))
    with pytest.raises(kvblend.BufferSize):
        c.get(SIXTEEN_MIB.name, h, out=np.empty((8, 2, 64, 3, 128), np.float16), heads=(0, 2))
    assert np.array_equal(c.get(SIXTEEN_MIB.name, h), kv)  # the daemon still serves


@pytest.mark.parametrize("ids", [[], [0], [1, 2, 3], list(range(5000)), [2**32 - 1, 7]])
def test_chunk_hash_is_blake2b(ids):
    want = hashlib.blake2b(np.asarray(ids, "<u4").tobytes(), digest_size=32).digest()
    assert kvblend.chunk_hash(ids) == want
    assert kvblend.chunk_hash(np.asarray(ids, np.int64)) == want
    assert kvblend.hash_hex(want) == want.hex()


def test_chunk_hash_rejects_out_of_range():
    with pytest.raises(kvblend.BadArgument):
        kvblend.chunk_hash([-1])
    with pytest.raises(kvblend.BadArgument):
        kvblend.chunk_hash([2**32])


def test_torch_tensors(client, model):
    torch = pytest.importorskip("torch")
    kv = torch.randn(*model.kv_shape(3)).to(torch.float16)
    h = os.urandom(32)
    client.put(model.name, h, kv)
    assert np.array_equal(client.get(model.name, h), kv.numpy())


def test_threads_serialize(daemon, model):
    import threading

    errors = []
    with kvblend.Client(daemon.endpoint) as c:

        def work():
            try:
                for _ in range(20):
                    c.ping()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors


ABI_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "kvblend.h"
#define S(t) printf(#t " %zu\n", sizeof(struct t))
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f))
int main(void)
{
	S(kvb_model); O(kvb_model, rope_theta); O(kvb_model, factor); O(kvb_model, beta_fast);
	O(kvb_model, max_pos); O(kvb_model, k_pre_rope); O(kvb_model, store_codec);
	O(kvb_model, store_group);
	S(kvb_kv_layout); O(kvb_kv_layout, head_stride); O(kvb_kv_layout, page_tokens);
	O(kvb_kv_layout, page_stride); O(kvb_kv_layout, n_pages);
	S(kvb_chunk_info); O(kvb_chunk_info, raw_bytes); O(kvb_chunk_info, stored_bytes);
	S(kvb_stat); O(kvb_stat, value);
	S(kvb_connect_opts); O(kvb_connect_opts, shm_size); O(kvb_connect_opts, client_secret_key);
	S(kvb_segment); O(kvb_segment, pos); O(kvb_segment, count);
	S(kvb_fuse_params); O(kvb_fuse_params, n_checks); O(kvb_fuse_params, metric);
	S(kvb_get_opts); O(kvb_get_opts, rerotate); O(kvb_get_opts, pos);
	O(kvb_get_opts, head_count);
	return 0;
}
"""


def test_structs_match_the_header():
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = os.path.join(os.path.dirname(__file__), "..", "..", "include")
    if not cc or not os.path.isfile(os.path.join(inc, "kvblend.h")):
        pytest.skip("needs a C compiler and client/include/kvblend.h")
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "abi.c"), os.path.join(d, "abi")
        with open(src, "w") as f:
            f.write(ABI_C)
        subprocess.run([cc, "-std=c11", "-I", inc, src, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    structs = {
        "kvb_model": _lib.KvbModel,
        "kvb_chunk_info": _lib.KvbChunkInfo,
        "kvb_stat": _lib.KvbStat,
        "kvb_connect_opts": _lib.KvbConnectOpts,
        "kvb_segment": _lib.KvbSegment,
        "kvb_fuse_params": _lib.KvbFuseParams,
        "kvb_kv_layout": _lib.KvbKvLayout,
        "kvb_get_opts": _lib.KvbGetOpts,
    }
    lines = out.split("\n")
    assert len([x for x in lines if x]) == 31
    for line in filter(None, lines):
        what, n = line.split()
        if "." in what:
            s, field = what.split(".")
            assert getattr(structs[s], field).offset == int(n), what
        else:
            import ctypes

            assert ctypes.sizeof(structs[what]) == int(n), what


def test_region_refusals_carry_their_code(client):
    """A refused region raises the error its code names (kvb_last_code), not a guess."""
    with pytest.raises(kvblend.BadArgument, match="region of 0 bytes"):
        client.region(0)
    # far over the daemon's shm_max: its bad_argument, where a guess from the message
    # ("shared-memory ...") said ENOMEM before
    with pytest.raises(kvblend.BadArgument, match="shm_max") as e:
        client.region(1 << 40)
    assert e.value.name == "bad_argument", e.value.name
