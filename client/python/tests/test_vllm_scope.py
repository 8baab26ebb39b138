"""kvblend.vllm.plan.request_scope: a LoRA adapter is keyed by its content (no engine).

A request's chunks are hashed within its scope (docs/vllm-reference.md, "Keys: adapter
and cache salt"). The adapter's part is a digest of the files vLLM loads it from, so two adapters
under the same name and id but with other weights never share KV, the same adapter finds
its KV wherever it was loaded from, and an adapter retrained in place gets a new scope.
Importing kvblend.vllm.plan imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace as Ns

import pytest

from kvblend.vllm import plan


def adapter(root: Path, name: str, weights: bytes, config: str = '{"r": 8}',
            weights_file: str = "adapter_model.safetensors") -> Path:
    """A LoRA adapter directory as PEFT writes it (vLLM reads these two files)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(config)
    (d / weights_file).write_bytes(weights)
    return d


def request(path: Path | str, name: str = "sql", int_id: int = 1, salt: str | None = None):
    """What request_scope reads of a vLLM Request (its LoRARequest's fields)."""
    lora = Ns(lora_name=name, lora_int_id=int_id, lora_path=str(path))
    return Ns(lora_request=lora, cache_salt=salt)


@pytest.fixture(autouse=True)
def fresh_cache():
    cache = getattr(plan, "ADAPTER_DIGESTS", {})
    cache.clear()
    yield
    cache.clear()


def test_same_name_and_id_other_weights(tmp_path):
    a = adapter(tmp_path, "a", b"weights of adapter a")
    b = adapter(tmp_path, "b", b"weights of adapter b")
    assert plan.request_scope(request(a)) != plan.request_scope(request(b))


def test_same_adapter_same_scope(tmp_path):
    a = adapter(tmp_path, "a", b"the weights")
    copy = adapter(tmp_path, "copy", b"the weights")
    s = plan.request_scope(request(a))
    assert plan.request_scope(request(a)) == s
    # the content, not the name, the id or the path: the same weights elsewhere, under
    # another name and id, are the same adapter
    assert plan.request_scope(request(copy, "other", 7)) == s
    # the adapter's digest, not its name or id, as canonical JSON
    scope = json.loads(s)
    assert set(scope) == {"lora"} and len(scope["lora"]) == 64
    assert b"sql" not in s
    both = json.loads(plan.request_scope(request(a, salt="tenant-a")))
    assert both == {"lora": scope["lora"], "salt": "tenant-a"}


def test_adapter_config_is_part_of_it(tmp_path):
    # lora_alpha scales the adapter's delta: the same tensors under another config
    a = adapter(tmp_path, "a", b"w", '{"r": 8, "lora_alpha": 16}')
    b = adapter(tmp_path, "b", b"w", '{"r": 8, "lora_alpha": 32}')
    assert plan.request_scope(request(a)) != plan.request_scope(request(b))


def test_retrained_adapter_gets_a_new_scope(tmp_path):
    a = adapter(tmp_path, "a", b"epoch 1 weights.")
    s1 = plan.request_scope(request(a))
    w = a / "adapter_model.safetensors"
    st = w.stat()
    # rewritten in place: the same size, and even its mtime put back (cp -p, rsync -t)
    w.write_bytes(b"epoch 2 weights.")
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    s2 = plan.request_scope(request(a))
    assert s2 != s1
    # replaced by a rename (how trainers and rsync write): another file
    tmp = a / "new.tmp"
    tmp.write_bytes(b"epoch 3 weights, longer")
    tmp.replace(w)
    s3 = plan.request_scope(request(a))
    assert s3 not in (s1, s2)
    assert plan.request_scope(request(a)) == s3


def test_digest_computed_once_per_version(tmp_path, monkeypatch):
    a = adapter(tmp_path, "a", b"w" * 4096)
    reads = []
    digest = plan._adapter_digest
    monkeypatch.setattr(plan, "_adapter_digest",
                        lambda files: reads.append(files) or digest(files))
    s = plan.request_scope(request(a))
    for _ in range(5):
        assert plan.request_scope(request(a)) == s
    assert len(reads) == 1  # later requests stat the files, they do not read them
    (a / "adapter_model.safetensors").write_bytes(b"v" * 4097)
    assert plan.request_scope(request(a)) != s
    assert len(reads) == 2


def test_bin_weights_and_home_relative_path(tmp_path, monkeypatch):
    a = adapter(tmp_path, "a", b"torch pickle", weights_file="adapter_model.bin")
    s = plan.request_scope(request(a))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert plan.request_scope(request("~/a")) == s
    monkeypatch.chdir(tmp_path)
    assert plan.request_scope(request("a")) == s


def test_unreadable_adapter_is_served_without_kvblend(tmp_path):
    # no weights file there (or a hub id never downloaded here): the request cannot be
    # keyed by its adapter's content, so it is planned as plain vLLM (ParamError)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    for path in (empty, tmp_path / "missing", "someone/not-downloaded-adapter"):
        with pytest.raises(plan.ParamError, match="LoRA adapter 'sql'"):
            plan.request_scope(request(path))


def test_no_adapter(tmp_path):
    assert plan.request_scope(Ns(lora_request=None, cache_salt=None)) == b""
    assert plan.request_scope(Ns(lora_request=None, cache_salt="t")) == b'{"salt":"t"}'
