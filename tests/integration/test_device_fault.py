#!/usr/bin/env python3
"""A device error inside a fuse session: the real kvblendd on the emulated device
(--device emulated: the device path of daemon/fuse.c on host memory), made to fail
its Nth device call (KVBLEND_EMULATED_FAIL_AFTER), as a CUDA error would. The
request that meets it fails with `internal` and a message naming the device, in
the session's open, a layer's load or its compute depending on N; the daemon goes
on serving; the next session fuses bit for bit as the CPU backend does.

usage: test_device_fault.py KVBLENDD KVBLEND
"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

KVBLENDD, KVBLEND = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="kvb-devfault-")
EP = f"ipc://{TMP}/kvblend.sock"
passed = failed = 0


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print(f"ok - {name}")
    else:
        failed += 1
        print(f"not ok - {name} {detail}")


def cli(*args, ok=True):
    r = subprocess.run([KVBLEND, "--endpoint", EP, *map(str, args)], capture_output=True,
                       text=True)
    if ok and r.returncode != 0:
        raise RuntimeError(f"kvblend {' '.join(map(str, args))}: {r.stderr}")
    return r


def start(device, fail_after=0):
    env = dict(os.environ)
    if fail_after:
        env["KVBLEND_EMULATED_FAIL_AFTER"] = str(fail_after)
    d = subprocess.Popen([KVBLENDD, "--data-dir", f"{TMP}/data", "--listen", EP, "--map-size",
                          "256M", "--device", device], env=env,
                         stderr=open(f"{TMP}/kvblendd-{device}-{fail_after}.log", "w"))
    for _ in range(100):
        if cli("--timeout", "200", "ping", ok=False).returncode == 0:
            return d
        time.sleep(0.1)
    raise RuntimeError("kvblendd did not start")


def stop(d, tag):
    d.terminate()
    rc = d.wait(30)
    check(f"{tag}: daemon exits 0", rc == 0, f"status {rc}")


L, H, D = 4, 2, 16
rng = np.random.default_rng(5)
chunks = []
try:
    d = start("cpu")
    cli("model", "add", "m", "--layers", L, "--kv-heads", H, "--head-dim", D, "--dtype", "f16",
        "--rope-theta", 10000)
    for ci, T in enumerate((19, 27)):
        np.save(f"{TMP}/c{ci}.npy", rng.standard_normal((L, 2, T, H, D)).astype(np.float16))
        np.save(f"{TMP}/ids{ci}.npy", np.arange(100 * (ci + 1), 100 * (ci + 1) + T))
        chunks.append(cli("put", "--model", "m", "--kv", f"{TMP}/c{ci}.npy", "--tokens",
                          f"{TMP}/ids{ci}.npy").stdout.split()[0])
    n = 19 + 5 + 27
    np.save(f"{TMP}/new.npy", rng.standard_normal((L, 2, n, H, D)).astype(np.float16))
    FUSE = ["fuse", "--model", "m", "--chunk", f"{chunks[0]}@0", "--fresh", "5@19", "--chunk",
            f"{chunks[1]}@24", "--new", f"{TMP}/new.npy", "--ratio", "0.4,0.2",
            "--check-layers", "1,2"]

    def fuse(tag, ok=True):
        return cli(*FUSE, "--out", f"{TMP}/{tag}.npy", "--selected", f"{TMP}/{tag}-sel.npy",
                   ok=ok)

    fuse("cpu")
    want, want_sel = np.load(f"{TMP}/cpu.npy"), np.load(f"{TMP}/cpu-sel.npy")
    stop(d, "cpu")

    # A session of 4 layers, 2 chunks and checks at 1 and 2 makes some 45 device calls:
    # these fail in its open (1, 3), in a layer's load (7, 10: the load that a prefetch
    # began is taken up again by the layer's request, which then may succeed) and in a
    # layer's compute.
    visible = 0
    for fa in (1, 3, 7, 10, 16, 25, 33, 40):
        d = start("emulated", fa)
        r = fuse(f"fail{fa}", ok=False)
        same = r.returncode == 0 and np.array_equal(np.load(f"{TMP}/fail{fa}.npy"), want) and \
            np.array_equal(np.load(f"{TMP}/fail{fa}-sel.npy"), want_sel)
        named = r.returncode != 0 and "emulated device failed" in r.stderr and \
            "internal" in r.stderr.lower()
        visible += named
        check(f"failure at device call {fa}: the fuse fails naming the device, or recovers "
              "exactly", named or same, r.stderr.strip())
        check(f"failure at device call {fa}: the daemon still answers",
              cli("ping", ok=False).returncode == 0)
        r = fuse(f"after{fa}", ok=False)
        check(f"failure at device call {fa}: the next session fuses as the CPU does",
              r.returncode == 0 and np.array_equal(np.load(f"{TMP}/after{fa}.npy"), want) and
              np.array_equal(np.load(f"{TMP}/after{fa}-sel.npy"), want_sel), r.stderr.strip())
        stop(d, f"failure at device call {fa}")
    check("most injected failures reach the client", visible >= 5, f"{visible} of 8")
finally:
    if failed:
        for f in sorted(os.listdir(TMP)):
            if f.endswith(".log"):
                print(f"--- {f}\n" + open(f"{TMP}/{f}").read()[-1500:])
    subprocess.run(["rm", "-rf", TMP])
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
