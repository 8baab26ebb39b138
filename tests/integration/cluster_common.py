"""What the cluster tests share: the CLI of a member on its IPC socket, chunks written
and read back through the kvblend CLI, where chunks belong and whether they are there,
and the fuse comparison between two members.
`cli(node, *args, ok=True)` is the test's own CLI runner; `tmp` its scratch directory."""

import json
import subprocess

import numpy as np

import kvbtest

L, H, D = 4, 2, 16  # the test model "cm": 4 layers, 2 KV heads, head_dim 16, f16


class MemberCli:
    """The kvblend CLI of members that listen on ipc://TMP/<n>.sock: ``cli(n, *args, ok=True)``
    runs it (kvbtest.cli, 20 s a call, an empty environment); ``cli.stats(n)`` is n's
    counters as `kvblend stats --json` prints them."""

    def __init__(self, kvblend, tmp):
        self.kvblend, self.tmp = kvblend, tmp

    def __call__(self, n, *args, ok=True):
        return kvbtest.cli(self.kvblend, f"ipc://{self.tmp}/{n}.sock", *args, timeout_ms=20000,
                           ok=ok, env={}, label=f"kvblend@{n}")

    def stats(self, n):
        return json.loads(self(n, "stats", "--json").stdout)


class Placement:
    """Where the chunks of the test model belong and whether they are there: their owners
    by the daemons' own placement code (place_tool at ``replicas`` copies), what each
    member holds by its LIST (which is local)."""

    def __init__(self, cli, place_tool, replicas):
        self.cli, self.place_tool, self.replicas = cli, place_tool, replicas

    def held(self, n):
        """The chunk hashes n's own store holds (none when it does not answer)."""
        r = self.cli(n, "ls", "--model", "cm", "--json", ok=False)
        return {c["hash"] for c in json.loads(r.stdout)} if r.returncode == 0 else set()

    def owners(self, hashes, members):
        """{hash: [owners]} among members."""
        r = subprocess.run([self.place_tool, str(self.replicas), *sorted(members)],
                           input="\n".join(hashes) + "\n", capture_output=True, text=True,
                           check=True)
        return {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines()}

    def missing(self, chunks, members):
        """(hash, owner) pairs where an owner among members lacks the chunk."""
        own = self.owners([h for h, _ in chunks], members)
        have = {m: self.held(m) for m in members}
        return [(h[:12], o) for h, _ in chunks for o in own[h] if h not in have[o]]


def stop_all(daemons, check, log_tail=0, timeout=30):
    """SIGCONT and SIGTERM every daemon (kvbtest.Daemon) started and still running; each
    must exit 0 within timeout seconds. With log_tail, when a check failed, the last
    log_tail characters of each daemon's log are printed."""
    for n, d in daemons.items():
        if d.proc and d.poll() is None:
            rc = d.stop(timeout=timeout)
            check(f"daemon {n} exits 0", rc == 0, f"status {rc}")
    if log_tail and check.failed:
        for n, d in daemons.items():
            print(f"--- {n}.log (tail)")
            print(d.log_text()[-log_tail:])


def add_model(cli, node):
    cli(node, "model", "add", "cm", "--layers", L, "--kv-heads", H, "--head-dim", D,
        "--dtype", "f16", "--rope-theta", 10000)


def put_chunks(cli, tmp, node, first, count, rng):
    """PUT chunks first..first+count-1 on node; returns [(hash, kv)]."""
    out = []
    for i in range(first, first + count):
        T = 5 + i % 7
        kv = rng.standard_normal((L, 2, T, H, D)).astype(np.float16)
        np.save(f"{tmp}/kv{i}.npy", kv)
        np.save(f"{tmp}/ids{i}.npy", np.arange(100 * i, 100 * i + T))
        h = cli(node, "put", "--model", "cm", "--kv", f"{tmp}/kv{i}.npy", "--tokens",
                f"{tmp}/ids{i}.npy", "--pos", i).stdout.split()[0]
        out.append((h, kv))
    return out


def readable(cli, tmp, node, chunks):
    """The chunks node cannot serve byte for byte, each with the reason."""
    bad = []
    for h, kv in chunks:
        r = cli(node, "get", "--model", "cm", "--hash", h, "--out", f"{tmp}/g.npy", ok=False)
        if r.returncode != 0 or not np.array_equal(np.load(f"{tmp}/g.npy"), kv):
            bad.append(h[:12] + (": " + r.stderr.strip() if r.returncode else ": bytes differ"))
    return bad


def fuse_equal(cli, tmp, nodes, chunks, rng):
    """Fuse the chunks (plus 3 fresh tokens) on each node; whether all give equal bytes."""
    new = rng.standard_normal((L, 2, sum(kv.shape[2] for _, kv in chunks) + 3, H, D))
    np.save(f"{tmp}/new.npy", new.astype(np.float16))
    args, pos = [], 0
    for h, kv in chunks:
        args += ["--chunk", f"{h}@{pos}"]
        pos += kv.shape[2]
    args += ["--fresh", f"3@{pos}"]
    out = []
    for n in nodes:
        cli(n, "fuse", "--model", "cm", *args, "--new", f"{tmp}/new.npy", "--ratio", "0.3",
            "--check-layers", "1", "--out", f"{tmp}/fused-{n}.npy")
        out.append(np.load(f"{tmp}/fused-{n}.npy"))
    return all(np.array_equal(out[0], o) for o in out[1:])
