"""Check model.py and tokenizer.py against llama.cpp (llama-cpp-python) on the same GGUF.

llama.cpp computes with the Q4_1/Q8_0 weights directly (quantizing activations
for its dot products); model.py dequantizes to float32 once. Small differences
are expected. Prints, per prompt: token ids equal?, max |logit diff| at the last
token, top-1 agreement, KL(llama.cpp || numpy), and greedy continuations of both.
Writes eval/reference.json, the values test_eval.py checks against.

    pip install llama-cpp-python   # builds llama.cpp; ~25 min on 2 cores
    python eval/compare_llamacpp.py
"""

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cacheblend import kl_top1
from model import Model, locate_gguf
from tokenizer import SmolTokenizer

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
]
GREEDY = 16
TOKENIZER_TEXTS = [
    "Hello world! It's 2024-05-16, 3.14159 and 1000000 tokens; don't   stop.\n\n\tTabs",
    (Path("/usr/share/common-licenses/GPL-3")).read_text()[:4000],
]


def main():
    from llama_cpp import Llama

    path = locate_gguf()
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    model = Model.load(path)
    tok = SmolTokenizer(model.reader)

    def cpp_tokens(text):
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    for text in TOKENIZER_TEXTS:
        a, b = tok.encode(text), cpp_tokens(text)
        print(f"tokenizer: {len(a)} tokens, equal to llama.cpp: {a == b}")

    def cpp_logits(ids, rows="last"):
        llm.reset()
        llm.eval(ids)
        s = np.array(llm.scores[:len(ids)], dtype=np.float32)
        return s[-1] if rows == "last" else s

    def cpp_greedy(ids, n):
        out = []
        for _ in range(n):
            t = int(np.argmax(cpp_logits(list(ids) + out)))
            out.append(t)
            if t == tok.eos:
                break
        return out

    ref = []
    for p in PROMPTS:
        ids = tok.encode(tok.chat(p))
        same_ids = ids == cpp_tokens(tok.chat(p))
        ours = model.prefill(ids, logits_for="last")[0][0]
        theirs = cpp_logits(ids)
        kl, top1 = kl_top1(theirs[None], ours[None])
        kl_all, top1_all = kl_top1(cpp_logits(ids, "all"), model.prefill(ids)[0])
        g_ours = model.generate(ids, GREEDY, stop=(tok.eos,))
        g_cpp = cpp_greedy(ids, GREEDY)
        n_same = next((i for i, (x, y) in enumerate(zip(g_ours, g_cpp)) if x != y),
                      min(len(g_ours), len(g_cpp)))
        print(f"\nprompt {p!r}: ids equal {same_ids}, {len(ids)} tokens")
        print(f"  last-token logits: max|diff| {np.abs(ours - theirs).max():.4f}, "
              f"top-1 agree {bool(top1[0])}, KL {kl[0]:.2e} nats")
        print(f"  all {len(ids)} positions: mean KL {kl_all.mean():.2e}, max KL {kl_all.max():.2e}, "
              f"top-1 agree {top1_all.mean():.1%}")
        print(f"  greedy: {len(g_ours)} and {len(g_cpp)} tokens, first {n_same} equal")
        print(f"  numpy:     {tok.decode(g_ours)!r}\n  llama.cpp: {tok.decode(g_cpp)!r}")
        top = np.argsort(-theirs)[:5]
        ref.append(dict(prompt=p, ids=ids, top_ids=top.tolist(),
                        llamacpp_top_logits=theirs[top].tolist(),
                        numpy_top_logits=ours[top].tolist(),
                        max_abs_diff=float(np.abs(ours - theirs).max()), kl=float(kl[0]),
                        kl_all_mean=float(kl_all.mean()), top1_all=float(top1_all.mean()),
                        llamacpp_greedy=g_cpp, numpy_greedy=g_ours))
    (HERE / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"\nwrote {HERE / 'reference.json'}")


if __name__ == "__main__":
    main()
