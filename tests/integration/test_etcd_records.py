#!/usr/bin/env python3
"""Hostile etcd member records against real kvblendd daemons (issue 19, defect 2).

Anyone who may write under the cluster's etcd prefix can write any value there. A
record whose endpoint or key was JSON null made every daemon watching the prefix
dereference NULL, and again at every restart while the record stayed. Here a real
etcd and two real daemons: malformed records (the documented ones, then a seeded
batch of mutations of a good record) are written while the daemons watch, and again
before a daemon starts. Every daemon keeps serving, lists none of the bad members,
and still learns a good record written after them.

usage: python3 -m pytest tests/integration/test_etcd_records.py
       --kvblendd KVBLENDD --kvblend KVBLEND
"""
import base64
import json
import os
import random
import subprocess
import tempfile
import urllib.request

import kvbtest


def test_etcd_records(kvblendd, kvblend):
    TMP = tempfile.mkdtemp(prefix="kvb-etcdrec-")
    ETCD = kvbtest.Etcd(TMP, "kvbrec")
    ETCD_URL = ETCD.url
    PREFIX = "/kvblend/t/members/"
    NODES = {n: kvbtest.free_port() for n in "ab"}
    check = kvbtest.Checks()

    def etcd_put(key, value: bytes):
        body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                           "value": base64.b64encode(value).decode()}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{ETCD_URL}/v3/kv/put", data=body),
                               timeout=5).read()

    def etcd_delete(key):
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{ETCD_URL}/v3/kv/deleterange", data=body),
                               timeout=5).read()

    def keygen():
        out = subprocess.run([kvblend, "keygen"], capture_output=True, text=True, check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines())

    KEYS = {n: keygen() for n in NODES}
    for n in NODES:
        with open(f"{TMP}/{n}.key", "w") as f:
            f.write(KEYS[n]["secret"] + "\n")
    daemons = {
        n: kvbtest.Daemon(kvblendd, kvblend, TMP, "--map-size", "256M", "--node-id", n,
                          "--cluster-etcd", ETCD_URL, "--cluster-name", "t",
                          "--cluster-lease-ttl", "3", "--cluster-timeout-ms", "500",
                          "--curve-secret-key-file", f"{TMP}/{n}.key", "--log-level", "debug",
                          name=n, listen=f"ipc://{TMP}/{n}.sock,tcp://127.0.0.1:{NODES[n]}",
                          timeout_ms=5000)
        for n in NODES
    }

    def cli(n, *args):
        return daemons[n].cli(*args)

    def members(n):
        r = cli(n, "cluster", "status", "--json")
        if r.returncode != 0:
            return None
        # (members that left stay listed as "gone" for the pushes they are owed; n lists
        # itself too)
        return {m["id"] for m in json.loads(r.stdout).get("members", [])
                if m["state"] != "gone" and m["id"] != n}

    def alive(n):
        return daemons[n].poll() is None and cli(n, "ping").returncode == 0

    wait_for = kvbtest.wait_for

    GOOD = {"id": "x", "endpoint": "tcp://127.0.0.1:1", "curve_public_key": KEYS["a"]["public"],
            "capacity": 1 << 30, "version": "test"}
    BAD = {
        "null-endpoint": {**GOOD, "endpoint": None},
        "null-key": {**GOOD, "curve_public_key": None},
        "null-capacity": {**GOOD, "capacity": None},
        "number-endpoint": {**GOOD, "endpoint": 7001},
        "list-endpoint": {**GOOD, "endpoint": ["tcp://127.0.0.1:1"]},
        "object-key": {**GOOD, "curve_public_key": {"k": 1}},
        "string-capacity": {**GOOD, "capacity": "1G"},
        "float-capacity": {**GOOD, "capacity": 1.5},
        "no-endpoint": {k: v for k, v in GOOD.items() if k != "endpoint"},
    }
    RAW = {"json-null": b"null", "json-list": b"[1,2]", "truncated": b'{"endpoint":"tcp://h:1"',
           "binary": bytes(range(256)), "empty": b""}

    def mutations(seed, count):
        """Seeded mutations of a good record: fields replaced by other JSON types, removed, or
        bytes of the text flipped."""
        rng = random.Random(seed)
        values = [None, True, 0, -1, 2**70, 1.5, "", "x" * 300, [], {}, [None], {"a": None}]
        for i in range(count):
            rec = dict(GOOD)
            kind = rng.randrange(3)
            if kind == 0:
                rec[rng.choice(list(GOOD))] = rng.choice(values)
                yield f"mut{i}", json.dumps(rec).encode()
            elif kind == 1:
                del rec[rng.choice(list(GOOD))]
                yield f"mut{i}", json.dumps(rec).encode()
            else:
                text = bytearray(json.dumps(rec).encode())
                for _ in range(rng.randrange(1, 4)):
                    text[rng.randrange(len(text))] = rng.randrange(256)
                yield f"mut{i}", bytes(text)

    try:
        if not ETCD.start():
            raise RuntimeError("etcd did not start: " + ETCD.log_text()[-2000:])
        daemons["a"].start()
        daemons["b"].start()
        check("two daemons find each other through etcd",
              wait_for(lambda: members("a") == {"b"} and members("b") == {"a"}, 20),
              str((members("a"), members("b"))))

        for name, rec in BAD.items():
            etcd_put(PREFIX + name, json.dumps(rec).encode())
        for name, raw in RAW.items():
            etcd_put(PREFIX + name, raw)
        for name, raw in mutations(19, 200):
            etcd_put(PREFIX + name, raw)
        # a good record written after them: the watcher still reads, so it saw the bad ones
        etcd_put(PREFIX + "late", json.dumps({**GOOD, "id": "late"}).encode())
        check("the daemons learn the good record written after the bad ones",
              wait_for(lambda: "late" in (members("a") or set()) and
                       "late" in (members("b") or set()), 20),
              str((members("a"), members("b"))))
        check("every daemon survives the malformed records (null endpoint, null key, ...)",
              alive("a") and alive("b"),
              str({n: d.poll() for n, d in daemons.items()}))
        bad_ids = set(BAD) | set(RAW)
        listed = (members("a") or set()) & bad_ids
        check("no malformed record becomes a member", not listed, str(listed))
        log = daemons["a"].log_text()
        check("each malformed record is logged with the reason",
              "member 'null-endpoint' in etcd: bad record (\"endpoint\" is null, not a string)"
              in log and "member 'null-key' in etcd: bad record (\"curve_public_key\" is null, "
              "not a string)" in log,
              log[-3000:])

        # a restart with the records still there (it crashed at every start before)
        rc = daemons["b"].stop()
        check("a daemon stops cleanly", rc == 0, str(rc))
        daemons["b"].start()
        check("a daemon starts and serves with the malformed records in etcd",
              wait_for(lambda: alive("b") and "a" in (members("b") or set()), 20),
              daemons["b"].log_text()[-3000:])
        etcd_delete(PREFIX + "late")
        check("a deleted good record leaves the members",
              wait_for(lambda: "late" not in (members("a") or {"late"}), 20), str(members("a")))
    finally:
        status = {n: d.stop() if d.proc else 0 for n, d in daemons.items()}
        ETCD.stop()

    for n, rc in status.items():
        check(f"daemon {n} exits cleanly (no sanitizer finding)", rc == 0,
              f"exit {rc}: " + daemons[n].log_text()[-2000:])
    if check.failed:
        print(f"logs in {TMP}")
    else:
        kvbtest.remove(TMP)
    check.done()
