"""What running kvblend inside vLLM needs besides a kvblendd (eval/harness.py starts
that): the package installed as vLLM's processes see it, and vLLM's engine with kvblend's
connector.

:func:`install_package` pip-installs client/python into a folder, so that vLLM's
processes find kvblend's ``vllm.general_plugins`` entry point (the blend pass needs the
model it hands over). Used by eval/run_vllm.py, bench/ and the engine tests (through
tests/harness/kvbtest.py): tests import eval/, never the reverse.
"""

import os
import subprocess
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "client" / "python"
#: The entry point the installed package must carry.
ENTRY_POINT = "kvblend.vllm.plugin:register"


def install_package(target):
    """Pip install client/python into the folder target; return its entry_points.txt text.

    As client/python/test_install.sh does: pip of a venv over Debian's python3 (its
    setuptools and wheel), offline, without build isolation; KVBLEND_BUNDLE=0 (no
    library build: $KVBLEND_LIB names the build's).

    Raises
    ------
    RuntimeError
        pip failed, or the installed package lacks the ``vllm.general_plugins`` entry
        point :data:`ENTRY_POINT`.
    """
    env = dict(os.environ, KVBLEND_BUNDLE="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="kvblend-src.") as tmp:
        src, venv = Path(tmp) / "src", Path(tmp) / "venv"
        src.mkdir()
        # A copy of the package without build/ (a bundled build there is not wanted here).
        subprocess.run(["cp", "-r", str(PACKAGE / "pyproject.toml"), str(PACKAGE / "setup.py"),
                        str(PACKAGE / "README.md"), str(PACKAGE / "src"), str(src)], check=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                            "--no-deps", "--no-index", "--no-build-isolation", "--target",
                            str(target), str(src)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install failed:\n{r.stdout}\n{r.stderr}")
    eps = list(Path(target).glob("kvblend-*.dist-info/entry_points.txt"))
    if not eps:
        raise RuntimeError("the installed package has no entry_points.txt")
    text = eps[0].read_text()
    if "[vllm.general_plugins]" not in text or ENTRY_POINT not in text:
        raise RuntimeError(f"entry point missing:\n{text}")
    return text


def connector_transfer(extra):
    """vLLM's KVTransferConfig for kvblend's connector (KvblendConnector of kvblend.vllm,
    storing and loading) with ``extra`` as its kv_connector_extra_config."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KvblendConnector",
                            kv_connector_module_path="kvblend.vllm", kv_role="kv_both",
                            kv_connector_extra_config=extra)


def connector_llm(model, extra, dtype="float32", **options):
    """vLLM's offline engine (vllm.LLM) over the model folder ``model`` with kvblend's
    connector configured by ``extra`` (:func:`connector_transfer`), eager, seed 0, in
    ``dtype``, as kvblend's tests, evaluation and benchmarks run it; ``options`` are the
    rest of LLM's arguments (max_model_len, enable_prefix_caching, ...)."""
    from vllm import LLM

    return LLM(model=model, enforce_eager=True, dtype=dtype, seed=0,
               kv_transfer_config=connector_transfer(extra), **options)
