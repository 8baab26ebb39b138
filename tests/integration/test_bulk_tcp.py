#!/usr/bin/env python3
"""Bulk connections (docs/protocol.md#bulk-connections) through the real daemon and CLI,
over real TCP sockets: a GET over CURVE takes its payload on a sealed bulk connection and
reads back byte-exact; a TCP proxy between the client and the daemon that flips one bit
of a record, of a record's header, or cuts the stream, gets the GET refused with the
problem named and no output file written, and the daemon serves the next GET; a replayed
hello is refused; a GET of a head range (heads 1..2 of 4) comes the same way, those heads
byte-exact; a client with bulk connections off and a daemon without them (an older
peer's behaviour) keep working with CURVE alone. The cipher: the fastest this CPU runs
(AEGIS-128X2, AEGIS-128L, else AES-256-GCM) by default, each one a client names with
KVBLEND_BULK_CIPHER, and AES-256-GCM always from a daemon with tcp_bulk_aegis = false;
a flipped bit is caught under each, and the error names the cipher.

PUT payloads go the other way on the same connection: a PUT over CURVE sends its
payload in sealed records and reads back byte-exact; a proxy that flips a bit of the
client's record bytes, tag or header, or cuts its stream, gets the PUT refused with the
problem named, nothing stored, and the daemon serves the next PUT. A chunk of exactly
max_message goes through the bulk connection as it would in frames.

usage: python3 -m pytest tests/integration/test_bulk_tcp.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import kvbtest
from tcpproxy import Proxy


def test_bulk_tcp(kvblendd, kvblend):
    tmp = tempfile.mkdtemp(prefix="kvb-bulk-")
    check = kvbtest.Checks()
    HDR = 40  # a record's header (proto/bulk.h)
    TAG = 16
    ACK = 1  # the daemon's answer to the hello, first on the stream
    SEAL = 512 << 10  # bytes of a sealed record (proto/bulk.h KVBB_SEAL_BYTES)

    def keygen():
        out = subprocess.run([kvblend, "keygen"], capture_output=True, text=True, check=True).stdout
        d = dict(line.split(" ", 1) for line in out.splitlines())
        return d["public"], d["secret"]

    def flip_at(pos, skip=ACK):
        """Flip the lowest bit of the stream's byte pos (after its first skip bytes)."""
        pos += skip

        def mutate(off, b):
            if off <= pos < off + len(b):
                b = bytearray(b)
                b[pos - off] ^= 1
                return bytes(b)
            return b
        return mutate

    def cut_at(pos):
        return lambda off, b: b if off + len(b) <= ACK + pos else None

    HELLO = 40  # a client's stream starts with its hello (proto/bulk.h KVBB_HELLO_LEN)

    def flip_up(pos):
        """Flip the lowest bit of byte pos of the client's records (after its hello)."""
        return flip_at(pos, HELLO)

    def cut_up(pos):
        return lambda off, b: b if off + len(b) <= HELLO + pos else b[:HELLO + pos - off] or None

    def cpu_ciphers():
        """The bulk ciphers this CPU runs, fastest first (proto/aegis.c's checks)."""
        flags = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        out = []
        if {"aes", "vaes", "avx2"} <= flags:
            out.append("AEGIS-128X2")
        if "aes" in flags:
            out.append("AEGIS-128L")
        return out + ["AES-256-GCM"]

    CIPHERS = cpu_ciphers()
    CIPHER = CIPHERS[0]  # what a client and the daemon on this machine agree on

    srv_pub, srv_sec = keygen()
    cli_pub, cli_sec = keygen()
    open(f"{tmp}/server.key", "w").write(f"{srv_sec}\n")
    open(f"{tmp}/clients", "w").write(f"{cli_pub} node-1\n")
    port, bulk_port = kvbtest.free_port(), kvbtest.free_port()
    keys = {"KVBLEND_SERVER_KEY": srv_pub, "KVBLEND_CLIENT_KEY": cli_sec}
    curve_flags = ("--curve-secret-key-file", f"{tmp}/server.key", "--curve-authorized-keys",
                   f"{tmp}/clients", "--map-size", "1G")

    # a chunk of 4 MiB: 8 sealed records
    layers, heads, dim, tokens = 4, 4, 64, 1024
    rng = np.random.default_rng(20)
    kv = rng.standard_normal((layers, 2, tokens, heads, dim)).astype(np.float16)
    np.save(f"{tmp}/kv.npy", kv)
    HASH = "ab" * 32

    def get(ep, name, env=None):
        out = f"{tmp}/{name}.npy"
        r = kvbtest.cli(kvblend, ep, "get", "--model", "m", "--hash", HASH, "--out", out,
                        timeout_ms=5000, env={**keys, **(env or {})}, hang_s=60)
        same = r.returncode == 0 and os.path.exists(out) and np.array_equal(np.load(out), kv)
        return r, same, os.path.exists(out)

    def tampered(mutate, env=None):
        """A GET through proxies, the bulk one mutating the daemon's bytes: (result, wrote)."""
        pz, pb = Proxy(port), Proxy(bulk_port, mutate)
        try:
            r, _, wrote = get(f"tcp://127.0.0.2:{port}", "tampered", env)
        finally:
            pz.close()
            pb.close()
        return r, wrote

    def put(ep, h, env=None, path=None):
        return kvbtest.cli(kvblend, ep, "put", "--model", "m", "--kv", path or f"{tmp}/kv.npy",
                           "--hash", h, timeout_ms=5000, env={**keys, **(env or {})}, hang_s=60)

    def stored(ep, h):
        out = f"{tmp}/stored.npy"
        if os.path.exists(out):
            os.remove(out)
        r = kvbtest.cli(kvblend, ep, "get", "--model", "m", "--hash", h, "--out", out,
                        timeout_ms=5000, env=keys, hang_s=60)
        return r.returncode == 0 and np.array_equal(np.load(out), kv)

    def bulk_answer(first):
        """The bulk port's answer to a connection that opens with the bytes first: its one-byte
        ack, or b"" when it closes (or resets) the connection instead."""
        s = socket.create_connection(("127.0.0.1", bulk_port), timeout=5)
        s.sendall(first)
        try:
            return s.recv(1)
        except OSError:
            return b""
        finally:
            s.close()

    def stat(d, name):
        r = d.cli("stats", "--json")
        import json
        return json.loads(r.stdout).get(name, 0) if r.returncode == 0 else None

    d = kvbtest.Daemon(kvblendd, kvblend, tmp, "--tcp-bulk-port", str(bulk_port), *curve_flags,
                       listen=f"ipc://{tmp}/kvblend.sock,tcp://127.0.0.1:{port}", timeout_ms=3000,
                       hang_s=60)
    d.start()
    try:
        r = d.cli("model", "add", "m", "--layers", str(layers), "--kv-heads", str(heads),
                  "--head-dim", str(dim), "--dtype", "f16", "--rope-theta", "10000")
        check("model registered", r.returncode == 0, r.stderr)
        r = d.cli("put", "--model", "m", "--kv", f"{tmp}/kv.npy", "--hash", HASH)
        check("chunk put over IPC", r.returncode == 0, r.stderr)
        direct = f"tcp://127.0.0.1:{port}"

        r, same, _ = get(direct, "direct")
        check("GET over CURVE TCP with a bulk connection: byte-exact", same, r.stderr)
        check("its payload came in sealed records", stat(d, "bulk_records_sealed") >= 8,
              str(stat(d, "bulk_records_sealed")))
        sealed0 = stat(d, "bulk_records_sealed")

        r, same, _ = get(direct, "nobulk", {"KVBLEND_NO_BULK": "1"})
        check("a client without bulk connections (CURVE frames): byte-exact", same, r.stderr)
        check("... and no record was sent for it", stat(d, "bulk_records_sealed") == sealed0)

        cases = [
            ("a flipped bit in a record's bytes", flip_at(HDR + 1000), f"{CIPHER} check"),
            ("a flipped bit in the third record's bytes", flip_at(2 * (HDR + SEAL + TAG) + HDR + 5),
             f"{CIPHER} check"),
            ("a flipped bit in its tag", flip_at(HDR + SEAL + 3), f"{CIPHER} check"),
            # the request id's low byte: the record names another request
            ("a flipped bit in a record header's request id", flip_at(HDR + SEAL + TAG + 8),
             "out of order"),
            # the reserved word of the second header: not a record header
            ("a flipped bit in a record header's reserved word",
             flip_at(HDR + SEAL + TAG + 36), "malformed record header"),
            # the offset's high byte: the record claims another place in the payload
            ("a flipped bit in a record header's offset", flip_at(HDR + SEAL + TAG + 31),
             "out of order"),
            ("the stream cut mid-record", cut_at(3 * (HDR + SEAL + TAG) + 100), "mid-payload"),
        ]
        for what, mutate, words in cases:
            r, wrote = tampered(mutate)
            check(f"{what}: GET refused naming it", r.returncode == 1 and words in r.stderr,
                  r.stderr)
            check(f"{what}: no output written", not wrote)
            r, same, _ = get(direct, "after")
            check(f"{what}: the daemon serves the next GET byte-exact", same, r.stderr)

        # PUT over CURVE TCP: the payload in sealed records from the client
        opened0, in0 = stat(d, "bulk_records_opened"), stat(d, "bulk_bytes_received")
        r = put(direct, "c1" * 32)
        check("PUT over CURVE TCP with a bulk connection", r.returncode == 0, r.stderr)
        check("... its payload came in sealed records",
              stat(d, "bulk_records_opened") >= opened0 + 8 and
              stat(d, "bulk_bytes_received") >= in0 + kv.nbytes,
              f"{stat(d, 'bulk_records_opened')} {stat(d, 'bulk_bytes_received')}")
        check("... and reads back byte-exact", stored(direct, "c1" * 32))
        in0 = stat(d, "bulk_bytes_received")
        r = put(direct, "c2" * 32, {"KVBLEND_NO_BULK": "1"})
        check("PUT without bulk connections (CURVE frames)", r.returncode == 0, r.stderr)
        check("... no bulk bytes for it, and byte-exact",
              stat(d, "bulk_bytes_received") == in0 and stored(direct, "c2" * 32))
        REC = HDR + SEAL + TAG
        put_cases = [
            ("a flipped bit in a PUT record's bytes", flip_up(HDR + 1000), f"{CIPHER} check"),
            ("a flipped bit in the fourth PUT record's bytes", flip_up(3 * REC + HDR + 9),
             f"{CIPHER} check"),
            ("a flipped bit in a PUT record's tag", flip_up(REC - 2), f"{CIPHER} check"),
            ("a flipped bit in a PUT record header's request id", flip_up(REC + 8),
             "does not follow"),
            ("a flipped bit in a PUT record header's total", flip_up(REC + 16), "does not follow"),
            ("a flipped bit in a PUT record header's magic", flip_up(REC + 1), "malformed header"),
            ("the PUT's stream cut mid-record", cut_up(2 * REC + 100), "closed after"),
        ]
        # The daemon refuses the records naming the problem and stores nothing of them;
        # libkvblend then sends the PUT once more in frames (CURVE), which the proxy on the
        # bulk port cannot touch: the chunk is stored byte-exact, never the altered bytes.
        for i, (what, mutate, words) in enumerate(put_cases):
            h = f"{0xd0 + i:02x}" * 32
            log0 = len(d.log_text())
            pz, pb = Proxy(port), Proxy(bulk_port, mutate_up=mutate)
            try:
                r = put(f"tcp://127.0.0.2:{port}", h)
            finally:
                pz.close()
                pb.close()
            logged = d.log_text()[log0:]
            check(f"{what}: the daemon refused the records naming it",
                  "bulk connection of" in logged and words in logged, logged)
            check(f"{what}: the PUT, sent again in frames, stored byte-exact",
                  r.returncode == 0 and stored(direct, h), r.stderr)

        # a PUT refused before its payload is read (an unknown model), 64 MiB on the bulk
        # connection: the daemon closes that connection, so the client's writes fail at once
        # and it reports the daemon's reason, not a timeout of its writes
        code = f"""
import time
import numpy as np
import kvblend
c = kvblend.Client({direct!r}, timeout_ms=20000, server_key={srv_pub!r},
                   client_secret_key={cli_sec!r})
big = np.ones((4, 2, 16384, 4, 64), np.float16)
t0 = time.monotonic()
try:
    c.put("nosuch", bytes.fromhex("e1" * 32), big)
    print("stored")
except kvblend.KvblendError as e:
    print(f"{{time.monotonic() - t0:.2f}}", e)
c.close()
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=kvbtest.python_env(kvblend), timeout=120)
        took = float(r.stdout.split()[0]) if r.stdout[:1].isdigit() else 99
        check("a 64 MiB PUT of an unknown model on the bulk connection: refused naming it, at "
              "once", "unknown model" in r.stdout and took < 10, r.stdout + r.stderr)
        r = put(direct, "e2" * 32)
        check("... and the next PUT goes through", r.returncode == 0 and stored(direct, "e2" * 32),
              r.stderr)

        # A PUT whose records never come (a proxy swallows them), or trickle in: the worker
        # gives up on them within 200 ms (docs/protocol.md#bulk-connections), not
        # reply_timeout_ms, so a request queued behind it waits little; the client sends
        # the PUT again in frames and it is stored.
        def swallow(off, b):  # all but the hello
            return b[:max(0, HELLO - off)]

        def trickle(off, b):
            time.sleep(0.2)
            return b
        for what, mutate, h in (("swallowed", swallow, "e3" * 32), ("trickled", trickle,
                                                                    "e4" * 32)):
            pz, pb = Proxy(port), Proxy(bulk_port, mutate_up=mutate)
            log0 = len(d.log_text())
            box = {}
            t = threading.Thread(target=lambda: box.update(r=put(f"tcp://127.0.0.2:{port}", h)))
            t0 = time.monotonic()
            t.start()
            time.sleep(0.05)
            waits = []
            for _ in range(4):
                t1 = time.monotonic()
                r2 = d.cli("lookup", "--model", "m", HASH, timeout_ms=15000)
                waits.append(time.monotonic() - t1)
            t.join(120)
            took = time.monotonic() - t0
            pz.close()
            pb.close()
            r = box.get("r")
            check(f"a PUT whose records are {what}: stored through frames, in well under "
                  f"reply_timeout_ms", r is not None and r.returncode == 0 and took < 4 and
                  stored(direct, h), f"{took:.1f} s: {r and r.stderr}")
            check(f"... the daemon named it", "fell behind" in d.log_text()[log0:],
                  d.log_text()[log0:])
            check(f"... another client meanwhile waited at most {max(waits):.2f} s",
                  r2.returncode == 0 and max(waits) < 3, f"{waits} {r2.stderr}")

        # each cipher this CPU runs, named by the client: byte-exact, and a flipped bit in
        # the second record's bytes caught by that cipher's check
        for name in CIPHERS:
            env = {"KVBLEND_BULK_CIPHER": name.lower()}
            r, same, _ = get(direct, "cipher", env)
            check(f"KVBLEND_BULK_CIPHER={name.lower()}: byte-exact", same, r.stderr)
            r, wrote = tampered(flip_at(HDR + SEAL + TAG + HDR + 77), env)
            check(f"... a flipped bit refused by its {name} check",
                  r.returncode == 1 and f"{name} check" in r.stderr and not wrote, r.stderr)

        # a hello seen on the wire, replayed on a connection of the attacker's own
        pz, pb = Proxy(port), Proxy(bulk_port)
        try:
            r, same, _ = get(f"tcp://127.0.0.2:{port}", "seen")
        finally:
            pz.close()
            pb.close()
        check("GET through an honest proxy: byte-exact", same, r.stderr)
        hello = pb.first[0][:40] if pb.first else b""
        check("the proxy saw the 40-byte hello", len(hello) == 40, repr(hello))
        ack = bulk_answer(hello)
        check("a replayed hello is refused (its ticket was used)", ack in (b"\x01", b""), repr(ack))
        ack = bulk_answer(b"\x00" * 40)
        check("garbage instead of a hello is refused", ack in (b"\x01", b""), repr(ack))
        r, same, _ = get(direct, "end")
        check("the daemon still serves", same, r.stderr)
        check("refusals logged", "bulk connection refused" in d.log_text())

        # One client across a daemon restart (Python binding over libkvblend, in a Python of
        # its own: with libasan preloaded when libkvblend is built with ASan): its bulk
        # connection dies with the daemon; the next GET still answers, and a new one opens.
        env = kvbtest.python_env(kvblend)
        child = subprocess.Popen([sys.executable, "-c", f"""
import sys
import numpy as np
import kvblend
kv = np.load({tmp + '/kv.npy'!r})
c = kvblend.Client({direct!r}, timeout_ms=5000, server_key={srv_pub!r},
                   client_secret_key={cli_sec!r})
h = bytes.fromhex({HASH!r})
print("first", np.array_equal(c.get("m", h), kv), flush=True)
sys.stdin.readline()  # the daemon restarted
try:
    print("after", np.array_equal(c.get("m", h), kv), flush=True)
except kvblend.KvblendError as e:
    print("after False", e, flush=True)
print("next", np.array_equal(c.get("m", h), kv), flush=True)
print("heads", np.array_equal(c.get("m", h, heads=(1, 2)), kv[:, :, :, 1:3]), flush=True)
h2 = bytes.fromhex("f1" * 32)
print("put", c.put("m", h2, kv) is False and np.array_equal(c.get("m", h2), kv), flush=True)
c.close()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = child.stdout.readline().strip()
        check("Python client over a sealed bulk connection: byte-exact", line == "first True", line)
        check("daemon exits 0 for a restart", d.stop() == 0)
        d.start()
        sealed0 = stat(d, "bulk_records_sealed")
        child.stdin.write("\n")
        child.stdin.flush()
        line = child.stdout.readline().strip()
        check("the first GET after the daemon restarted: byte-exact", line == "after True", line)
        line = child.stdout.readline().strip()
        check("the next GET: byte-exact, on a new sealed bulk connection",
              line == "next True" and stat(d, "bulk_records_sealed") >= sealed0 + 8,
              f"{line} {stat(d, 'bulk_records_sealed')}")
        line = child.stdout.readline().strip()
        check("a GET of heads 1..2 over the sealed bulk connection: those heads, byte-exact",
              line == "heads True", line)
        line = child.stdout.readline().strip()
        check("a PUT from Python over the sealed bulk connection reads back byte-exact",
              line == "put True" and stat(d, "bulk_records_opened") >= 8, line)
        check("that client exits 0", child.wait(60) == 0)
    finally:
        check("daemon exits 0", d.stop() == 0)

    # A daemon that allows AES-256-GCM only: a client offering AEGIS still gets AES-256-GCM.
    d3 = kvbtest.Daemon(kvblendd, kvblend, tmp, "--tcp-bulk-aegis=false", "--tcp-bulk-port",
                        str(bulk_port), *curve_flags, name="gcm", data=d.data,
                        listen=f"ipc://{tmp}/gcm.sock,tcp://127.0.0.1:{port}", timeout_ms=3000,
                        hang_s=60)
    d3.start()
    try:
        r, same, _ = get(f"tcp://127.0.0.1:{port}", "gcm")
        check("daemon with tcp_bulk_aegis = false: GET byte-exact", same, r.stderr)
        r, wrote = tampered(flip_at(HDR + 1000))
        check("... its records are AES-256-GCM (a flipped bit fails that check)",
              r.returncode == 1 and "AES-256-GCM check" in r.stderr and not wrote, r.stderr)
    finally:
        check("AES-256-GCM daemon exits 0", d3.stop() == 0)

    # A chunk of exactly max_message, with a client share of the same size: admitted over the
    # bulk connection as in frames (its records are held as part of the request, not beside it).
    d4 = kvbtest.Daemon(kvblendd, kvblend, tmp, "--tcp-bulk-port", str(bulk_port), *curve_flags,
                        "--max-message", str(kv.nbytes), "--client-inflight-bytes", str(kv.nbytes),
                        name="edge", listen=f"ipc://{tmp}/edge.sock,tcp://127.0.0.1:{port}",
                        timeout_ms=3000, hang_s=60)
    d4.start()
    try:
        d4.cli("model", "add", "m", "--layers", str(layers), "--kv-heads", str(heads),
               "--head-dim", str(dim), "--dtype", "f16", "--rope-theta", "10000", ok=True)
        r = put(f"tcp://127.0.0.1:{port}", "e1" * 32)
        check(f"a PUT of exactly max_message ({kv.nbytes} bytes) over the bulk connection",
              r.returncode == 0 and stat(d4, "bulk_records_opened") >= 8, r.stderr)
        check("... reads back byte-exact", stored(f"tcp://127.0.0.1:{port}", "e1" * 32))
    finally:
        check("max_message daemon exits 0", d4.stop() == 0)

    # A daemon without bulk connections answers HELLO as an older one does: CURVE frames.
    d2 = kvbtest.Daemon(kvblendd, kvblend, tmp, "--tcp-bulk=false", *curve_flags, name="old",
                        data=d.data, listen=f"ipc://{tmp}/old.sock,tcp://127.0.0.1:{port}",
                        timeout_ms=3000, hang_s=60)
    d2.start()
    try:
        r, same, _ = get(f"tcp://127.0.0.1:{port}", "old")
        check("daemon with tcp_bulk = false: GET over CURVE frames, byte-exact", same, r.stderr)
        check("... no bulk stats", stat(d2, "bulk_bytes") == 0)
    finally:
        check("second daemon exits 0", d2.stop() == 0)
    kvbtest.remove(tmp)
    check.done()
