#!/usr/bin/env python3
"""A device error inside a fuse session: the real kvblendd on the emulated device
(--device emulated: the device path of daemon/fuse.c on host memory), made to fail
its Nth device call (KVBLEND_EMULATED_FAIL_AFTER), as a CUDA error would. The
request that meets it fails with `internal` and a message naming the device, in
the session's open, a layer's load or its compute depending on N; the daemon goes
on serving; the next session fuses bit for bit as the CPU backend does.

Then the failure made sticky (KVBLEND_EMULATED_STICKY=1), as CUDA's illegal address
is: every later device call fails. The daemon logs it once, says so in stats
(device_failed 1), and serves every later session on the CPU path, bit for bit as
--device cpu does, instead of failing them all until a restart.

Then the device's own budget (--fuse-device-max-bytes): a session whose device
block does not fit runs on the host path, bit for bit, and stats count it
(fuse_device_fallbacks); one that fits runs on the device.

Last, the top-k scratch size query failing (KVBLEND_EMULATED_SCRATCH_FAIL=1, as
CUB's does): the session's open fails with `internal` naming the query, never
a session that answers an empty selection; the daemon goes on serving.

usage: python3 -m pytest tests/integration/test_device_fault.py
       --kvblendd KVBLENDD --kvblend KVBLEND
"""
import json
import os
import tempfile

import numpy as np

import kvbtest


def test_device_fault(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-devfault-")
    check = kvbtest.Checks()
    d = None

    def cli(*args, ok=True):
        return d.cli(*args, ok=ok)

    def start(device, fail_after=0, sticky=False, flags=(), extra_env=None):
        nonlocal d
        env = dict(os.environ)
        env.update(extra_env or {})
        if fail_after:
            env["KVBLEND_EMULATED_FAIL_AFTER"] = str(fail_after)
        if sticky:
            env["KVBLEND_EMULATED_STICKY"] = "1"
        tag = f"{device}-{fail_after}" + ("-sticky" if sticky else "")
        d = kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "256M", "--device", device,
                           *flags, log=f"{TMP}/kvblendd-{tag}{len(flags)}.log", environ=env)
        if not d.start():
            raise RuntimeError("kvblendd did not start")
        return d

    def stop(d, tag):
        rc = d.stop()
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

        def fuses_as_cpu(tag):
            """Fuse as tag: (whether it succeeded with --device cpu's layers and selection,
            its stderr)."""
            r = fuse(tag, ok=False)
            return (r.returncode == 0 and np.array_equal(np.load(f"{TMP}/{tag}.npy"), want) and
                    np.array_equal(np.load(f"{TMP}/{tag}-sel.npy"), want_sel)), r.stderr.strip()

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

        # Sticky: the failure at call fa stays; later sessions go to the CPU path.
        for fa in (1, 16, 33):
            tag = f"sticky failure at device call {fa}"
            d = start("emulated", fa, sticky=True)
            stats = json.loads(cli("stats", "--json").stdout)
            check(f"{tag}: stats say the device works before it", stats.get("device_failed") == 0,
                  str(stats.get("device_failed")))
            r = fuse(f"sticky{fa}", ok=False)
            check(f"{tag}: the session that meets it fails naming the device",
                  r.returncode != 0 and "emulated device failed" in r.stderr, r.stderr.strip())
            for i in range(2):
                ok, err = fuses_as_cpu(f"sticky{fa}-after{i}")
                check(f"{tag}: session {i + 1} after it fuses on the CPU as --device cpu does",
                      ok, err)
            stats = json.loads(cli("stats", "--json").stdout)
            check(f"{tag}: stats say the device failed", stats.get("device_failed") == 1,
                  str(stats.get("device_failed")))
            stop(d, tag)
            log = d.log_text()
            check(f"{tag}: the log says so once",
                  log.count("failed for good") == 1 and "run on the CPU" in log,
                  str(log.count("failed for good")))

        # The device budget: 4 KiB holds no session's device block; 64 MiB holds this one.
        for budget, on_device in (("4K", False), ("64M", True)):
            tag = f"fuse_device_max_bytes {budget}"
            d = start("emulated", flags=("--fuse-device-max-bytes", budget))
            for i in range(2):
                ok, err = fuses_as_cpu(f"budget{budget}-{i}")
                check(f"{tag}: session {i + 1} fuses as --device cpu does", ok, err)
            stats = json.loads(cli("stats", "--json").stdout)
            check(f"{tag}: stats count the sessions sent to the host path",
                  stats.get("fuse_device_fallbacks") == (0 if on_device else 2),
                  str(stats.get("fuse_device_fallbacks")))
            check(f"{tag}: device memory held only by sessions that ran there",
                  (stats.get("device_memory_bytes", 0) > 0) == on_device,
                  str(stats.get("device_memory_bytes")))
            stop(d, tag)

        tag = "scratch size query failing"
        d = start("emulated", extra_env={"KVBLEND_EMULATED_SCRATCH_FAIL": "1"})
        r = fuse("noscratch", ok=False)
        check(f"{tag}: the open fails with internal, naming the query",
              r.returncode != 0 and "internal" in r.stderr.lower() and
              "top-k scratch" in r.stderr and "scratch size query failed" in r.stderr,
              r.stderr.strip())
        check(f"{tag}: no selection written", not os.path.exists(f"{TMP}/noscratch-sel.npy"))
        check(f"{tag}: the daemon still answers", cli("ping", ok=False).returncode == 0)
        stats = json.loads(cli("stats", "--json").stdout)
        check(f"{tag}: no session left open", stats.get("fuse_sessions") == 0,
              str(stats.get("fuse_sessions")))
        stop(d, tag)
    finally:
        if check.failed:
            for f in sorted(os.listdir(TMP)):
                if f.endswith(".log"):
                    print(f"--- {f}\n" + open(f"{TMP}/{f}").read()[-1500:])
        kvbtest.remove(TMP)
    check.done()
