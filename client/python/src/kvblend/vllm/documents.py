"""Chunks stored from vLLM itself: documents prefilled alone, their KV kept by kvblendd.

What a request's ``"chunk"`` segments then refer to (docs/vllm.md, "Storing chunks").
"""

from __future__ import annotations

from typing import Any

from ..client import chunk_hash


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
