#!/usr/bin/env python3
"""Crash safety: several clients PUT while kvblendd is killed with SIGKILL at random
moments and restarted. After every restart: the environment opens, every acknowledged
PUT is there and reads back byte for byte (checksums verified by the daemon), and no
visible chunk lacks a layer.

usage: python3 -m pytest tests/crash/crash_test.py --kvblendd KVBLENDD --crash-put CRASH_PUT
       [--kills N] [--clients N] [--seed S] [--no-sync]
"""
import argparse
import os
import random
import signal
import subprocess
import tempfile
import time

import kvbtest


def test_crash(kvblendd, crash_put, pytestconfig):
    a = argparse.Namespace(kvblendd=kvblendd, crash_put=crash_put,
                           **{k: pytestconfig.getoption(k)
                              for k in ("kills", "clients", "seed", "no_sync")})
    rng = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix="kvb-crash-")
    daemon = kvbtest.Daemon(a.kvblendd, None, tmp, "--map-size", "16G", "--log-level", "warn",
                            *(["--no-sync"] if a.no_sync else []))
    ep = daemon.ep

    def wait_ready(timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            r = subprocess.run([a.crash_put, "scan", ep], capture_output=True, text=True,
                               timeout=60)
            if r.returncode in (0, 1):
                return r
            time.sleep(0.1)
        return None

    failures = 0
    daemon.start(wait=False)
    clients = [subprocess.Popen([a.crash_put, "put", ep, str(s + 1), f"{tmp}/acks{s}"])
               for s in range(a.clients)]
    total = 0
    try:
        for k in range(a.kills):
            time.sleep(rng.uniform(0.2, 1.0))
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
            daemon.start(wait=False)
            # Hold the clients while checking, so every kill lands under load and the set to
            # check grows with the kills, not with the time the checks take.
            for c in clients:
                c.send_signal(signal.SIGSTOP)
            r = wait_ready()
            if r is None:
                print(f"not ok - kill {k + 1}: the restarted daemon did not answer")
                failures += 1
                break
            ok = r.returncode == 0
            lines = [r.stdout.strip() + (" " + r.stderr.strip()[:500] if r.returncode else "")]
            for s in range(a.clients):
                if not os.path.exists(f"{tmp}/acks{s}"):
                    continue
                v = subprocess.run([a.crash_put, "verify", ep, str(s + 1), f"{tmp}/acks{s}"],
                                   capture_output=True, text=True, timeout=120)
                ok = ok and v.returncode == 0
                lines.append(v.stdout.strip() + (" " + v.stderr.strip() if v.returncode else ""))
            acked = sum(int(l.split()[0]) for l in lines[1:] if l and l[0].isdigit())
            total = acked
            print(f"{'ok' if ok else 'not ok'} - kill {k + 1}: " + "; ".join(lines), flush=True)
            failures += not ok
            for c in clients:
                c.send_signal(signal.SIGCONT)
    finally:
        for c in clients:
            c.send_signal(signal.SIGCONT)
            c.send_signal(signal.SIGTERM)
        for c in clients:
            c.wait(30)
        rc = daemon.stop(60)
        if rc != 0:
            print(f"not ok - daemon exit status {rc}")
            failures += 1
        if failures:
            print(daemon.log_text()[-2000:])
        kvbtest.remove(tmp)
    print(f"{a.kills} kills, {total} acknowledged PUTs verified after the last one")
    print(f"{a.kills - failures} passed, {failures} failed")
    assert not failures, f"{failures} failed"
