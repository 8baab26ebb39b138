"""kvblend.vllm.wait_for_stores against a real kvblendd (no engine).

A finished request that stores names its chunks in its response's ``kv_transfer_params``
(``kvblend.stores``: the model and the chunks' hashes); vLLM's worker stores them a few
seconds later. A client waits for them with wait_for_stores: it returns as soon as the
daemon holds every one, and at the deadline with the ones it still lacks. Importing
kvblend.vllm.documents imports neither torch nor vLLM.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import kvblend
from kvblend.vllm import wait_for_stores

#: Slack on a measured wait (a shared 2-core machine).
SLACK_S = 0.5


def params(model, hashes):
    """A finished request's kv_transfer_params, as the connector's scheduler returns it."""
    return {"kvblend": {"prompt_tokens": 40, "stored": 40 * len(hashes),
                        "stores": {"model": model, "chunks": [h.hex() for h in hashes]}}}


def put_later(endpoint, model, hashes, delay_s):
    """PUT each chunk delay_s after the last, on a thread (as the worker stores them)."""
    kv = np.ones(model.kv_shape(4), model.np_dtype)

    def run():
        with kvblend.Client(endpoint, timeout_ms=10000) as c:
            for h in hashes:
                time.sleep(delay_s)
                c.put(model.name, h, kv)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_returns_once_every_chunk_is_stored(daemon, model):
    hashes = [kvblend.chunk_hash([1, 2, 3, i]) for i in range(3)]
    t = put_later(daemon.endpoint, model, hashes, 0.3)
    t0 = time.monotonic()
    left = wait_for_stores(daemon.endpoint, params(model.name, hashes), timeout_s=30)
    took = time.monotonic() - t0
    t.join()
    assert left == []
    assert 0.9 - 0.05 <= took < 0.9 + SLACK_S  # the last PUT, not the deadline


def test_deadline_returns_what_is_missing(daemon, client, model):
    stored, never = kvblend.chunk_hash([7, 7, 1]), kvblend.chunk_hash([7, 7, 2])
    client.put(model.name, stored, np.ones(model.kv_shape(4), model.np_dtype))
    t0 = time.monotonic()
    left = wait_for_stores(client, params(model.name, [stored, never]), timeout_s=0.5)
    took = time.monotonic() - t0
    assert left == [never.hex()]
    assert 0.5 <= took < 0.5 + SLACK_S
    assert not client.closed  # a client handed in stays open


def test_nothing_to_wait_for(daemon):
    t0 = time.monotonic()
    for p in (None, {}, {"kvblend": {"prompt_tokens": 3, "stored": 0}},
              {"kvblend": {"stores": {"model": "m", "chunks": []}}}):
        assert wait_for_stores(daemon.endpoint, p, timeout_s=5) == []
    assert time.monotonic() - t0 < SLACK_S
