"""Would outliers kept in full precision help quantized KV storage? NumPy only, no daemon.

Reads top to bottom: load the model, build run_eval.py's requests (the first 12
of seed 11), prefill each chunk alone as kvblendd would store it, quantize its
KV the way the store does (docs/storage.md "Quantized storage"; the semantics
of eval/kvref.py's ref_dequantize, vectorized here and checked against
it bit for bit at start), optionally keeping some values in full precision,
then run full reuse and CacheBlend (value metric, check layer 1, r = 0.15) with
the NumPy reference (cacheblend.py; the daemon matches it bit for bit) against
the full prefill, and print the table.

What may be kept in full precision (stored as f16, 2 bytes an element, as a
serving engine's KV is):

* key outlier channels: per layer and KV head, the n channels of largest
  max |K| over the chunk's tokens (keys carry fixed outlier channels: KIVI,
  arXiv 2402.02750); the other channels are quantized as the store does (for
  keys the scale is per channel, or per channel and group of G tokens in int4,
  so the kept channels change no other channel's scale);
* the chunk's first f tokens, K and V (the first token of a chunk prefilled
  alone is an attention sink, far larger than the rest); the other T - f rows
  are quantized as a tensor of their own (int4 key groups then start at row f).

Bytes per token: the store's layout (a 32-byte tensor header, a 16-byte payload
header, scales and codes; docs/storage.md), computed per chunk and summed over
the chunks, plus what keeping would add: the kept values at 2 bytes and one
byte per kept channel for its index. The plain codecs' figure is the format's,
which equals the daemon's stored bytes (eval/run_eval.py --codecs measures
those); the kept variants are not implemented in the daemon, so theirs is the
same arithmetic.

    python eval/outliers.py [--requests 12] [--json FILE]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kvref  # noqa: E402
from cacheblend import Request, blend_forward, kl_top1  # noqa: E402
from model import Model  # noqa: E402
from run_eval import SHAPES, answer_logits, build_request, greedy, load_documents  # noqa: E402
from tokenizer import SmolTokenizer  # noqa: E402

F16 = np.float16
F32 = np.float32
TENSOR_HEADER = 32  # KVBT header of every stored tensor
PAYLOAD_HEADER = 16  # rows, channels, axis, dtype, group, codec


# --- 1. The store's quantizers (kvref semantics, vectorized) ------------------------------

def int4_blocks(b):
    """int4 on blocks [n, g, m]: one group per (block, column) over its g values. Zero =
    min rounded down to f16, scale = (max - zero) / 15 rounded up to f16, codes
    rint((x - zero) / scale) in 0..15, decoded code x scale + zero, all in float32."""
    mn, mx = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    zh = mn.astype(F16)
    zh = np.where(zh.astype(F32) > mn, np.nextafter(zh, F16(-np.inf)), zh)
    z = zh.astype(F32)
    need = ((mx - z) / F32(15)).astype(F32)
    sh = need.astype(F16)
    sh = np.where(sh.astype(F32) < need, np.nextafter(sh, F16(np.inf)), sh)
    s = sh.astype(F32)
    safe = np.where(s > 0, s, F32(1))
    q = np.where(s > 0, np.clip(np.rint((b - z) / safe), 0, 15), F32(0)).astype(F32)
    return (q * s).astype(F32) + z


def int4(x2, axis, G):
    """int4 on [T, C] float32: groups of G tokens of a channel (axis 0, keys) or of G
    channels of a token (axis 1, values); the last group of each may be shorter."""
    if axis == 1:
        return int4(x2.T, 0, G).T
    T, C = x2.shape
    out = np.empty_like(x2)
    full = T // G * G
    if full:
        out[:full] = int4_blocks(x2[:full].reshape(-1, G, C)).reshape(full, C)
    if full < T:
        out[full:] = int4_blocks(x2[full:].reshape(1, T - full, C)).reshape(T - full, C)
    return out


def quantize(x2, axis, codec):
    """The store's round trip of a [T, C] float32 tensor: codec fp8, int8 or int4:G."""
    name, _, g = codec.partition(":")
    if name == "int4":
        return int4(x2, axis, int(g or 32))
    return kvref._sym(x2, axis, 127 if name == "int8" else 448, name)


def check_against_reference():
    """The vectorized quantizers equal kvref.ref_dequantize bit for bit (random data with
    outlier channels, token counts that leave short int4 groups)."""
    rng = np.random.default_rng(5)
    for T in (37, 64):
        kv = rng.standard_normal((2, 2, T, 3, 64)).astype(F32)
        kv[:, 0, :, :, 5] *= 20
        for codec in ("fp8", "int8", "int4:32", "int4:64", "int4:128"):
            want = kvref.ref_dequantize(kv, "f32", codec)
            for l in range(2):
                for p in range(2):
                    got = quantize(kv[l, p].reshape(T, -1), 0 if p == 0 else 1, codec)
                    if not np.array_equal(got, want[l, p].reshape(T, -1)):
                        raise SystemExit(f"vectorized {codec} differs from kvref (T={T})")


# --- 2. The variants ------------------------------------------------------------------------

def payload_bytes(codec, T, C, axis):
    """Stored bytes of one quantized tensor [T, C] (docs/storage.md): headers, scales, codes."""
    name, _, g = codec.partition(":")
    if T == 0 or C == 0:
        return 0
    if name == "int4":
        G = int(g or 32)
        groups = -(-T // G) * C if axis == 0 else T * -(-C // G)
        return TENSOR_HEADER + PAYLOAD_HEADER + 4 * groups + T * -(-C // 2)
    return TENSOR_HEADER + PAYLOAD_HEADER + 4 * (C if axis == 0 else T) + T * C


def stored_variant(kv, codec, k_channels=0, first=0):
    """A chunk's KV [L, 2, T, H, D] as the variant stores it, and its bytes.

    codec None: lossless f32 (the node's own KV). k_channels: per layer and KV head, that many
    key channels of largest max |K| kept (as f16); first: the first tokens' K and V kept."""
    L, _, T, H, D = kv.shape
    C = H * D
    if codec is None:
        return kv, L * 2 * (TENSOR_HEADER + T * C * 4)
    out = np.empty_like(kv)
    nbytes = 0
    f = min(first, T)
    for l in range(L):
        for p in range(2):
            x = kv[l, p]
            y = x.astype(F16).astype(F32)  # kept values: f16
            keep = np.zeros((H, D), bool)
            if p == 0 and k_channels:
                top = np.argsort(-np.abs(x[f:] if f < T else x).max(axis=0), axis=1)
                np.put_along_axis(keep, top[:, :k_channels], True, axis=1)
            cols = np.flatnonzero(~keep.reshape(-1))
            rest = x.reshape(T, C)[f:, cols]
            y2 = y.reshape(T, C)
            y2[f:, cols] = quantize(rest, 0 if p == 0 else 1, codec)
            out[l, p] = y2.reshape(T, H, D)
            nbytes += payload_bytes(codec, T - f, len(cols), 0 if p == 0 else 1)
            nbytes += 2 * (T * C - (T - f) * len(cols)) + int(keep.sum())
    return out, nbytes


def variants():
    """(label, codec, key channels kept per layer and head, first tokens kept)."""
    out = [("f32 (lossless)", None, 0, 0)]
    for codec, extra in (("int4:16", []),
                         ("int4:32", [(2, 0), (4, 0), (8, 0), (0, 1), (0, 4), (0, 16), (8, 16)]),
                         ("int4:128", [(8, 0), (0, 1), (0, 16), (8, 16)]),
                         ("int8", [(8, 0), (0, 16)]),
                         ("fp8", [(8, 0), (0, 16)])):
        out.append((codec, codec, 0, 0))
        for n, f in extra:
            what = " + ".join(x for x in (f"{n} K channels" if n else "",
                                          f"first {f} token{'s' * (f > 1)}" if f else "") if x)
            out.append((f"{codec} + {what}", codec, n, f))
    return out


# --- 3. The run -------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="run_eval's smoke requests")
    ap.add_argument("--json", help="write every per-request figure here")
    args = ap.parse_args(argv)
    t_start = time.time()
    check_against_reference()
    model = Model.load()
    tok = SmolTokenizer(model.reader)
    docs = load_documents(tok)
    shape = SHAPES["smoke" if args.smoke else "full"]
    vs = variants()
    blend = f"CacheBlend V r={args.ratio:g}"
    forced = f"{blend}, lossless selection"
    modes = ["full reuse", blend]
    # per variant and mode, per request: KL to full prefill, top-1, KL to the same mode on
    # lossless storage, and (CacheBlend) the share of its selected cached tokens that the
    # lossless run selected too
    figs = {v[0]: {} for v in vs}
    nbytes = {v[0]: 0 for v in vs}
    tokens = 0
    prefilled = {}
    for k in range(args.requests):
        segments, info = build_request(k, args.seed, docs, tok, shape)
        chunks = [s for kind, s in segments if kind == "chunk"]
        for s in chunks:
            key = tuple(int(t) for t in s)
            if key not in prefilled:
                prefilled[key] = model.prefill(s, logits_for="last")[1]
        stored = [prefilled[tuple(int(t) for t in s)] for s in chunks]
        tokens += sum(len(s) for s in chunks)
        full = Request(segments, None, model.cfg)
        last, kv_full = model.prefill(full.ids, logits_for="last")
        answer = greedy(model, kv_full, last, shape["answer"], (tok.eos,))
        ref = answer_logits(model, kv_full, last, answer)
        del kv_full
        rows = np.array([full.N - 1])
        lossless, lossless_sel = {}, None
        line = []
        for label, codec, n, f in vs:
            sv = [stored_variant(kv, codec, n, f) for kv in stored]
            nbytes[label] += sum(b for _, b in sv)
            req = Request(segments, [x for x, _ in sv], model.cfg)
            runs = [("full reuse", {}), (blend, dict(check_layer=args.check_layer,
                                                       ratio=args.ratio))]
            if codec is not None and n == 0 and f == 0:  # selection apart from stored KV
                runs.append((forced, dict(check_layer=args.check_layer, ratio=args.ratio,
                                          force=[lossless_sel])))
            for m, kw in runs:
                last_m, kv_m, sel = blend_forward(model, req, rows, **kw)
                logits = answer_logits(model, kv_m, last_m, answer)
                del kv_m
                kl, top1 = kl_top1(ref, logits)
                own = kl_top1(lossless.setdefault(m if m != forced else blend, logits),
                              logits)[0]
                x = figs[label].setdefault(m, dict(kl=[], top1=[], kl_lossless=[], overlap=[]))
                x["kl"].append(float(kl.mean()))
                x["top1"].append(float(top1.mean()))
                x["kl_lossless"].append(float(own.mean()))
                if m == blend:
                    lossless_sel = sel if codec is None else lossless_sel
                    a, b = (np.intersect1d(z, np.flatnonzero(req.cached)) for z in
                            (sel, lossless_sel))
                    x["overlap"].append(float(np.isin(a, b).mean()))
            line.append(f"{label} {figs[label][blend]['kl'][-1]:.4f}")
        print(f"req {k:2d} N={full.N:4d} chunks={len(chunks)} A={len(answer):2d} KL CacheBlend: "
              + ", ".join(line), flush=True)

    base = vs[0][0]
    print(f"\n## Outliers kept in full precision: {args.requests} requests, "
          f"{len(prefilled)} chunks, {tokens} chunk tokens; mean KL to full prefill "
          "(nats, answer positions), top-1, KL to the same mode on lossless f32 storage\n")
    head = "| variant | bytes / token | added bytes / token"
    sep = "| --- | --- | ---"
    for m in modes:
        head += f" | KL {m} | top-1 | KL to lossless"
        sep += " | --- | --- | ---"
    print(head + " | selection as lossless's |\n" + sep + " | --- |")
    summary = {}
    plain = None
    for label, codec, n, f in vs:
        bpt = nbytes[label] / tokens
        if n == 0 and f == 0:
            plain = bpt
        line = f"| {label} | {bpt:.0f} | {'-' if n == 0 and f == 0 else f'+{bpt - plain:.0f}'}"
        summary[label] = dict(codec=codec, key_channels=n, first_tokens=f, bytes_per_token=bpt,
                              modes={m: {key: float(np.mean(v)) for key, v in x.items() if v}
                                     for m, x in figs[label].items()})
        for m in modes:
            x = summary[label]["modes"][m]
            line += f" | {x['kl']:.4f} | {x['top1']:.1%} | {x['kl_lossless']:.2e}"
        print(line + f" | {summary[label]['modes'][blend]['overlap']:.1%} |")
    print(f"\n{base}: the node's own KV, {nbytes[base] / tokens:.0f} bytes per token raw "
          "(run_eval.py --codecs measures what the daemon stores for f32 and f16)")
    print(f"\n## {blend}: its own selection against the lossless run's selection forced "
          "(the stored KV's error alone)\n")
    print("| codec | KL, own selection | KL, lossless selection | KL to lossless, own "
          "| KL to lossless, lossless selection |\n| --- | --- | --- | --- | --- |")
    for label in summary:
        x = summary[label]["modes"]
        if forced in x:
            print(f"| {label} | {x[blend]['kl']:.4f} | {x[forced]['kl']:.4f} "
                  f"| {x[blend]['kl_lossless']:.2e} | {x[forced]['kl_lossless']:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                               "tokens": tokens, "per_request": figs}, indent=1))
        print(f"figures: {args.json}")
    print(f"total {time.time() - t_start:.0f}s")
    return summary


if __name__ == "__main__":
    main()
