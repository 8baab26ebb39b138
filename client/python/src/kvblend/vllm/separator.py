r"""A chunk separator given as text: tokenized once, and checked to be a stable token boundary.

``chunk_separator_text`` (docs/vllm.md, "Chunk boundaries by a separator") is tokenized
with the engine's tokenizer at start. A tokenizer may merge a separator's first or last
characters with the text around it (``"\n\n"`` followed by ``"\n"``, ``" #"`` followed
by ``"#"``), and then the ids the connector looks for are not in the prompt, or the
documents before and after it no longer tokenize as they did alone (so their chunk hashes
miss). :func:`check_separator` samples contexts from the tokenizer's vocabulary and
refuses such a separator, naming a failing context and a candidate that passes. Pure
functions over an ``encode`` callable: no vLLM or tokenizer import.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

#: Separators tried, in this order, when the configured one fails: the first that passes
#: for the engine's tokenizer is named in the refusal. LMCache's default (" # # ") first,
#: then other plain-text ones, then end-of-document tokens of the byte-level BPE families
#: (GPT-2, SmolLM2, Qwen: ``<|endoftext|>``; Llama 3: ``<|end_of_text|>``; Llama 2 and
#: Mistral: ``</s>``), which a tokenizer that has them as added tokens never merges.
CANDIDATES = (
    " # # ",
    "\n# # #\n",
    "\n###\n",
    "\n---\n",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)

#: Contexts tried on both sides of the separator, whatever the tokenizer: empty, runs of
#: whitespace, punctuation, words with and without a space, digits, non-ASCII text.
EDGES = (
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    ".",
    ",",
    ":",
    "!",
    "?",
    "#",
    "-",
    "*",
    "(",
    ")",
    '"',
    "'",
    "word",
    "Word",
    " word",
    "word ",
    "word\n",
    "word.",
    "7",
    "2024",
    "é",
    "日本",
)

#: Sampled contexts (left and right pairs) beside the fixed ones, by default.
SAMPLES = 64
#: The sampler's seed: the same tokenizer always gets the same contexts.
SEED = 0

# What a sampled context may start or end with (added around decoded vocabulary tokens).
_AFFIXES = ("", "", "", " ", "\n", "\n\n", ".", ",", "#", ")", '"', "  ")


class SeparatorError(ValueError):
    """The separator text does not tokenize to a stable boundary; the message says where."""


def contexts(
    vocabulary: Sequence[str], samples: int = SAMPLES, seed: int = SEED
) -> list[tuple[str, str]]:
    """Return the (left, right) contexts the separator is checked between.

    Every string of :data:`EDGES` once on each side (the other side a word), then
    ``samples`` pairs built from the vocabulary with a fixed seed: each side one to three
    decoded tokens, with whitespace or punctuation sometimes added before or after.

    Parameters
    ----------
    vocabulary : sequence of str
        Decoded tokens (``decode([id])`` for each id; strings holding U+FFFD, a partial
        UTF-8 character, and empty ones are skipped).
    samples : int
        Sampled pairs.
    seed : int
        The sampler's seed.
    """
    pairs = [(e, "word") for e in EDGES] + [("word", e) for e in EDGES]
    rng = random.Random(seed)
    n = len(vocabulary)
    if n == 0:
        return pairs

    def token() -> str:
        for _ in range(32):
            t = vocabulary[rng.randrange(n)]
            if t and "\ufffd" not in t:
                return t
        return "word"

    def side() -> str:
        s = "".join(token() for _ in range(rng.randint(1, 3)))
        return rng.choice(_AFFIXES) + s + rng.choice(_AFFIXES)

    pairs += [(side(), side()) for _ in range(samples)]
    return pairs


def boundary_error(
    text: str, encode: Callable[[str], list[int]], pairs: Sequence[tuple[str, str]]
) -> str | None:
    """Return why ``text`` is not a stable boundary between ``pairs`` (None if it is).

    The rule, for every pair (L, R): ``encode(L + text + R) == encode(L) + encode(text) +
    encode(R)``, ``encode`` without special tokens. So the separator's ids appear,
    unchanged, right after L's ids, and neither L nor R tokenizes differently beside it:
    a prompt ``doc1 + sep + doc2 + sep + question`` tokenized as one string then holds
    ``encode(doc1) + ids + encode(doc2) + ids + ...``, the ids of documents stored with
    ``store_documents(llm, [encode(doc) + ids, ...])``.
    """
    ids = list(encode(text))
    if not ids:
        return f"{text!r} tokenizes to no ids"
    for left, right in pairs:
        whole = list(encode(left + text + right))
        want = list(encode(left)) + ids + list(encode(right))
        if whole != want:
            return (
                f"between {left!r} and {right!r} it tokenizes as {whole} "
                f"instead of {want} (separator alone: {ids})"
            )
    return None


def check_separator(
    text: str,
    encode: Callable[[str], list[int]],
    vocabulary: Sequence[str],
    samples: int = SAMPLES,
    seed: int = SEED,
    candidates: Sequence[str] = CANDIDATES,
) -> tuple[int, ...]:
    """Tokenize the separator ``text`` and check that it is a stable token boundary.

    Parameters
    ----------
    text : str
        The separator (``kv_connector_extra_config["chunk_separator_text"]``).
    encode : callable
        The engine's tokenizer: text to ids, without special tokens.
    vocabulary : sequence of str
        The tokenizer's decoded tokens (:func:`contexts`).
    samples, seed : int
        :func:`contexts`'s.
    candidates : sequence of str
        Separators tried when ``text`` fails; the first that passes is named.

    Returns
    -------
    tuple of int
        ``encode(text)``: the separator's ids, as ``chunk_separator`` would give them.

    Raises
    ------
    SeparatorError
        ``text`` fails :func:`boundary_error`'s rule for one of the contexts; the message
        (one line) names the context, the ids, and the first candidate that passes, if any.
    """
    if not isinstance(text, str) or not text:
        raise SeparatorError(f"chunk_separator_text must be a non-empty string, got {text!r}")
    pairs = contexts(vocabulary, samples, seed)
    why = boundary_error(text, encode, pairs)
    if why is None:
        return tuple(int(t) for t in encode(text))
    alt = next(
        (c for c in candidates if c != text and boundary_error(c, encode, pairs) is None), None
    )
    hint = (
        f"{alt!r} passes for this tokenizer"
        if alt is not None
        else f"none of {list(candidates)!r} passes for this tokenizer: give chunk_separator "
        "(token ids) instead"
    )
    raise SeparatorError(
        f"chunk_separator_text {text!r} is not a stable token boundary: {why}; {hint}"
    )
