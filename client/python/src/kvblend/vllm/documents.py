"""Chunks stored from vLLM itself: documents prefilled alone, their KV kept by kvblendd.

What a request's ``"chunk"`` segments then refer to (docs/vllm-reference.md, "Request parameters").
:func:`wait_for_stores` waits until kvblendd holds what a finished request stores (a
client of vLLM's OpenAI server can call it: no torch or vLLM import).
"""

from __future__ import annotations

import time
from typing import Any

from ..client import Client, chunk_hash


def wait_for_stores(
    daemon: str | Client,
    kv_transfer_params: dict | None,
    timeout_s: float = 60.0,
    interval_s: float = 0.1,
) -> list[str]:
    """Wait until kvblendd holds the chunks a finished request stores; return those it lacks.

    A request that stores (with ``store``, or a separator-split one that missed chunks)
    says which chunks in its response's ``kv_transfer_params``: ``{"kvblend": {...,
    "stores": {"model": NAME, "chunks": [HEX, ...]}}}``. vLLM's worker stores them between
    its steps, a few seconds later on a busy engine; this looks them up every
    ``interval_s`` until every one is stored or ``timeout_s`` has passed.

    Parameters
    ----------
    daemon : str or Client
        The kvblendd the engine's connector uses (its ``endpoint``), or a client of it.
    kv_transfer_params : dict or None
        The response's ``kv_transfer_params`` (the ``openai`` package keeps it as the
        response's attribute of that name; vLLM's offline API as
        ``RequestOutput.kv_transfer_params``). Streamed responses carry none.
    timeout_s, interval_s : float
        The longest wait, and the pause between two lookups (seconds).

    Returns
    -------
    list of str
        The hex hashes of the chunks still not stored at the deadline: ``[]`` when all
        are (and for a request that stores nothing).

    Raises
    ------
    KvblendError
        The daemon could not be asked.
    """
    kb = (kv_transfer_params or {}).get("kvblend") or {}
    stores = kb.get("stores") or {}
    model, left = stores.get("model"), list(stores.get("chunks") or [])
    if not model or not left:
        return []
    client = Client(daemon) if isinstance(daemon, str) else daemon
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            found = client.lookup(model, left)
            left = [h for h, info in zip(left, found) if not info.found]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    finally:
        if client is not daemon:
            client.close()


def store_documents(llm: Any, docs: list[list[int]] | list[str]) -> list[bytes]:
    """Prefill each document alone with ``store`` set, so that kvblendd holds its KV.

    Parameters
    ----------
    llm : vllm.LLM
        An engine running :class:`KvblendConnector`.
    docs : list of token-id lists, or list of str
        Strings are tokenized with the engine's tokenizer, without special tokens.

    Returns
    -------
    list of bytes
        Each document's chunk hash (what a later request's segments refer to).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = None
    id_lists = []
    for d in docs:
        if isinstance(d, str):
            tok = tok or llm.get_tokenizer()
            d = tok.encode(d, add_special_tokens=False)
        id_lists.append([int(t) for t in d])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in id_lists]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=1,
            extra_args={
                "kv_transfer_params": {
                    "kvblend": {"segments": [[0, len(ids), "chunk"]], "store": True}
                }
            },
        )
        for ids in id_lists
    ]
    llm.generate(prompts, params, use_tqdm=False)
    return [chunk_hash(ids) for ids in id_lists]
