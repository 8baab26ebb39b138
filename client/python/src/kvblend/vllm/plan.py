"""The connector's one planner: a request's parameters, its chunks looked up, its claim.

kvblend.vllm's scheduler side asks :func:`plan_request` once per request: one parse of
``kv_transfer_params["kvblend"]`` (:func:`parse_request`: the segments, or the
configured separator's; the request's blend settings), one hash of each chunk segment,
one daemon lookup, then one decision: a CacheBlend load of the context up to the last
chunk found (:class:`BlendLoad`), or plain reuse of the chunks from the start of the
prompt up to the first token vLLM must compute (:func:`claim`). The :class:`Plan` is kept
by the scheduler and used again when vLLM allocates the request's blocks. Chunks are
hashed within the request's scope (:func:`request_scope`: its LoRA adapter's content and
cache salt), so KV computed under one adapter or salt is never loaded for another.
Everything but the lookup and the adapter's digest (its files, read once a version) is a
pure function, tested without an engine; no vLLM or torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..blend import metrics as _metrics
from ..client import scoped_chunk_hash

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
    #: Where the question ends (a prompt position), or None: the prompt's end. The
    #: attention-family previews read the tokens from the blended context's end up to
    #: here, so a prompt whose tail holds more than the question (an answer being
    #: scored, say) previews only the question.
    question_end: int | None = None


@dataclass(frozen=True)
class ChunkLoad:
    """Rows ``first .. last - 1`` (prompt positions) of the chunk ``hash`` at ``start``."""

    hash: bytes
    start: int
    length: int
    first: int
    last: int


def landable(chunks: list[ChunkLoad]) -> int | None:
    """The tokens a landing session writes for ``chunks``, or None when it cannot land them.

    A session lands whole chunks back to back from position 0 (its token t is prompt
    position t), each loaded from its first token; any other load is copied.
    """
    pos = 0
    for c in chunks:
        if c.start != pos or c.first != c.start:
            return None
        pos += c.length
    return pos if chunks else None


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
        given as True; ``question_end`` in ``1 .. prompt_len`` when given.

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
    unknown = set(p) - {"segments", "store", "question_end"}
    if unknown:
        raise ParamError(f"kvblend: unknown keys {sorted(map(str, unknown))}")
    store = p.get("store", False)
    if not isinstance(store, bool):
        raise ParamError(f"kvblend.store must be a bool, got {type(store).__name__}")
    question_end = p.get("question_end")
    if question_end is not None:
        question_end = _int(question_end, "kvblend.question_end")
        if not 1 <= question_end <= prompt_len:
            raise ParamError(
                f"kvblend.question_end {question_end}: not in 1 .. {prompt_len} (the prompt)"
            )
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
    return Params(tuple(segs), store, question_end)


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

    The occurrences of ``sep`` (left to right, not overlapping) cut the prompt as
    LMCache's ``blend_special_str`` does: the tokens up to and through the first
    separator are the prefix (an instruction, a system prompt, a chat template's header:
    fresh, computed by vLLM or found in its prefix cache); each piece between two
    separators, with the separator that closes it, is a chunk (a document: stored as
    ``doc + sep``, ``store_documents(llm, [doc + sep, ...])``); the tokens after the last
    separator are fresh (the question). So ``prefix S d1 S d2 S question`` has the chunks
    ``d1 S`` and ``d2 S``, back to back after the prefix. A prompt with one separator
    has no chunk (segments of the prefix and the rest, both fresh).

    Raises
    ------
    ParamError
        More than MAX_SEGMENTS segments.
    """
    ids, m = list(prompt_ids), len(sep)
    sep = list(sep)
    ends: list[int] = []  # one past each separator
    i = 0
    while i + m <= len(ids):
        if ids[i] == sep[0] and ids[i : i + m] == sep:
            i += m
            ends.append(i)
            if len(ends) > MAX_SEGMENTS - 1:
                raise ParamError(f"the prompt has more than {MAX_SEGMENTS - 1} chunk separators")
            continue
        i += 1
    if not ends:
        return None
    segs = [Segment(0, ends[0], FRESH)]
    segs += [Segment(a, b - a, CHUNK) for a, b in zip(ends, ends[1:])]
    if ends[-1] < len(ids):
        segs.append(Segment(ends[-1], len(ids) - ends[-1], FRESH))
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


# --- CacheBlend: the connector's and a request's blend settings ---------------------------


@dataclass(frozen=True)
class BlendConfig:
    """``kv_connector_extra_config["blend"]``: check layers, ratios and metric.

    ``budget_ms``: a latency budget for the blend pass instead of a fixed ratio (node
    metrics only): the scheduler picks the ratio from its cost model
    (:meth:`kvblend.vllm.cost.CostModel.blend_ratio`), ``ratios`` being the one used
    until the model has measured blends; ``min_ratio``: the quality floor, the smallest
    ratio the budget may pick.
    """

    check_layers: tuple[int, ...]
    ratios: tuple[float, ...]
    metric: str
    budget_ms: float | None = None
    min_ratio: float = 0.0


@dataclass
class BlendLoad:
    """One request's blend: its context and fuse segments.

    The context runs up to the end of the request's last stored chunk found; segments
    are ``(hash, pos)`` for a chunk and ``(count, pos)`` for fresh tokens. ``question``:
    the prompt's tokens after the context (the attention metric's preview runs them).
    ``skip``: the prompt's first tokens vLLM already holds (prefix-cache hits), not
    written.
    """

    ids: list[int]
    segments: list[tuple]
    config: BlendConfig
    question: list[int] = field(default_factory=list)
    #: Tokens vLLM already has (its prefix cache): the pass reads their KV from vLLM's
    #: cache instead of computing them (with check layers, whose selection reads every
    #: row, it computes them) and writes only the rows from here on.
    skip: int = 0

    def fresh_tokens(self) -> int:
        """Tokens of the context no stored chunk provides (the pass computes them all)."""
        return sum(int(ref) for ref, _ in self.segments if isinstance(ref, int))

    def computable(self) -> tuple[int, int]:
        """Return the (fresh, stored chunk) tokens of the context the pass may compute.

        With no check layer the prefix-cache hits (before ``skip``) are read from vLLM's
        cache, never computed, so only the tokens after them count; with check layers
        (whose selection reads every row) all of them.
        """
        first = 0 if self.config.check_layers else self.skip
        ends = [int(pos) for _, pos in self.segments[1:]] + [len(self.ids)]
        fresh = chunk = 0
        for (ref, pos), end in zip(self.segments, ends):
            n = max(end - max(int(pos), first), 0)
            if isinstance(ref, int):
                fresh += n
            else:
                chunk += n
        return fresh, chunk

    def predicted_computed(self) -> int:
        """Return the rows the pass will compute after its last check layer.

        The fresh tokens and the last ratio's share of the stored chunks' (a pass
        without check layers recomputes only the fresh tokens, but for the node metrics',
        which recompute their share at every layer), of the tokens :meth:`computable`
        counts.
        """
        fresh, chunk = self.computable()
        if not self.config.ratios or (
            not self.config.check_layers and self.config.metric not in NODE_SELECTS
        ):
            return fresh
        return fresh + int(round(self.config.ratios[-1] * chunk))


#: The connector's default (docs/EVAL.md, "The default, from bench_rag"): the anchored
#: metric at r = 0.15. Settings that give check layers without a metric keep the value
#: metric (:func:`blend_settings`).
DEFAULT_CONFIG = BlendConfig((), _metrics.METRICS[_metrics.DEFAULT].ratios, _metrics.DEFAULT)
#: The selection metrics (:mod:`kvblend.blend.metrics`, docs/fuse.md).
METRICS = _metrics.NAMES
#: The metrics whose selection the node makes itself from its preview, with no check layer.
NODE_SELECTS = _metrics.NODE_SELECTS
#: Each metric's check layers and ratios when the settings name the metric but not them
#: and the base settings are of the other kind (check layers or none).
METRIC_DEFAULTS = {n: (m.checks, m.ratios) for n, m in _metrics.METRICS.items()}


def blend_settings(raw: Any, num_layers: int, base: BlendConfig, where: str) -> BlendConfig:
    """Check blend settings ``raw`` (a dict); keys it lacks keep ``base``'s values."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a dict, got {type(raw).__name__}")
    unknown = set(raw) - {"check_layers", "ratios", "metric", "budget_ms", "min_ratio"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))}")
    if "metric" not in raw and "check_layers" in raw and base.metric in NODE_SELECTS:
        # check layers are the HKVD metrics' (no check layers and no ratios: full reuse):
        # settings that name them and no metric mean what they meant before the default
        # became a metric without check layers
        base = BlendConfig(*METRIC_DEFAULTS["value"], "value")
    metric = _metrics.check_name(raw.get("metric", base.metric), f"{where}.metric")
    if (metric in NODE_SELECTS) != (base.metric in NODE_SELECTS):
        base = BlendConfig(*METRIC_DEFAULTS[metric], metric)
    checks = raw.get("check_layers", base.check_layers)
    ratios = raw.get("ratios", base.ratios)
    if not isinstance(checks, (list, tuple)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in checks
    ):
        raise ValueError(f"{where}.check_layers must be a list of ints")
    if not isinstance(ratios, (list, tuple)) or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios
    ):
        raise ValueError(f"{where}.ratios must be a list of numbers")
    checks, ratios = tuple(checks), tuple(float(r) for r in ratios)
    if metric in NODE_SELECTS:
        # no check layer: one ratio, the share of chunk tokens recomputed at every layer
        if checks:
            raise ValueError(f"{where}.check_layers must be empty for the {metric} metric")
        if len(ratios) != 1:
            raise ValueError(f"{where}.ratios: one ratio for the {metric} metric")
    # no check layers (and no ratios): full reuse through the pass, every stored chunk
    # re-rotated in place and every fresh token computed, wherever the chunks sit
    elif len(checks) != len(ratios):
        raise ValueError(f"{where}: one ratio per check layer")
    if any(not 0 <= c < num_layers for c in checks) or list(checks) != sorted(set(checks)):
        raise ValueError(f"{where}.check_layers {list(checks)}: increasing, in 0..{num_layers - 1}")
    if any(not 0.0 <= r <= 1.0 for r in ratios) or list(ratios) != sorted(ratios, reverse=True):
        raise ValueError(f"{where}.ratios {list(ratios)}: in [0, 1], not increasing")
    budget = raw.get("budget_ms", base.budget_ms if metric == base.metric else None)
    floor = raw.get("min_ratio", base.min_ratio if metric == base.metric else 0.0)
    if budget is not None or floor:
        if metric not in NODE_SELECTS:
            raise ValueError(f"{where}: budget_ms and min_ratio choose the one ratio of a node "
                             f"metric ({', '.join(NODE_SELECTS)}), not the {metric} metric's")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0
        ):
            raise ValueError(f"{where}.budget_ms {budget!r}: a number of milliseconds above 0")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor <= 1:
            raise ValueError(f"{where}.min_ratio {floor!r}: a number in [0, 1]")
    return BlendConfig(
        checks, ratios, metric, None if budget is None else float(budget), float(floor)
    )


def split_override(kv_transfer_params: Any) -> tuple[Any, Any]:
    """Return ``(kv_transfer_params without kvblend.blend, that value or None)``.

    A request may carry ``{"kvblend": {..., "blend": {...} | false}}``: settings that
    override the connector's for it (keys it lacks keep the connector's), or false for
    full reuse. The rest goes to the reuse planner, which knows no ``blend`` key.
    """
    kvp = kv_transfer_params
    if isinstance(kvp, dict) and isinstance(kvp.get("kvblend"), dict) and "blend" in kvp["kvblend"]:
        inner = dict(kvp["kvblend"])
        override = inner.pop("blend")
        return {**kvp, "kvblend": inner}, override
    return kvp, None


# --- the planner: one parse, one hash, one lookup per request ------------------------------


#: The files a LoRA adapter's KV depends on, as vLLM 0.32 loads an adapter from its folder
#: (``vllm/lora/peft_helper.py``, ``lora_model.py``): its config (rank, ``lora_alpha``,
#: target modules) and the first of these weights files that exists.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
#: Adapters whose digest is kept, the least recently used dropped first.
MAX_ADAPTER_DIGESTS = 256
#: ``{folder: (its files' stat signature, their digest)}``: an adapter's files are read
#: once per version; a request stats them (:func:`adapter_digest`).
ADAPTER_DIGESTS: OrderedDict[str, tuple[tuple, str]] = OrderedDict()


def _adapter_folder(path: str) -> str | None:
    """Return the local folder of a LoRARequest's ``lora_path`` (None: none here).

    As vLLM's worker resolves it (``vllm/lora/utils.py`` ``get_adapter_absolute_path``),
    without downloading: an absolute path, ``~``, a relative path that exists, else a
    Hugging Face id found in the local Hugging Face cache (vLLM's worker downloads it
    there when it first loads the adapter).
    """
    if not path:
        return None
    if path.startswith("~"):
        path = os.path.expanduser(path)
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id=path, local_files_only=True))
    except Exception:  # not installed, not an id, not downloaded: no folder here
        return None


def _adapter_digest(files: list[str]) -> str:
    """BLAKE2b-256 (hex) over each file's name, length and bytes, in order."""
    h = hashlib.blake2b(digest_size=32, person=b"kvblend lora v1")
    for f in files:
        name = os.path.basename(f).encode()
        h.update(len(name).to_bytes(4, "little") + name)
        h.update(os.path.getsize(f).to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while True:
                block = fh.read(1 << 20)
                if not block:
                    break
                h.update(block)
    return h.hexdigest()


def adapter_digest(lora: Any) -> str:
    """Return the digest of a LoRA adapter's files: what its KV depends on, not its name.

    ``lora`` is vLLM's ``LoRARequest`` (read by attribute: ``lora_path``, ``lora_name``).
    The files (:data:`ADAPTER_CONFIG` and the first of :data:`ADAPTER_WEIGHTS`) are read
    the first time a version of them is seen; later calls stat them and reuse the digest
    while their size, mtime, ctime, inode and device are unchanged (a rewrite in place
    changes ctime even when mtime is put back; a replacement by rename, the inode).

    Raises
    ------
    ParamError
        The adapter has no weights file on this machine (a Hugging Face id not downloaded
        yet, a path that does not exist), or its files cannot be read.
    """
    name = getattr(lora, "lora_name", "?")
    path = str(getattr(lora, "lora_path", "") or "")
    folder = _adapter_folder(path)
    why = f"LoRA adapter '{name}' ({path or 'no lora_path'})"
    if folder is None:
        raise ParamError(f"{why}: not on this machine, so its KV cannot be keyed by its "
                         "weights")
    weights = [os.path.join(folder, w) for w in ADAPTER_WEIGHTS]
    weights = [w for w in weights if os.path.isfile(w)][:1]
    if not weights:
        raise ParamError(f"{why}: no {' or '.join(ADAPTER_WEIGHTS)} in {folder}, so its KV "
                         "cannot be keyed by its weights")
    files = [os.path.join(folder, ADAPTER_CONFIG), weights[0]]
    files = [f for f in files if os.path.isfile(f)]
    try:
        sig = tuple(
            (f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
            for f, st in ((f, os.stat(f)) for f in files)
        )
        kept = ADAPTER_DIGESTS.get(folder)
        if kept is not None and kept[0] == sig:
            ADAPTER_DIGESTS.move_to_end(folder)
            return kept[1]
        digest = _adapter_digest(files)
    except OSError as e:
        raise ParamError(f"{why}: {e.strerror or e} reading {e.filename or folder}") from None
    ADAPTER_DIGESTS[folder] = (sig, digest)
    ADAPTER_DIGESTS.move_to_end(folder)
    while len(ADAPTER_DIGESTS) > MAX_ADAPTER_DIGESTS:
        ADAPTER_DIGESTS.popitem(last=False)
    return digest


def request_scope(request: Any) -> bytes:
    """Return what a vLLM request's KV depends on beyond the model and its token ids.

    Its LoRA adapter's content (``request.lora_request``: :func:`adapter_digest` of its
    files, not its name or runtime id) and its cache salt (``request.cache_salt``), as
    canonical JSON (keys sorted, no spaces, UTF-8), e.g. ``{"lora":"<64 hex
    digits>","salt":"tenant-a"}``; ``b""`` for a request with neither, whose chunks keep
    :func:`kvblend.chunk_hash`'s keys. Read by attribute, so any object with those
    attributes will do (no vLLM import).

    Raises
    ------
    ParamError
        The request's adapter cannot be keyed by its content (:func:`adapter_digest`):
        the request is served without kvblend.
    """
    scope: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        scope["lora"] = adapter_digest(lora)
    salt = getattr(request, "cache_salt", None)
    if salt:
        scope["salt"] = str(salt)
    if not scope:
        return b""
    return json.dumps(scope, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Parsed:
    """A request's parameters as the planner read them (no daemon asked yet).

    Attributes
    ----------
    ids : list of int
        The prompt.
    params : Params or None
        The request's segments (its own, or the configured separator's); None for a
        request without kvblend parameters (nor a separator in its prompt).
    blend : BlendConfig or None
        The settings to blend it with (the connector's, overridden by the request's);
        None when it is not one to blend: no blending configured, no segments (its own
        or the separator's), a store request, or ``"blend": false``.
    hashes : tuple of bytes
        The hash of each chunk segment of ``params`` within the request's scope
        (:func:`kvblend.scoped_chunk_hash`), in prompt order.
    by_separator : bool
        ``params`` came from the configured separator (the request named none): its
        chunks not found are stored on a miss.
    """

    ids: list[int]
    params: Params | None
    blend: BlendConfig | None = None
    hashes: tuple[bytes, ...] = ()
    by_separator: bool = False


def parse_request(
    kv_transfer_params: Any,
    prompt_ids: Sequence[int],
    num_computed: int,
    num_layers: int,
    separator: Sequence[int] | None = None,
    blend: BlendConfig | None = None,
    scope: bytes = b"",
) -> Parsed:
    """Parse a request's parameters and hash its chunks (the planner's first step).

    Parameters
    ----------
    kv_transfer_params : Any
        The request's ``kv_transfer_params``.
    prompt_ids : sequence of int
        The prompt.
    num_computed : int
        Tokens vLLM already has (its prefix cache; a blend computes them again but
        writes only what follows).
    num_layers : int
        The model's layers (bounds the check layers of a request's blend settings).
    separator : sequence of int, optional
        The configured chunk separator: a request without kvblend parameters is split
        by it (:func:`separator_params`), and blended with the connector's settings
        like a request that names its segments.
    blend : BlendConfig, optional
        The connector's blend settings; None: blending is not configured, and a
        request's own settings are ignored.
    scope : bytes, optional
        The request's scope (:func:`request_scope`); every chunk is hashed within it.

    Raises
    ------
    ParamError
        Malformed parameters (a request's blend settings included, when they apply).
    """
    ids = list(prompt_ids)
    kvp, override = split_override(kv_transfer_params)
    params = parse_params(kvp, len(ids))
    by_separator = False
    if params is None and separator:
        params = separator_params(ids, separator)  # no override: it has no kvblend key
        by_separator = params is not None
    config = None
    if blend is not None and params is not None and not params.store and override is not False:
        config = blend
        if override is not None:
            try:
                config = blend_settings(override, num_layers, blend, "kvblend.blend")
            except ValueError as e:
                raise ParamError(str(e)) from None
    hashes = (
        ()
        if params is None
        else tuple(scoped_chunk_hash(ids[s.start : s.end], scope) for s in chunk_segments(params))
    )
    return Parsed(ids, params, config, hashes, by_separator)


@dataclass
class Plan:
    """The planner's answer for one request.

    Attributes
    ----------
    tokens : int
        Tokens from ``num_computed`` on the connector provides (0: none).
    loads : list of ChunkLoad
        The chunk rows that fill them (plain reuse; empty for a blend).
    blend : BlendLoad or None
        The request's CacheBlend load instead of ``loads``.
    parsed : Parsed or None
        What the planner read (None when the parameters were malformed).
    """

    tokens: int = 0
    loads: list[ChunkLoad] = field(default_factory=list)
    blend: BlendLoad | None = None
    parsed: Parsed | None = None
    #: The chunk segments the daemon does not hold, as ``(hash, start, length)``.
    missing: list[tuple[bytes, int, int]] = field(default_factory=list)

    @property
    def first_inexact(self) -> int | None:
        """The first prompt position whose KV the load makes differ from a prefill.

        A chunk at position 0 is exact (it was stored prefilled alone from 0); a chunk
        anywhere else was not computed after what now precedes it, and every token
        after it attends to it. None when nothing is loaded or the load is exact: the
        blocks from this position's on must never be handed to another request by
        vLLM's prefix cache (:meth:`kvblend.vllm.scheduler.SchedulerSide` fences them).
        """
        if self.tokens <= 0:
            return None
        if self.blend is not None:
            starts = [int(pos) for ref, pos in self.blend.segments if not isinstance(ref, int)]
        else:
            starts = [c.start for c in self.loads]
        inexact = [p for p in starts if p > 0]
        return min(inexact) if inexact else None


def lookup_plan(
    client: Any, model_name: str, num_layers: int, parsed: Parsed, num_computed: int
) -> Plan:
    """Look a parsed request's chunks up (one lookup) and claim: a blend, or plain reuse.

    A request to blend (``parsed.blend``) claims every token from ``num_computed`` up to
    the end of the last stored chunk found, chunks not found becoming fresh tokens of its
    fuse session (so are the tokens vLLM already has, which the pass reads from vLLM's
    cache, or computes again where the metric has check layers, and does not write); it falls back to plain reuse, on the same lookup, when no chunk is
    found, a found chunk ends the prompt (vLLM must compute the last token), or vLLM
    already has every token up to the last chunk's end. Plain reuse claims as
    :func:`claim`.

    Parameters
    ----------
    client : kvblend.Client
        Connected to the daemon.
    model_name : str
        The model the chunks are stored under.
    num_layers : int
        The model's layers (a chunk stored with fewer is treated as missing).
    parsed : Parsed
        From :func:`parse_request`.
    num_computed : int
        Tokens vLLM already has.

    Raises
    ------
    KvblendError
        The lookup failed.
    """
    ids, params = parsed.ids, parsed.params
    if params is None:
        return Plan(parsed=parsed)
    segs = chunk_segments(params)
    if not segs:
        return Plan(parsed=parsed)
    hashes = parsed.hashes
    infos = client.lookup(model_name, list(hashes))
    found = [
        i.found and i.num_tokens == s.length and i.num_layers == num_layers
        for i, s in zip(infos, segs)
    ]
    missing = [(h, s.start, s.length) for s, h, ok in zip(segs, hashes, found) if not ok]
    if parsed.blend is not None:
        got = [(s, h) for s, h, ok in zip(segs, hashes, found) if ok]
        if got and num_computed < got[-1][0].end < len(ids):
            fuse, pos = [], 0
            for s, h in got:
                if s.start > pos:
                    fuse.append((s.start - pos, pos))
                fuse.append((h, s.start))
                pos = s.end
            qe = params.question_end
            question = ids[pos:qe] if qe is not None and qe > pos else ids[pos:]
            load = BlendLoad(ids[:pos], fuse, parsed.blend, question, num_computed)
            return Plan(pos - num_computed, [], load, parsed, missing)
    n, loads = claim(params, hashes, found, num_computed, len(ids))
    return Plan(n, loads, None, parsed, missing)


def plan_request(
    client: Any,
    model_name: str,
    num_layers: int,
    kv_transfer_params: Any,
    prompt_ids: Sequence[int],
    num_computed: int,
    separator: Sequence[int] | None = None,
    blend: BlendConfig | None = None,
    scope: bytes = b"",
) -> Plan:
    """Parse a request's parameters, look its chunks up, and claim (the scheduler's answer).

    :func:`parse_request`, then :func:`lookup_plan`: one parse, one hash of each chunk,
    one lookup.

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
        The configured chunk separator (:func:`parse_request`).
    blend : BlendConfig, optional
        The connector's blend settings (:func:`parse_request`).
    scope : bytes, optional
        The request's scope (:func:`request_scope`).

    Returns
    -------
    Plan
        ``tokens`` 0 for a request without kvblend parameters (nor a separator in its
        prompt), or none of whose chunks is found from ``num_computed`` on.

    Raises
    ------
    ParamError
        Malformed parameters.
    KvblendError
        The lookup failed.
    """
    parsed = parse_request(
        kv_transfer_params, prompt_ids, num_computed, num_layers, separator, blend, scope
    )
    return lookup_plan(client, model_name, num_layers, parsed, num_computed)
