#!/usr/bin/env python3
"""NumPy reference tests of blend/: RoPE inverse frequencies for every scaling type,
re-rotation for every style, scaling and dtype (positions up to 131072), composition,
bit-identical SIMD builds, deviation, HKVD selection and merge.

usage: python3 -m pytest tests/blend/test_blend.py --blend-tool BLEND_TOOL [--backend cuda]
With --backend cuda every case runs on the CUDA backend (the parity suite): against
the same reference, and bit-identical to the CPU builds in test_isa_identical. Exits
77 (skipped) with the reason when there is no usable CUDA device (pytest.exit).
The reference is written from the papers' and Hugging Face transformers' formulas,
independently of the C code, in float64.
"""
import math
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import kvbtest
# The reference (eval/kvref.py, on the path by tests/pytest.ini) is shared with
# eval/outliers.py: tests import eval/.
from kvref import EPS, from_dtype, pair_index, ref_inv_freq, ref_rotate, ref_select, to_dtype

COMPUTE = {"rotate", "deviation", "select", "merge"}
TOOL = BACKEND = TMP = None  # blend_tool, --backend and the scratch folder (_tool)


@pytest.fixture(scope="module", autouse=True)
def _tool(blend_tool, pytestconfig):
    """The module's blend_tool and backend, a scratch folder, and at the end the batch
    process stopped and the folder removed."""
    global TOOL, BACKEND, TMP
    TOOL, BACKEND = blend_tool, pytestconfig.getoption("backend")
    TMP = tempfile.mkdtemp(prefix="kvb-blend-")
    yield
    _stop_batch()
    shutil.rmtree(TMP, ignore_errors=True)


@pytest.fixture
def check():
    """A test's checks (kvbtest.Checks): the test ends with check.done()."""
    return kvbtest.Checks()


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


_batch = None


def _call(args):
    """One blend_tool command, through one `blend_tool batch` process for the whole run
    (a CUDA context starts once, not once a case)."""
    global _batch
    if _batch is None:
        _batch = subprocess.Popen([TOOL, "batch"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE,
                                  stderr=open(os.path.join(TMP, "stderr"), "w"), text=True)
    words = [str(a) for a in args]
    assert all(w and not any(c.isspace() for c in w) for w in words), words
    err_at = os.path.getsize(os.path.join(TMP, "stderr"))
    _batch.stdin.write(" ".join(words) + "\n")
    _batch.stdin.flush()
    out = []
    while True:
        line = _batch.stdout.readline()
        if not line:
            raise RuntimeError(f"blend_tool batch exited during: {' '.join(words)}")
        if line.startswith("\x1e"):
            break
        out.append(line)
    with open(os.path.join(TMP, "stderr")) as f:
        f.seek(err_at)
        err = f.read()
    # the newline blend_tool puts before the marker is not the command's
    text = "".join(out)
    return _Result(int(line[1:]), text[:-1] if text.endswith("\n") else text, err)


def _stop_batch():
    global _batch
    if _batch is not None:
        _batch.stdin.close()
        _batch.wait(timeout=30)
        _batch = None


def run(*args):
    args = list(args)
    if BACKEND and args[0] in COMPUTE and "--isa" not in args:
        args += ["--isa", BACKEND]
    r = _call(args)
    if r.returncode == 77:
        if BACKEND and args[-1] == BACKEND:  # the whole run is skipped: 77 (ctest's skip)
            _stop_batch()
            shutil.rmtree(TMP, ignore_errors=True)
            pytest.exit(r.stdout.strip(), returncode=77)
        return None
    if r.returncode != 0:
        raise RuntimeError(f"blend_tool {' '.join(map(str, args))}: {r.stderr}")
    return r


def path(name):
    return os.path.join(TMP, name)


# ---------- tests ----------

SCALINGS = ["none", "linear:4", "llama3:8,1,4,8192", "yarn:4,4096", "yarn:16,2048,64,2",
            "dynamic:4,2048"]


def test_inv_freq(check):
    for spec in SCALINGS:
        for dim, theta in [(128, 10000.0), (64, 500000.0), (96, 1e6)]:
            for seq in [100, 2048, 70000]:
                run("invfreq", "--head-dim", dim, "--rotary-dim", dim, "--style", "neox",
                    "--theta", theta, "--scaling", spec, "--seq", seq, "--out", path("f.npy"))
                got = np.load(path("f.npy"))
                inv, af = ref_inv_freq(dim, theta, spec, seq)
                ok = np.allclose(got[:-1], inv, rtol=1e-12, atol=0) and abs(got[-1] - af) < 1e-12
                check(f"inv_freq {spec} dim={dim} seq={seq}", ok,
                      f"max rel err {np.max(np.abs(got[:-1] / inv - 1)):.3g}")
    check.done()


def rotate_case(rng, style, spec, dt, R, D, H, T, old_pos, new_pos, pre_rope, isa=None,
                new_seq=None):
    """Returns (tool output as float64, reference of the re-rotation, stored float64)."""
    x = rng.standard_normal((T, H, D))
    x[:, :, 1] *= 30.0  # a large-magnitude channel, as real keys have
    old_seq, nseq = old_pos + T, (new_seq if new_seq else new_pos + T)
    inv_old, af_old = ref_inv_freq(R, 10000.0, spec, old_seq)
    inv_new, af_new = ref_inv_freq(R, 10000.0, spec, nseq)
    t = np.arange(T, dtype=np.float64)[:, None]
    if pre_rope:
        stored = from_dtype(to_dtype(x, dt), dt)
        ang = (new_pos + t) * inv_new[None, :]
        ref = ref_rotate(stored, ang, af_new, R, style)
    else:
        stored = from_dtype(to_dtype(ref_rotate(x, (old_pos + t) * inv_old[None, :], af_old, R,
                                                style), dt), dt)
        # undo at the old positions, rotate at the new ones: one rotation in float64
        ang = (new_pos + t) * inv_new[None, :] - (old_pos + t) * inv_old[None, :]
        ref = ref_rotate(stored, ang, af_new / af_old, R, style)
    np.save(path("k.npy"), to_dtype(stored, dt))
    args = ["rotate", "--head-dim", D, "--rotary-dim", R, "--style", style, "--theta", 10000.0,
            "--scaling", spec, "--dtype", dt, "--in", path("k.npy"), "--out", path("o.npy"),
            "--old-pos", old_pos, "--new-pos", new_pos, "--old-seq", old_seq, "--new-seq", nseq]
    if pre_rope:
        args.append("--pre-rope")
    if isa:
        args += ["--isa", isa]
    if run(*args) is None:
        return None
    return from_dtype(np.load(path("o.npy")), dt), ref, stored, x


def pair_norm(v, R, style):
    i1, i2 = pair_index(v.shape[2], R, style)
    n = np.zeros_like(v)
    pn = np.sqrt(v[:, :, i1] ** 2 + v[:, :, i2] ** 2)
    n[:, :, i1] = pn
    n[:, :, i2] = pn
    n[:, :, R:] = np.abs(v[:, :, R:])
    return n


def test_rotate(check):
    rng = np.random.default_rng(1)
    for style in ["neox", "gptj"]:
        for spec in SCALINGS:
            for dt in ["f16", "bf16", "f32"]:
                for D, R in [(64, 64), (64, 32)]:
                    for old_pos, new_pos, pre in [(0, 37, False), (1000, 0, False),
                                                  (0, 131072 - 16, False), (5, 900, True),
                                                  (0, 131072 - 16, True)]:
                        r = rotate_case(rng, style, spec, dt, R, D, 3, 16, old_pos, new_pos, pre)
                        out, ref, stored, _ = r
                        # Output rounding (half an ulp of the dtype) plus fp32 arithmetic
                        # on a pair (a few 2^-24 of the pair's norm, cos/sin rounded to
                        # fp32 included): the bound below holds with margin.
                        scale = pair_norm(stored, R, style)
                        tol = EPS[dt] * np.abs(ref) + 16 * 2.0 ** -24 * scale + 1e-30
                        err = np.abs(out - ref)
                        name = f"rotate {style} {spec} {dt} R={R} {old_pos}->{new_pos}" + \
                            (" pre-rope" if pre else "")
                        check(name, np.all(err <= tol),
                              f"worst err/tol {np.max(err / tol):.3g}")
    check.done()


def test_rotate_matches_direct(check):
    """Re-rotating stored keys equals rotating the original keys at the new positions,
    up to the quantisation of the stored keys (one more rounding)."""
    rng = np.random.default_rng(2)
    for style in ["neox", "gptj"]:
        for spec in SCALINGS:
            for dt in ["f16", "bf16", "f32"]:
                out, _, stored, x = rotate_case(rng, style, spec, dt, 64, 64, 2, 16, 100, 131000,
                                                False)
                inv_new, af_new = ref_inv_freq(64, 10000.0, spec, 131016)
                t = np.arange(16, dtype=np.float64)[:, None]
                direct = ref_rotate(x, (131000 + t) * inv_new[None, :], af_new, 64, style)
                tol = 3 * EPS[dt] * pair_norm(direct, 64, style) + 1e-6
                check(f"direct {style} {spec} {dt}", np.all(np.abs(out - direct) <= tol),
                      f"worst {np.max(np.abs(out - direct) / tol):.3g}")
    check.done()


def test_composition(check):
    """p -> q -> p returns the stored keys within two roundings."""
    rng = np.random.default_rng(3)
    for style in ["neox", "gptj"]:
        for spec in ["none", "llama3:8,1,4,8192", "yarn:4,4096"]:
            for dt in ["f16", "bf16", "f32"]:
                x = to_dtype(rng.standard_normal((8, 2, 64)), dt)
                np.save(path("k.npy"), x)
                base = ["--head-dim", 64, "--rotary-dim", 64, "--style", style, "--theta",
                        10000.0, "--scaling", spec, "--dtype", dt]
                run("rotate", *base, "--in", path("k.npy"), "--out", path("q.npy"),
                    "--old-pos", 12, "--new-pos", 120000)
                run("rotate", *base, "--in", path("q.npy"), "--out", path("p.npy"),
                    "--old-pos", 120000, "--new-pos", 12)
                a, b = from_dtype(x, dt), from_dtype(np.load(path("p.npy")), dt)
                tol = 2 * EPS[dt] * pair_norm(a, 64, style) + 1e-30
                check(f"compose {style} {spec} {dt}", np.all(np.abs(a - b) <= tol),
                      f"worst {np.max(np.abs(a - b) / tol):.3g}")
    check.done()


def test_isa_identical(check):
    rng = np.random.default_rng(4)
    for style in ["neox", "gptj"]:
        for dt in ["f16", "bf16", "f32"]:
            outs = {}
            for isa in ["baseline", "avx2", "avx512", "cuda"]:
                r = rotate_case(np.random.default_rng(5), style, "yarn:4,4096", dt, 64, 128, 4,
                                33, 3, 4000, False, isa=isa)
                if r is None:
                    print(f"skip - {isa}: not on this machine")
                    continue
                outs[isa] = np.load(path("o.npy")).tobytes()
            vals = list(outs.values())
            check(f"isa bit-identical rotate {style} {dt}", all(v == vals[0] for v in vals))
            fresh = to_dtype(rng.standard_normal((50, 4, 72)), dt)
            stored = to_dtype(rng.standard_normal((80, 4, 72)), dt)
            idx = rng.choice(80, 50, replace=False).astype("<i4")
            np.save(path("f.npy"), fresh)
            np.save(path("s.npy"), stored)
            np.save(path("i.npy"), idx)
            devs = {}
            for isa in ["baseline", "avx2", "avx512", "cuda"]:
                if run("deviation", "--dtype", dt, "--fresh", path("f.npy"), "--stored",
                       path("s.npy"), "--idx", path("i.npy"), "--out", path("d.npy"),
                       "--isa", isa) is not None:
                    devs[isa] = np.load(path("d.npy")).tobytes()
            vals = list(devs.values())
            check(f"isa bit-identical deviation {dt}", all(v == vals[0] for v in vals))
    check.done()


def test_deviation(check):
    rng = np.random.default_rng(6)
    for dt in ["f16", "bf16", "f32"]:
        fresh = to_dtype(rng.standard_normal((40, 8, 128)), dt)
        stored = to_dtype(rng.standard_normal((100, 8, 128)) * 2, dt)
        idx = rng.choice(100, 40, replace=False).astype("<i4")
        np.save(path("f.npy"), fresh)
        np.save(path("s.npy"), stored)
        np.save(path("i.npy"), idx)
        run("deviation", "--dtype", dt, "--fresh", path("f.npy"), "--stored", path("s.npy"),
            "--idx", path("i.npy"), "--out", path("d.npy"))
        got = np.load(path("d.npy")).astype(np.float64)
        ref = ((from_dtype(fresh, dt) - from_dtype(stored, dt)[idx]) ** 2).sum(axis=(1, 2))
        # fp32 accumulation of 1024 terms: relative error well under 1e-5
        check(f"deviation {dt}", np.allclose(got, ref, rtol=1e-5, atol=0),
              f"max rel {np.max(np.abs(got / ref - 1)):.3g}")
    check.done()


def test_select(check):
    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(1, 3000))
        toks = rng.permutation(n + 50)
        cand = np.sort(toks[:n]).astype("<i4")
        always = np.sort(toks[n:n + int(rng.integers(0, 50))]).astype("<i4")
        # distinct deviations, spaced far apart in float32: no near-ties
        dev = (rng.permutation(n).astype(np.float64) * 1.5 + 1).astype("<f4")
        ratio = float(rng.choice([0.0, 0.01, 0.15, 0.5, 1.0, 0.333]))
        n_cached = n + int(rng.integers(0, 100))
        np.save(path("c.npy"), cand)
        np.save(path("d.npy"), dev)
        np.save(path("a.npy"), always)
        run("select", "--cand", path("c.npy"), "--dev", path("d.npy"), "--ratio", ratio,
            "--n-cached", n_cached, "--always", path("a.npy"), "--out", path("s.npy"))
        got = np.load(path("s.npy"))
        ref = ref_select(cand, dev, ratio, n_cached, always)
        check(f"select trial {trial} n={n} r={ratio}", np.array_equal(got, ref))
    # exact ties go to the lower index; NaN counts as largest
    cand = np.arange(10, dtype="<i4")
    dev = np.array([1, 5, 5, 2, 5, 0, np.nan, 5, 3, 3], dtype="<f4")
    np.save(path("c.npy"), cand)
    np.save(path("d.npy"), dev)
    np.save(path("a.npy"), np.array([], dtype="<i4"))
    run("select", "--cand", path("c.npy"), "--dev", path("d.npy"), "--ratio", 0.3,
        "--n-cached", 10, "--always", path("a.npy"), "--out", path("s.npy"))
    check("select ties to lower index", np.array_equal(np.load(path("s.npy")), [1, 2, 6]),
          str(np.load(path("s.npy"))))
    check.done()


def test_merge(check):
    rng = np.random.default_rng(8)
    for dt in ["f16", "bf16", "f32"]:
        for nsel in [0, 1, 17, 100]:
            stored = to_dtype(rng.standard_normal((100, 2, 16)), dt)
            sel = np.sort(rng.choice(100, nsel, replace=False)).astype("<i4")
            fresh = to_dtype(rng.standard_normal((nsel, 2, 16)), dt)
            np.save(path("s.npy"), stored)
            np.save(path("f.npy"), fresh)
            np.save(path("i.npy"), sel)
            run("merge", "--dtype", dt, "--stored", path("s.npy"), "--fresh", path("f.npy"),
                "--sel", path("i.npy"), "--out", path("o.npy"))
            ref = stored.copy()
            ref[sel] = fresh
            check(f"merge {dt} {nsel}", np.load(path("o.npy")).tobytes() == ref.tobytes())
    check.done()
