"""The Python tests' harness (tests/harness/), the one module the tests under tests/ share:

* daemons: a real kvblendd on a temporary data directory and IPC socket (eval/harness.py's
  Daemon, pinged with the kvblend CLI) and the CLI pointed at it; cluster, Group, Etcd,
  free_port (never the same port twice in a test run, across ctest's parallel processes)
  and wait_for from eval/harness.py (whose own Daemon, pinged through the Python client,
  the engine tests import from there);
* a tally of checks printed one line each and asserted at the end (Checks); a logging
  handler that keeps the messages (LogLines);
* engines (the engine tests, tests/engine/): the package installed as vLLM sees it and
  vLLM's engine with kvblend's connector (eval/engine_setup.py's), the blend tests'
  prompt, the NumPy reference twin of a model, reading a load dump.

The daemon harness lives in eval/harness.py and the package install in
eval/engine_setup.py, so that eval/ and bench/ share them without importing a test file;
tests import eval/, never the reverse, and no test file imports another: what two tests
share lives here. Only the standard library is imported at the top: the integration tests
run on Debian's python3, the engine tests in their venv.

The integration tests run under pytest (ctest: python3 -m pytest ... FILE --kvblendd ...;
tests/conftest.py has the options and fixtures; tests/pytest.ini puts this folder and eval/
on Python's path, the one place that does); tests/engine/run.sh puts them on PYTHONPATH.
"""

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from engine_setup import (  # noqa: F401  (the tests' names for them)
    connector_llm,
    connector_transfer,
    install_package,
)
from harness import (  # noqa: F401
    Etcd,
    Group,
    cluster,
    free_port,
    kvblendd_path,
    wait_for,
    wait_for_daemon,
)


class Checks:
    """A test's named checks, called as check(name, cond, detail): each printed as it is
    made (`ok - NAME`, or `not ok - NAME: DETAIL` when cond is false), and the test goes
    on. done() prints the totals and fails the test (AssertionError, the failed checks
    named) if any failed; verdict() (the engine tests, run as scripts) prints the test's
    line (`NAME: passed`, or the failed checks) and returns the exit status, 0 or 1."""

    def __init__(self, name="checks"):
        self.name = name
        self.passed = 0
        self.failures = []

    @property
    def failed(self):
        return len(self.failures)

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print(f"ok - {name}", flush=True)
        else:
            self.failures.append(name)
            print(f"not ok - {name}" + (f": {detail}" if detail else ""), flush=True)

    def done(self):
        print(f"{self.passed} passed, {self.failed} failed")
        assert not self.failures, f"{self.failed} checks failed: {'; '.join(self.failures)}"

    def verdict(self):
        failed = self.failures
        print(f"{self.name}: " + ("FAILED: " + "; ".join(failed) if failed else "passed"))
        return 1 if failed else 0


class LogLines(logging.Handler):
    """A logging handler that keeps each record's message, in order, in ``lines``."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def remove(tmp):
    """Remove a test's scratch directory, unless KVB_KEEP_TMP is set (as the C harness)."""
    if not os.environ.get("KVB_KEEP_TMP"):
        shutil.rmtree(tmp, ignore_errors=True)


def cli(kvblend, endpoint, *args, timeout_ms=None, ok=False, env=None, hang_s=None,
        label="kvblend"):
    """Run `KVBLEND --endpoint ENDPOINT [--timeout MS] ARGS...`, output captured as text.

    Returns the CompletedProcess. env None inherits this environment; a dict replaces
    every KVBLEND_* variable of it with its own. ok: raise RuntimeError (LABEL, the
    arguments and stderr) if the CLI fails. hang_s: a CLI still running after that many
    seconds is killed and returned as failed (-9), so that its check fails, not the test.
    """
    argv = [kvblend, "--endpoint", endpoint]
    if timeout_ms is not None:
        argv += ["--timeout", str(timeout_ms)]
    argv += [str(a) for a in args]
    if env is not None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}, **env}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=hang_s)
    except subprocess.TimeoutExpired as x:
        return subprocess.CompletedProcess(x.cmd, -9, "", f"kvblend hung: {x}")
    if ok and r.returncode != 0:
        raise RuntimeError(f"{label} {' '.join(map(str, args))}: {r.stderr}")
    return r


class Daemon(harness.Daemon):
    """One kvblendd (eval/harness.py's Daemon, started by start(), not at once):
    `KVBLENDD [FIRST...] --data-dir DATA --listen LISTEN FLAGS...`, pinged with the CLI.

    By default DATA is TMP/data, the endpoint ipc://TMP/kvblend.sock and the log (its
    stderr and stdout, appended) TMP/kvblendd.log; with name N they are TMP/N-data,
    ipc://TMP/N.sock and TMP/N.log. log=False discards its output. listen defaults to
    the endpoint (the CLI's); environ is its environment (None: this one's, less
    LD_PRELOAD). cli_opts are cli()'s keyword arguments for every call of self.cli(),
    its ping included. TMP stays: the test removes it (remove()).
    """

    def __init__(self, kvblendd, kvblend, tmp, *flags, name=None, data=None, listen=None,
                 log=None, environ=None, first=(), **cli_opts):
        super().__init__(*flags, kvblendd=kvblendd, dir=tmp, name=name, data=data,
                         listen=listen, log=log, environ=environ, first=first, workers=None,
                         start=False)
        self.ep = self.endpoint
        self.kvblend, self.cli_opts = kvblend, cli_opts

    def cli(self, *args, **opts):
        """The kvblend CLI on this daemon's endpoint; see cli()."""
        return cli(self.kvblend, self.ep, *args, **{**self.cli_opts, **opts})

    def ready(self):
        return self.cli("ping", ok=False, timeout_ms=200).returncode == 0

    def start(self, wait=True, seconds=30):
        """Start it; with wait, ping it with the CLI (0.1 s apart, for up to seconds)
        until it answers. Returns whether it answered (True without wait)."""
        return super().start(wait, seconds)


def python_env(kvblend):
    """The environment of a Python of its own that imports the kvblend package of this
    tree over the libkvblend built beside the kvblend CLI (with libasan preloaded when
    that library is built with ASan)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    lib = os.path.join(os.path.dirname(os.path.abspath(kvblend)), "..", "lib", "libkvblend.so")
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    asan = next((ln.split()[2] for ln in ldd.splitlines() if "libasan" in ln), "")
    env = {**os.environ, "KVBLEND_LIB": lib, "LD_PRELOAD": asan,
           "PYTHONPATH": os.path.join(root, "client", "python", "src")}
    if asan:  # (Python itself leaks by LeakSanitizer's count)
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
    return env


def python_client(kvblend, code, timeout=60):
    """Run code in such a Python (python_env); its CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=python_env(kvblend), timeout=timeout)


# ---- engines (tests/engine/) ----


def fail(msg):
    """End the test here: ``FAIL: msg``, exit status 1."""
    print(f"FAIL: {msg}")
    sys.exit(1)


def model_args(doc):
    """The command line of a test over the engine's model, described by the first line of
    ``doc``: ``--model`` (default $KVBLEND_ENGINE_MODEL, as tests/engine/run.sh sets it);
    without one the test fails."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVBLEND_ENGINE_MODEL"))
    args = ap.parse_args()
    if not args.model:
        fail("no model: --model or KVBLEND_ENGINE_MODEL")
    return args


# The blend tests' prompt (test_hf_blend, test_vllm_blend, test_vllm_arch,
# test_vllm_model_hook): three documents between fresh text, then the question.
DOCS = [
    "The river delta is formed where a river meets a slower body of water and drops the "
    "sediment it carries. Over centuries the deposits build new land, split the river into "
    "many channels and create wetlands that shelter birds, fish and plants. Large deltas "
    "such as the Nile, the Ganges and the Mississippi feed millions of people.",
    "A lighthouse is a tower with a bright lamp at the top that guides ships at night. The "
    "first lighthouses burned wood or coal; later ones used oil lamps and curved mirrors, "
    "and from the nineteenth century on Fresnel lenses focused the light into a beam that "
    "could be seen more than thirty kilometres out at sea.",
    "Honey bees live in colonies of tens of thousands of workers and one queen. Workers "
    "collect nectar and pollen, build wax combs, care for the young and defend the hive. "
    "When a forager finds flowers she returns and performs a waggle dance whose angle and "
    "length tell her sisters the direction and distance of the food.",
]
QUESTION = "Which document explains how bees share where the flowers are, and how?"


def build_segments(tok):
    """The blend tests' prompt as [("fresh"|"chunk", ids)], tokenized by ``tok``."""
    head = tok.encode("<|im_start|>system\nAnswer using the documents.<|im_end|>\n"
                      "<|im_start|>user\nDocument 1:\n")
    segs = [("fresh", head)]
    for i, d in enumerate(DOCS):
        segs.append(("chunk", tok.encode(d)))
        tail = (f"\n\nDocument {i + 2}:\n" if i + 1 < len(DOCS) else
                f"\n\nQuestion: {QUESTION}<|im_end|>\n<|im_start|>assistant\n")
        segs.append(("fresh", tok.encode(tail)))
    return segs


def chunk_segments(segs):
    """The chunks of a prompt [("fresh"|"chunk", ids)] as the connector's request parameter
    ``segments`` (``[start, length, "chunk"]`` each), and the prompt's length in tokens."""
    chunks, n = [], 0
    for kind, t in segs:
        if kind == "chunk":
            chunks.append([n, len(t), "chunk"])
        n += len(t)
    return chunks, n


def store_chunks(blender, segs):
    """Store the chunks of a prompt [("fresh"|"chunk", ids)] through kvblend.hf's
    ``blender``; their hashes."""
    return [blender.store(t) for kind, t in segs if kind == "chunk"]


def numpy_twin(model):
    """eval/model.py's NumPy Model holding a HF Llama-family model's weights (neox layout)."""
    from kvblend import describe
    from model import Config
    from model import Model as NumpyModel

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    t = {"token_embd.weight": sd["model.embed_tokens.weight"],
         "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for layer in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            t[f"blk.{layer}.{ours}.weight"] = sd[f"model.layers.{layer}.{theirs}.weight"]
    cfg = Config(n_layers=c.num_hidden_layers, dim=c.hidden_size, n_heads=c.num_attention_heads,
                 n_kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                 ffn_dim=c.intermediate_size, vocab=c.vocab_size,
                 rope_theta=describe.rope_theta(c), rms_eps=float(c.rms_norm_eps), rope_style="neox")
    return NumpyModel(cfg, t, None)


def worst_dev(got, want):
    """Largest |got - want| over each layer's K and V [layers, 2, ...], relative to want's
    largest |value| in that layer and plane."""
    import numpy as np

    return max(float(np.abs(got[la, p] - want[la, p]).max() / np.abs(want[la, p]).max())
               for la in range(want.shape[0]) for p in range(2))


def read_cache(dump, n):
    """K and V [layers, 2, n, kv_heads, head_dim] of prompt rows 0..n-1 from a load dump
    (vLLM's CPU "vec" blocks: per block and head, K transposed, then V)."""
    import numpy as np

    raw, blocks = dump["raw"], list(dump["blocks"])
    table, bs = list(dump["block_ids"]), int(dump["block_size"])
    L, B, H = raw.shape[0], raw.shape[1], raw.shape[2]
    a = raw.reshape(L, B, H, 2, -1)
    hd = a.shape[-1] // bs
    k = a[:, :, :, 0].reshape(L, B, H, hd, bs).swapaxes(-1, -2)  # K stored transposed
    v = a[:, :, :, 1].reshape(L, B, H, bs, hd)
    out = np.empty((L, 2, n, H, hd), raw.dtype)  # (bfloat16: its raw bits, uint16)
    for t in range(n):
        j = blocks.index(table[t // bs])
        out[:, 0, t], out[:, 1, t] = k[:, j, :, t % bs], v[:, j, :, t % bs]
    return out


def install_temp(prefix):
    """Install the package (install_package) into ``site`` of a new temporary folder named
    ``prefix``...: the folder (the caller removes it) and site; a failure ends the test."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    site = Path(tmp) / "site"
    try:
        install_package(site)
    except RuntimeError as e:
        fail(f"installing client/python: {e}")
    return tmp, site


def install(target):
    """pip install the package into ``target`` with its entry point (the tests' step (a));
    a failure ends the test (exit 1)."""
    try:
        install_package(target)
    except RuntimeError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
    print("  (a) installed; entry point vllm.general_plugins: kvblend = "
          "kvblend.vllm.plugin:register")


def engine_env(prefix, first=()):
    """Install the package into a temporary folder for an engine this process starts.

    The engine's processes import kvblend from the installed copy (its entry point needs
    the metadata) and the tests' modules from tests/engine/, this folder and eval/, after
    the folders ``first``; so does this process (its kvblend modules imported from elsewhere are dropped). vLLM's CPU
    settings for these tests are set unless given, and the worker's load dumps go to
    ``<folder>/dump``. Returns the folder (the caller removes it).
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    site = tmp / "site"
    install(site)
    here = str(Path(__file__).resolve().parent)
    engine = str(Path(__file__).resolve().parents[1] / "engine")
    evals = str(Path(__file__).resolve().parents[2] / "eval")
    paths = [str(p) for p in first] + [str(site), engine, here, evals]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    (tmp / "dump").mkdir()
    os.environ["KVBLEND_VLLM_DUMP_DIR"] = str(tmp / "dump")
    return tmp
