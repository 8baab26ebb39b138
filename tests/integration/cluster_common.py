"""What the cluster tests share: chunks written and read back through the kvblend CLI,
and the fuse comparison between two members. `cli(node, *args, ok=True)` is the
test's own CLI runner; `tmp` its scratch directory."""

import numpy as np

L, H, D = 4, 2, 16  # the test model "cm": 4 layers, 2 KV heads, head_dim 16, f16


def stop_all(daemons, check):
    """SIGCONT and SIGTERM every daemon (kvbtest.Daemon) still running; each must exit 0
    within 30 s."""
    for n, d in daemons.items():
        if d.poll() is None:
            rc = d.stop()
            check(f"daemon {n} exits 0", rc == 0, f"status {rc}")


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
