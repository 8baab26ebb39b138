#!/usr/bin/env bash
# The Python client's tests (ctest: test_python): install client/python into a venv under
# BUILD_DIR/pyvenv, offline, and run pytest against that build's kvblendd and libkvblend.
#
# usage: run_tests.sh BUILD_DIR [PYTHON]   (PYTHON: default /usr/bin/python3, Debian's)
#
# Needs python3-venv, python3-pytest, python3-numpy and python3-setuptools (.ci/install-deps);
# no network: pip installs with --no-index --no-deps --no-build-isolation.
# An ASan-built libkvblend cannot be loaded into a Python that is not: libasan must come
# first, so the pytest process runs with it in LD_PRELOAD (and leak checking off, since
# Python's own allocations would all be reported); the daemon keeps the caller's ASAN_OPTIONS.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [PYTHON]" >&2; exit 2; }
build=$(cd "$1" && pwd)
py=${2:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
lib=$build/lib/libkvblend.so
daemon=$build/bin/kvblendd
venv=$build/pyvenv
for f in "$lib" "$daemon"; do
	[ -e "$f" ] || { echo "run_tests.sh: $f is missing; build first" >&2; exit 1; }
done

export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
[ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv"
# Build from a copy so that the checkout gets no build/ or egg-info.
stage=$build/pysrc
rm -rf "$stage"
mkdir -p "$stage"
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$stage/"
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$stage"

export KVBLEND_LIB=$lib KVBLENDD=$daemon
preload=
asan=$(ldd "$lib" | awk '/libasan/ { print $3; exit }')
if [ -n "$asan" ]; then
	echo "run_tests.sh: libkvblend is built with ASan: LD_PRELOAD=$asan for pytest"
	export KVBLEND_DAEMON_ASAN_OPTIONS=${ASAN_OPTIONS:-}
	export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 # the last one counts
	preload=$asan
fi

cd "$here"
start=$(date +%s)
set +e
LD_PRELOAD=$preload "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra tests
rc=$?
set -e
echo "run_tests.sh: pytest exited $rc after $(($(date +%s) - start)) s"
if [ "$rc" = 5 ]; then
	echo "run_tests.sh: pytest collected no tests" >&2
	exit 1
fi
exit "$rc"
