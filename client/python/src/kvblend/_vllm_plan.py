"""Request parameters and claims of the vLLM connector, with no vLLM or torch import.

kvblend.vllm's scheduler side is this module plus a daemon lookup: parsing a request's
``kv_transfer_params["kvblend"]`` and deciding how many prompt tokens the connector
provides are pure functions here, so that they are tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Most segments one request may name (a bound on the work a request can ask for).
MAX_SEGMENTS = 4096

CHUNK = "chunk"
FRESH = "fresh"


class ParamError(ValueError):
    """A request's kvblend parameters are malformed; the message names the problem."""


@dataclass(frozen=True)
class Segment:
    """One span of the prompt: tokens ``start .. start + length - 1``, a chunk or fresh."""

    start: int
    length: int
    kind: str

    @property
    def end(self) -> int:
        """One past the segment's last token."""
        return self.start + self.length


@dataclass(frozen=True)
class Params:
    """A request's validated kvblend parameters."""

    segments: tuple[Segment, ...]
    store: bool


@dataclass(frozen=True)
class ChunkLoad:
    """Rows ``first .. last - 1`` (prompt positions) of the chunk ``hash`` at ``start``."""

    hash: bytes
    start: int
    length: int
    first: int
    last: int


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ParamError(f"{what} must be an integer, got {type(x).__name__}")
    return x


def parse_params(kv_transfer_params: Any, prompt_len: int) -> Params | None:
    """Validate ``kv_transfer_params``; None when it has no ``"kvblend"`` key.

    Parameters
    ----------
    kv_transfer_params : Any
        The request's ``kv_transfer_params`` (a dict, or None).
    prompt_len : int
        Tokens in the prompt.

    Returns
    -------
    Params or None
        Segments sorted by start, non-overlapping, each of at least one token and
        inside the prompt (tokens no segment names are fresh); ``store`` False unless
        given as True.

    Raises
    ------
    ParamError
        The parameters are malformed; the message says how.
    """
    if kv_transfer_params is None:
        return None
    if not isinstance(kv_transfer_params, dict):
        kind = type(kv_transfer_params).__name__
        raise ParamError(f"kv_transfer_params must be a dict, got {kind}")
    if "kvblend" not in kv_transfer_params:
        return None
    p = kv_transfer_params["kvblend"]
    if not isinstance(p, dict):
        raise ParamError(f"kvblend must be a dict, got {type(p).__name__}")
    unknown = set(p) - {"segments", "store"}
    if unknown:
        raise ParamError(f"kvblend: unknown keys {sorted(map(str, unknown))}")
    store = p.get("store", False)
    if not isinstance(store, bool):
        raise ParamError(f"kvblend.store must be a bool, got {type(store).__name__}")
    raw = p.get("segments", [])
    if not isinstance(raw, (list, tuple)):
        raise ParamError(f"kvblend.segments must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_SEGMENTS:
        raise ParamError(f"kvblend.segments: {len(raw)} segments, at most {MAX_SEGMENTS}")
    segs = []
    end = 0
    for i, s in enumerate(raw):
        if not isinstance(s, (list, tuple)) or len(s) != 3:
            raise ParamError(f"kvblend.segments[{i}] must be [start, length, kind]")
        start = _int(s[0], f"kvblend.segments[{i}] start")
        length = _int(s[1], f"kvblend.segments[{i}] length")
        kind = s[2]
        if kind not in (CHUNK, FRESH):
            raise ParamError(f"kvblend.segments[{i}] kind must be 'chunk' or 'fresh', got {kind!r}")
        if start < 0:
            raise ParamError(f"kvblend.segments[{i}] start {start} < 0")
        if length < 1:
            raise ParamError(f"kvblend.segments[{i}] length {length} < 1")
        if start < end:
            raise ParamError(
                f"kvblend.segments[{i}] starts at {start}, before the previous one ends ({end})"
            )
        if start + length > prompt_len:
            raise ParamError(
                f"kvblend.segments[{i}] ends at {start + length}, past the prompt ({prompt_len})"
            )
        end = start + length
        segs.append(Segment(start, length, kind))
    return Params(tuple(segs), store)


#: Longest chunk separator (tokens) the connector accepts in its configuration.
MAX_SEPARATOR = 64


def parse_separator(raw: Any) -> tuple[int, ...] | None:
    """Validate ``kv_connector_extra_config["chunk_separator"]``: token ids, or None.

    Raises
    ------
    ParamError
        Not a non-empty list of at most MAX_SEPARATOR token ids (ints in [0, 2**32)).
    """
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or not 1 <= len(raw) <= MAX_SEPARATOR:
        raise ParamError(
            f"chunk_separator must be a list of 1 to {MAX_SEPARATOR} token ids, got {raw!r}"
        )
    ids = tuple(_int(t, "chunk_separator token") for t in raw)
    if any(not 0 <= t < 2**32 for t in ids):
        raise ParamError(f"chunk_separator token ids must be in [0, 2**32), got {list(ids)}")
    return ids


def separator_params(prompt_ids: Sequence[int], sep: Sequence[int]) -> Params | None:
    """Segments of a prompt split by a separator token sequence; None when it has none.

    Every occurrence of ``sep`` (left to right, not overlapping) ends a chunk: chunk i
    runs from the end of the previous separator (or the prompt's start) through the end
    of separator i, separator included, so that chunks lie back to back and all can be
    loaded. The tokens after the last separator are fresh. Store such chunks with their
    trailing separator (``store_documents(llm, [doc + sep, ...])``).

    Raises
    ------
    ParamError
        More than MAX_SEGMENTS segments.
    """
    ids, m = list(prompt_ids), len(sep)
    sep = list(sep)
    segs: list[Segment] = []
    start = i = 0
    while i + m <= len(ids):
        if ids[i] == sep[0] and ids[i : i + m] == sep:
            segs.append(Segment(start, i + m - start, CHUNK))
            start = i = i + m
            if len(segs) >= MAX_SEGMENTS:
                raise ParamError(f"the prompt has more than {MAX_SEGMENTS - 1} chunk separators")
            continue
        i += 1
    if not segs:
        return None
    if start < len(ids):
        segs.append(Segment(start, len(ids) - start, FRESH))
    return Params(tuple(segs), False)


def chunk_segments(params: Params) -> list[Segment]:
    """Return the chunk segments of ``params``, in prompt order."""
    return [s for s in params.segments if s.kind == CHUNK]


def store_shape_error(params: Params, prompt_len: int) -> str | None:
    """Return why ``params`` cannot store (None if it can): one chunk at 0 covering the prompt."""
    s = params.segments
    if len(s) != 1 or s[0].kind != CHUNK or s[0].start != 0 or s[0].length != prompt_len:
        return (
            "store needs the prompt to be one chunk segment [0, prompt_len, 'chunk'] "
            "(each chunk is prefilled alone)"
        )
    return None


def claim(
    params: Params,
    hashes: Sequence[bytes],
    found: Sequence[bool],
    num_computed: int,
    prompt_len: int,
) -> tuple[int, list[ChunkLoad]]:
    """Return how many tokens from ``num_computed`` on the connector provides, and whence.

    Parameters
    ----------
    params : Params
        The request's parameters.
    hashes, found : sequence
        Per chunk segment (in order): its hash and whether the daemon holds it with the
        segment's length.
    num_computed : int
        Tokens vLLM already has.
    prompt_len : int
        Tokens in the prompt.

    Returns
    -------
    (int, list of ChunkLoad)
        The claimed tokens, contiguous from ``num_computed`` up to the first token that
        must be computed (a fresh span, a gap, a missing chunk) and never the last
        prompt token; and the chunk rows that fill them.
    """
    pos = num_computed
    ci = 0
    covering: list[tuple[Segment, bytes]] = []
    for s in params.segments:
        if s.kind == CHUNK:
            h, ok = hashes[ci], found[ci]
            ci += 1
        if s.end <= pos:
            continue
        if s.start > pos or s.kind != CHUNK or not ok:
            break
        covering.append((s, h))
        pos = s.end
    end = min(pos, prompt_len - 1)
    if end <= num_computed:
        return 0, []
    loads = [
        ChunkLoad(h, s.start, s.length, max(s.start, num_computed), min(s.end, end))
        for s, h in covering
        if max(s.start, num_computed) < min(s.end, end)
    ]
    return end - num_computed, loads


def plan_request(
    client: Any,
    model_name: str,
    num_layers: int,
    kv_transfer_params: Any,
    prompt_ids: Sequence[int],
    num_computed: int,
    separator: Sequence[int] | None = None,
) -> tuple[int, list[ChunkLoad]]:
    """Parse a request's parameters, look its chunks up, and claim (the scheduler's answer).

    Parameters
    ----------
    client : kvblend.Client
        Connected to the daemon.
    model_name : str
        The model the chunks are stored under.
    num_layers : int
        The model's layers (a chunk stored with fewer is treated as missing).
    kv_transfer_params : Any
        The request's ``kv_transfer_params``.
    prompt_ids : sequence of int
        The prompt.
    num_computed : int
        Tokens vLLM already has.
    separator : sequence of int, optional
        The configured chunk separator: a request without kvblend parameters is split
        by it (:func:`separator_params`).

    Returns
    -------
    (int, list of ChunkLoad)
        As :func:`claim`; (0, []) for a request without kvblend parameters (nor a
        separator in its prompt).

    Raises
    ------
    ParamError
        Malformed parameters.
    KvblendError
        The lookup failed.
    """
    from .client import chunk_hash

    ids = list(prompt_ids)
    params = parse_params(kv_transfer_params, len(ids))
    if params is None and separator:
        params = separator_params(ids, separator)
    if params is None:
        return 0, []
    segs = chunk_segments(params)
    if not segs:
        return 0, []
    hashes = [chunk_hash(ids[s.start : s.end]) for s in segs]
    infos = client.lookup(model_name, hashes)
    found = [
        i.found and i.num_tokens == s.length and i.num_layers == num_layers
        for i, s in zip(infos, segs)
    ]
    return claim(params, hashes, found, num_computed, len(ids))


def full_blocks(first: int, last: int, block_size: int) -> range:
    """Return the block indices (in the block table) wholly inside tokens ``first .. last - 1``."""
    return range(-(-first // block_size), last // block_size)
