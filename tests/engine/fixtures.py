"""What the engine tests share: a real kvblendd, the package installed as vLLM sees it, the
blend tests' prompt, the NumPy reference twin of a model, and reading a load dump.

The daemon harness lives in eval/harness.py (Daemon, cluster, Group, ...) and the package
install in eval/engine_setup.py, so that eval/ and bench/ share them without importing a
test file; tests import eval/, never the reverse, and no test file imports another: what
two tests share lives here.
"""

import argparse
import os
import sys
from pathlib import Path

_EVAL = str(Path(__file__).resolve().parents[2] / "eval")
if _EVAL not in sys.path:
    sys.path.append(_EVAL)

from engine_setup import install_package  # noqa: E402
from harness import (  # noqa: E402
    Daemon,
    Group,
    cluster,
    free_port,
    kvblendd_path,
    wait_for_daemon,
)

__all__ = ["DOCS", "QUESTION", "Checks", "Daemon", "Group", "build_segments", "chunk_segments",
           "cluster", "fail", "free_port", "install", "install_package", "kvblendd_path",
           "model_args", "numpy_twin", "read_cache", "store_chunks", "wait_for_daemon"]


class Checks:
    """A test's named checks, called as ``check(what, ok, detail)``: each printed as it is
    made (``ok   what`` or ``FAIL what: detail``), the failed ones kept for ``verdict``."""

    def __init__(self, name):
        self.name = name
        self.failures = []

    def __call__(self, what, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""),
              flush=True)
        if not ok:
            self.failures.append(what)

    def verdict(self):
        """Print the test's line (passed, or the failed checks); the exit status, 0 or 1."""
        failed = self.failures
        print(f"{self.name}: " + ("FAILED: " + "; ".join(failed) if failed else "passed"))
        return 1 if failed else 0


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
    the metadata) and the tests' modules from here, after the folders ``first``; so does
    this process (its kvblend modules imported from elsewhere are dropped). vLLM's CPU
    settings for these tests are set unless given, and the worker's load dumps go to
    ``<folder>/dump``. Returns the folder (the caller removes it).
    """
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    site = tmp / "site"
    install(site)
    here = str(Path(__file__).resolve().parent)
    paths = [str(p) for p in first] + [str(site), here]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    sys.path[:0] = [p for p in paths if p != here]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    (tmp / "dump").mkdir()
    os.environ["KVBLEND_VLLM_DUMP_DIR"] = str(tmp / "dump")
    return tmp
