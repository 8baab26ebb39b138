"""CacheBlend's quality on SmolLM2-135M-Instruct, all in NumPy, no daemon.

Reads top to bottom: load the model, build RAG requests from real text, run
each mode, print the table.

Text: the license texts Debian ships in /usr/share/common-licenses (package
base-files), nine documents nobody in this project wrote. A request is the
chat template around an instruction, three 192-token chunks from three
different documents, and a question; the answer is the full prefill's own
greedy answer (up to 32 tokens), teacher-forced in every mode. Per answer
position we compare the next-token distribution of each mode with the full
prefill's: KL(full || mode) in nats and top-1 agreement.

    python eval/run_numpy.py [--requests 12] [--ratios 0.15] [--check-layer 1]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cacheblend import Request, blend_forward, kl_top1
from model import Model
from tokenizer import SmolTokenizer

LICENSES = Path("/usr/share/common-licenses")
DOCS = ["Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1",
        "MPL-1.1", "MPL-2.0"]
CHUNK = 192
ANSWER = 32
INSTRUCTION = "Answer the question using the three documents below.\n\n"
QUESTIONS = [
    "What does the first document allow you to do?",
    "Summarize the second document in one sentence.",
    "Which of the documents talks about warranties, and what does it say?",
    "What must you do when you distribute a copy, according to the documents?",
]


def load_documents(tok):
    """Each license as token ids, whitespace inside paragraphs collapsed."""
    docs = {}
    for name in DOCS:
        text = (LICENSES / name).read_text(encoding="utf-8", errors="replace")
        paras = [" ".join(p.split()) for p in text.split("\n\n")]
        docs[name] = tok.encode("\n\n".join(p for p in paras if p))
    return docs


def build_request(k, docs, tok):
    """Request k: segments (kind, ids) and the question index; chunks from 3 documents."""
    names = [DOCS[(k + 4 * j) % len(DOCS)] for j in range(3)]
    chunks = []
    for j, name in enumerate(names):
        ids = docs[name]
        windows = len(ids) // CHUNK
        w = (k // len(DOCS) + j + 1) % windows  # skip the title window when we can
        chunks.append(("chunk", ids[w * CHUNK:(w + 1) * CHUNK]))
    system_user = tok.chat(INSTRUCTION).split(INSTRUCTION)[0]  # "<|im_start|>system...user\n"
    q = QUESTIONS[k % len(QUESTIONS)]
    return ([("fresh", tok.encode(system_user + INSTRUCTION))] + chunks
            + [("fresh", tok.encode(f"\n\nQuestion: {q}<|im_end|>\n<|im_start|>assistant\n"))],
            names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--ratios", default="0.15", help="comma-separated recompute ratios")
    ap.add_argument("--check-layer", type=int, default=1)
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]

    # 1. The model.
    t0 = time.time()
    model = Model.load()
    tok = SmolTokenizer(model.reader)
    docs = load_documents(tok)
    print(f"model loaded in {time.time() - t0:.1f}s; documents: "
          + ", ".join(f"{n} ({len(d)} tok)" for n, d in docs.items()))

    modes = ["reuse"] + [f"blend r={r:g}" for r in ratios]
    kls = {m: [] for m in modes}
    agree = {m: [] for m in modes}
    print(f"\n{'req':>3} {'N':>4} {'ans':>3}  " + "  ".join(f"{m:>22}" for m in modes)
          + "   question / documents")
    for k in range(args.requests):
        # 2. The request, its chunks' stored KV (each prefilled alone at 0..T-1) and
        #    the reference answer: greedy decoding after a full prefill.
        segments, names = build_request(k, docs, tok)
        prompt = np.concatenate([s for _, s in segments])
        answer = model.generate(prompt, ANSWER, stop=(tok.eos,))
        segments.append(("fresh", answer))
        stored = [model.prefill(s)[1] for kind, s in segments if kind == "chunk"]
        req = Request(segments, stored, model.cfg)
        rows = np.arange(len(prompt) - 1, req.N - 1)  # each row predicts the next answer token

        # 3. The modes, teacher-forced on the same answer.
        full, _ = model.prefill(req.ids)
        full = full[rows]
        line = []
        for m in modes:
            if m == "reuse":
                logits, _, _ = blend_forward(model, req, rows)
            else:
                r = float(m.split("=")[1])
                logits, _, _ = blend_forward(model, req, rows, args.check_layer, r)
            kl, top1 = kl_top1(full, logits)
            kls[m].append(kl.mean())
            agree[m].append(top1.mean())
            line.append(f"KL {kl.mean():7.4f} top1 {top1.mean():5.1%}")
        q = QUESTIONS[k % len(QUESTIONS)]
        print(f"{k:>3} {req.N:>4} {len(rows):>3}  " + "  ".join(f"{x:>22}" for x in line)
              + f"   {q[:30]}... [{', '.join(names)}]  {tok.decode(answer)[:50]!r}", flush=True)

    # 4. The table.
    print(f"\nmean over {args.requests} requests (check layer {args.check_layer}, value metric):")
    print(f"{'mode':<14} {'mean KL (nats)':>15} {'top-1 agree':>12} {'KL vs reuse':>12}")
    base = np.mean(kls["reuse"])
    for m in modes:
        print(f"{'full prefill':<14} {0.0:>15.4f} {1.0:>12.1%} {'':>12}") if m == "reuse" else None
        gain = f"{base / np.mean(kls[m]):.1f}x" if np.mean(kls[m]) > 1e-9 else "exact"
        print(f"{m:<14} {np.mean(kls[m]):>15.4f} {np.mean(agree[m]):>12.1%} {gain:>12}")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
