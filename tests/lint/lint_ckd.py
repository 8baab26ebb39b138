"""Unchecked arithmetic on a client's numbers in the request handlers and the fuse engine.

usage: lint_ckd.py SOURCE_ROOT

Every size, offset and extent computed from a request's fields goes through
common/ckd.h (ckd_add, ckd_mul, ckd_mul_add, ...), whose overflow is an error reply,
never a wrapped number (issue 30: a head stride near 2^64 wrapped a landing extent
and the daemon wrote before the client's segment). This lint reads daemon/ops/*.c and
daemon/fuse/*.c and reports each binary `+`, `*`, `+=` or `*=` with an operand read
off the wire: a request header's field (q->h.X), a landing layout's (y->X, lay.X), a
segment's position or count (g->pos, g->count). A line is let through when it calls
a ckd_ helper, or carries a comment `ckd-ok: WHY` (on it or on the line above) that
says what bound was checked before. It first checks itself on lines it must flag and
lines it must pass, so that it cannot pass by matching nothing.
"""

import glob
import os
import re
import sys

WIRE = (r"(?:\bq->h\.\w+(?:\[[^\]]*\])?(?:\.\w+)?|\by->\w+|\blay(?:\.|->)\w+"
        r"|\bg->(?:pos|count)\b)")
CAST = r"(?:\(\s*(?:u?int(?:8|16|32|64)_t|size_t|uint64_t|double|unsigned)\s*\)\s*)?"
# a wire operand right before or right after +, *, += or *= (not ++, not a unary *)
BEFORE = re.compile(WIRE + r"\s*(?:\+(?!\+)|\*)=?\s*[\w(]")
AFTER = re.compile(r"[\w)\]]\s*(?:\+(?!\+)|\*)=?\s*" + CAST + WIRE)


def strip(line):
    """The line without string literals and comments (a comment's text is kept apart)."""
    line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
    comment = ""
    m = re.search(r"/\*.*?(\*/|$)|//.*$", line)
    if m:
        comment = m.group(0)
        line = line[:m.start()] + line[m.end():]
    return line, comment


def findings(text):
    """(line number, line) of each unchecked use in C source text."""
    out, prev_ok, in_comment = [], False, False
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if in_comment:
            prev_ok = prev_ok or "ckd-ok:" in raw
            in_comment = "*/" not in raw
            continue
        if s.startswith("/*") and "*/" not in s:
            in_comment, prev_ok = True, "ckd-ok:" in raw
            continue
        code, comment = strip(raw)
        ok = prev_ok or "ckd-ok:" in comment or "ckd_" in code
        prev_ok = "ckd-ok:" in comment and not code.strip()
        if code.lstrip().startswith("#") or ok:
            continue
        if BEFORE.search(code) or AFTER.search(code):
            out.append((n, raw.rstrip()))
    return out


def self_check():
    must_flag = ["\tuint64_t end = y->k_offset + y->layer_stride;",
                 "\tsize_t n = (size_t)q->h.num_tokens * m.row;",
                 "\tp->n += g->count;",
                 "\tx = a * (uint64_t)lay.head_stride;"]
    must_pass = ["\tif (ckd_mul(&e, y->head_stride, n))",
                 "\tuint64_t e = y->k_offset + 4; /* ckd-ok: k_offset <= shm size */",
                 "\t*out = q->h.num_tokens;",
                 "\ti++;",
                 "\tfail(q, 1, \"%u + %u\", q->h.a, q->h.b);"]
    bad = [line for line in must_flag if not findings(line)]
    bad += [line for line in must_pass if findings(line)]
    return bad


def main():
    root = sys.argv[1]
    broken = self_check()
    if broken:
        print("not ok 1 - the lint's own check: misjudged " + "; ".join(broken))
        print("0 passed, 1 failed")
        return 1
    files = sorted(glob.glob(os.path.join(root, "daemon", "ops", "*.c")) +
                   glob.glob(os.path.join(root, "daemon", "fuse", "*.c")))
    hits = []
    for f in files:
        with open(f) as fh:
            for n, line in findings(fh.read()):
                hits.append(f"{os.path.relpath(f, root)}:{n}: {line.strip()}")
    print(f"# {len(files)} files read; {len(hits)} unchecked uses of wire values")
    for h in hits:
        print(f"# {h}")
    ok = bool(files) and not hits
    print(f"{'ok' if ok else 'not ok'} 1 - every +/* on a request's numbers goes through "
          "common/ckd.h or says which bound holds (ckd-ok:)")
    print(f"{int(ok)} passed, {int(not ok)} failed")
    return 0 if ok else 1


sys.exit(main())
