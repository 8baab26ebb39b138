"""docs/vllm.md's "A RAG service in five minutes", run as written (ctest test_vllm_serve).

Run with the engine venv's python (.ci/engine-env; tests/engine/run.sh sets KVBLEND_LIB,
KVBLENDD and KVBLEND_ENGINE_MODEL).

The fenced block after each ``<!-- test_vllm_serve: NAME -->`` comment of docs/vllm.md
(``env``, ``daemon``, ``server``, ``client``) is run unchanged; only the variables the
``env`` block reads are set here: VENV (this python's venv), MODEL
($KVBLEND_ENGINE_MODEL), KVBLENDD ($KVBLENDD), RAG_DIR (a temporary directory), PORT (a
free port). kvblend reaches vLLM's processes as the docs' ``uv pip install
./client/python`` puts it there, as a package with its ``vllm.general_plugins`` entry
point: pip-installed into a temporary folder on PYTHONPATH (eval/engine_setup.py's
install_package, without the library: $KVBLEND_LIB names the build's).

(a) the daemon block starts kvblendd, which answers a ping on the socket;
(b) the server block starts the OpenAI server with the connector (one engine start):
    /health answers 200, and its log has the connector's start lines (the separator's
    token ids, the scheduler side on the daemon's endpoint);
(c) the client block runs: two chat completions with separators, each answered, each
    response carrying ``kv_transfer_params.kvblend`` with its six counts; the same
    prompt length for both; the second, sharing the system prompt, has
    ``prefix_cached`` > 0;
(d) check_store_and_blend: the first request stores its documents on a miss and names
    their chunks (``stores``: the model and three hashes), the client's wait for them
    (kvblend.vllm.wait_for_stores) ends with every one stored, and the reordered second
    request is blended;
(e) a plain chat request (no separator) twice: the same greedy answer both times, the
    second from vLLM's prefix cache, nothing reused, blended or stored; the client's
    prompt opted out with ``extra_body={"kv_transfer_params": {"kvblend": {"segments":
    []}}}`` is plain vLLM too.
Everything started is killed at the end (process groups), pass or fail.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

HERE = Path(__file__).resolve().parent
DOC = HERE.parent.parent / "docs" / "vllm.md"
BLOCKS = ("env", "daemon", "server", "client")
COUNTS = ("prompt_tokens", "prefix_cached", "reused", "blended", "computed", "stored")
# An engine start takes 1-3 min on the shared 2-core machine, more under load.
START_TIMEOUT = 600


class Failed(Exception):
    pass


def fail(msg):
    raise Failed(msg)


def doc_blocks(text):
    """Return {name: code} for each fenced block after a test_vllm_serve marker."""
    found = {}
    pat = re.compile(r"<!-- test_vllm_serve: (\w+) -->\n```\w*\n(.*?)\n```\n", re.S)
    for m in pat.finditer(text):
        if m.group(1) in found:
            fail(f"docs/vllm.md: two blocks marked {m.group(1)!r}")
        found[m.group(1)] = m.group(2) + "\n"
    missing = [b for b in BLOCKS if b not in found]
    if missing:
        fail(f"docs/vllm.md: no block marked {missing} (a fence right after the comment)")
    return found


def wait_health(port, server):
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if not server.alive():
            fail(f"(b) the server exited ({server.proc.returncode}):\n{server.tail(60)}")
        if time.monotonic() - t0 > START_TIMEOUT:
            fail(f"(b) no /health after {START_TIMEOUT} s:\n{server.tail(60)}")
        time.sleep(2)


def said(params, what):
    """The kvblend counts of a response's kv_transfer_params, checked for shape."""
    kb = (params or {}).get("kvblend")
    if not isinstance(kb, dict) or any(not isinstance(kb.get(k), int) for k in COUNTS):
        fail(f"{what}: no kvblend counts in kv_transfer_params: {params}")
    if kb["prompt_tokens"] <= 0:
        fail(f"{what}: prompt_tokens {kb['prompt_tokens']}")
    return kb


def check_store_and_blend(responses, waited):
    """(d) store on a miss, the client's wait, then a blend of the reordered documents.

    ``responses`` are the client's two ``kvblend`` dicts, in order: the first request
    misses every document and queues them to be stored (``stored`` > 0), naming their
    chunks (``stores``); ``waited`` the client's line after its wait for them; the second,
    the same documents in another order, finds them and is blended (``blended`` > 0).
    """
    if responses[0]["stored"] <= 0:
        fail(f"(d) the first request stored nothing on a miss: {responses[0]}")
    stores = responses[0].get("stores") or {}
    if stores.get("model") != "vllm:smollm2:f32" or len(stores.get("chunks") or []) != 3:
        fail(f"(d) the first request does not name its three documents' chunks: {stores}")
    if waited != ["stored: every document"]:
        fail(f"(d) the client's wait for the stores: {waited}")
    if responses[1]["blended"] <= 0:
        fail(f"(d) the reordered second request was not blended: {responses[1]}")
    print(f"  (d) the first request stored {responses[0]['stored']} tokens on a miss (3 "
          f"chunks named), the client waited until kvblendd held them, the second blended "
          f"{responses[1]['blended']}")


def run_client(block, env, tmp):
    path = Path(tmp) / "rag.py"
    path.write_text(block)
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode:
        fail(f"(c) the client failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}")
    out = []
    for line in r.stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    if len(out) != 2:
        fail(f"(c) expected two kv_transfer_params lines from the client:\n{r.stdout}")
    waited = [ln for ln in r.stdout.splitlines() if ln.startswith("stored:")]
    answers = [ln for ln in r.stdout.splitlines()
               if not ln.startswith("{") and not ln.startswith("stored:")]
    return [said(p, f"(c) request {i + 1}") for i, p in enumerate(out)], answers, waited


def plain_requests(port):
    """(e) through the openai package, as the docs' client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    system = ("You are the assistant of a small library's help desk. Answer in one short "
              "sentence, only from what the visitor's message says. " * 4)

    def chat(user, **kw):
        r = client.chat.completions.create(
            model="smollm2", max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            **kw)
        return r.choices[0].message.content, r.kv_transfer_params

    question = "Where is the reading room, and when does it open on Mondays?"
    a1, p1 = chat(question)
    a2, p2 = chat(question)
    k1, k2 = said(p1, "(e) plain request"), said(p2, "(e) plain request, again")
    if not a1 or a1 != a2:
        fail(f"(e) the same greedy request answered differently: {a1!r} vs {a2!r}")
    if k2["prefix_cached"] <= 0:
        fail(f"(e) the repeated plain request found nothing in vLLM's prefix cache: {k2}")
    for k in (k1, k2):
        if k["reused"] or k["blended"] or k["stored"]:
            fail(f"(e) a request without the separator was not plain vLLM: {k}")
        if k["computed"] != k["prompt_tokens"] - k["prefix_cached"]:
            fail(f"(e) computed does not add up: {k}")
    sep = "<|endoftext|>"
    user = "Answer the question from these documents." + sep + "A document." + sep + question
    _, p3 = chat(user, extra_body={"kv_transfer_params": {"kvblend": {"segments": []}}})
    k3 = said(p3, "(e) opted-out request")
    if k3["reused"] or k3["blended"] or k3["stored"]:
        fail(f"(e) the opted-out request was not plain vLLM: {k3}")
    print(f"  (e) plain request: the same answer twice ({a1!r}), the second "
          f"{k2['prefix_cached']} of {k2['prompt_tokens']} tokens from the prefix cache; "
          f"opted out with extra_body: {k3}")


def test_vllm_serve():
    t_all = time.monotonic()
    blocks = doc_blocks(DOC.read_text())
    for var in ("KVBLEND_LIB", "KVBLENDD", "KVBLEND_ENGINE_MODEL"):
        if not os.environ.get(var):
            fail(f"${var} is not set (run through tests/engine/run.sh)")
    from kvbtest import Group, free_port, install_temp, wait_for_daemon

    tmp, site = install_temp("kvblend-serve.")
    port = free_port()
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent),
               MODEL=os.environ["KVBLEND_ENGINE_MODEL"], KVBLENDD=os.environ["KVBLENDD"],
               RAG_DIR=f"{tmp}/rag", PORT=str(port), PYTHONPATH=str(site),
               # a crash of the server's processes prints every thread's Python stack to
               # its log, which a failure prints (it failed once in CI: the server gone
               # during the first request, its log lost with the machine)
               PYTHONFAULTHANDLER="1")
    started, ok = [], False
    try:
        daemon = Group(["bash", "-euc", blocks["env"] + blocks["daemon"]],
                       Path(tmp) / "daemon.log", env)
        started.append(daemon)
        try:
            wait_for_daemon(f"ipc://{tmp}/rag/kvblend.sock", daemon.alive)
        except RuntimeError as e:
            fail(f"(a) {e}:\n{daemon.tail()}")
        print("  (a) kvblendd started by the docs' daemon block answers on "
              "ipc://$RAG_DIR/kvblend.sock")

        server = Group(["bash", "-euc", blocks["env"] + blocks["server"]],
                       Path(tmp) / "server.log", env)
        started.append(server)
        secs = wait_health(port, server)
        log = server.log_path.read_text(errors="replace")
        for want in ("kvblend: chunk_separator_text '<|endoftext|>' is the token ids [0]",
                     f"kvblend: connector (SCHEDULER) on ipc://{tmp}/rag/kvblend.sock"):
            if want not in log:
                fail(f"(b) the server log lacks {want!r}:\n{server.tail(60)}")
        print(f"  (b) the docs' server block serves /health after {secs:.0f} s, the "
              "connector started with the separator <|endoftext|> = [0]")

        responses, answers, waited = run_client(blocks["client"], env, tmp)
        first, second = responses
        if first["prompt_tokens"] != second["prompt_tokens"]:
            fail(f"(c) the reordered documents tokenize to another length: {responses}")
        if second["prefix_cached"] <= 0:
            fail(f"(c) the second request found nothing in vLLM's prefix cache: {second}")
        # a chunk stored with rows that are not finite makes every request loading it
        # answer <|endoftext|> at once (NaN logits): an empty answer
        if len(answers) != 2 or not all(a.strip() for a in answers):
            fail(f"(c) an empty answer (NaN logits from a stored chunk?): {answers}")
        print(f"  (c) the docs' client: two answers {answers}; kv_transfer_params "
              f"{json.dumps(first)}, then {json.dumps(second)}")
        check_store_and_blend(responses, waited)
        plain_requests(port)
        ok = True
    except Failed as e:
        print(f"FAIL: {e}")
        # the logs are gone with a CI machine: say what the server and the daemon said last
        for s in started:
            print(f"--- the last lines of {s.log_path.name} ---\n{s.tail(80)}")
    finally:
        for s in reversed(started):
            s.stop()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}")
    print(f"test_vllm_serve: {'ok' if ok else 'FAILED'} in {time.monotonic() - t_all:.0f} s")
    assert ok, "test_vllm_serve failed (above: what failed, the logs' last lines)"
