"""kvblend's own AEGIS against the reference: libaegis, through PyPI's `aeg` binding.

usage: python3 -m pytest tests/aegis/test_aegis_ref.py --aegis-tool build/bin/aegis_tool

proto/aegis.c is the project's implementation (Debian 12 has no library with AEGIS).
It held the specification's vectors (test_bulk) and an adversarial round's 74,805
cases; this keeps it held, on every CI run: random keys, nonces, associated data
and messages of every length around the block sizes (16, 32, 64 bytes) and beyond,
each sealed by aegis_tool (the message in two pieces, split anywhere) and by libaegis,
for each variant this CPU runs. Ciphertext and tag must be equal byte for byte; the
ciphertext must open back; a flipped tag must be refused with the buffer zeroed.

`aeg` 0.9.0 (the newest for Python 3.11) is installed once into a venv outside the
checkout, under ${KVBLEND_ENGINE_CACHE:-/var/cache/kvblend}/aeg-0.9.0.
"""

import fcntl
import os
import random
import subprocess
import sys

import pytest

CACHE = os.environ.get("KVBLEND_ENGINE_CACHE", "/var/cache/kvblend")
VENV = os.path.join(CACHE, "aeg-0.9.0")
PY = os.path.join(VENV, "bin", "python")


def reference_python():
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".aeg.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ok = os.path.exists(PY) and subprocess.run(
            [PY, "-c", "import aeg.aegis128l, aeg.aegis128x2"], capture_output=True
        ).returncode == 0
        if not ok:
            subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True)
            subprocess.run([PY, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "aeg==0.9.0"], check=True)
    return PY


REFERENCE = r'''
import sys, aeg.aegis128l as L, aeg.aegis128x2 as X
mods = {"L": L, "X": X}
for line in sys.stdin:
    v, k, n, a, m, _ = line.split()
    un = lambda h: b"" if h == "-" else bytes.fromhex(h)
    ct, tag = mods[v].encrypt_detached(un(k), un(n), un(m), un(a))
    print((bytes(ct).hex() or "-") + " " + bytes(tag).hex(), flush=True)
'''


NAMES = {"L": "AEGIS-128L", "X": "AEGIS-128X2"}


def cases(rng, variants):
    edges = [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 127, 128, 129, 255, 256, 257,
             511, 512, 1000, 1023, 1024, 1025]
    lengths = edges + [rng.randrange(0, 4096) for _ in range(150)] + [65536 + 7, 200003]
    for v in variants:
        for i, m in enumerate(lengths):
            a = edges[i % len(edges)] if i % 3 else rng.randrange(0, 300)
            yield (v, rng.randbytes(16).hex(), rng.randbytes(16).hex(),
                   rng.randbytes(a).hex() or "-", rng.randbytes(m).hex() or "-",
                   str(rng.randrange(0, m + 1)))


def test_aegis_ref(aegis_tool):
    ref_py = reference_python()
    tool = subprocess.run([aegis_tool], input="?\n", capture_output=True, text=True, check=True)
    variants = tool.stdout.split()
    if variants == ["-"]:
        pytest.skip("this CPU runs no AEGIS variant (no AES-NI): AES-256-GCM only")
    lines = [" ".join(c) for c in cases(random.Random(20261202), variants)]
    text = "\n".join(lines) + "\n"
    ours = subprocess.run([aegis_tool], input=text, capture_output=True, text=True)
    ref = subprocess.run([ref_py, "-c", REFERENCE], input=text, capture_output=True,
                         text=True)
    if ours.returncode or ref.returncode:
        pytest.fail(f"the tools did not run: {ours.stderr[-500:]} {ref.stderr[-500:]}")
    got, want = ours.stdout.splitlines(), ref.stdout.splitlines()
    bad = []
    for i, (line, g, w) in enumerate(zip(lines, got, want)):
        ct, tag, back, refused = g.split()
        v, *_, m, split = line.split()
        mlen = 0 if m == "-" else len(m) // 2
        if f"{ct} {tag}" != w:
            bad.append(f"case {i}: {NAMES[v]} of {mlen} bytes (split at {split}): "
                       "ciphertext or tag differs from libaegis")
        elif back != "1" or refused != "1":
            bad.append(f"case {i}: {NAMES[v]} of {mlen} bytes: opened back {back}, "
                       f"flipped tag refused and zeroed {refused}")
    n = len(lines)
    print(f"# {n} cases ({', '.join(NAMES[v] for v in variants)}), "
          f"{len(bad)} mismatches")
    ok = len(got) == len(want) == n and not bad
    print(f"{'ok' if ok else 'not ok'} 1 - kvblend's AEGIS equals libaegis (aeg 0.9.0) on "
          f"{n} random cases, opens back, refuses a flipped tag")
    for b in bad[:10]:
        print(f"# {b}")
    assert ok, f"{len(bad)} of {n} cases differ: " + "; ".join(bad[:10])
