#!/usr/bin/env bash
# The package as a user installs it (ctest: test_pip_install, label package): a fresh venv,
# `pip install --no-build-isolation ./client/python` from the checkout, which builds
# libkvblend with CMake and bundles it; then, in a clean environment (no KVBLEND_LIB, cwd
# outside the checkout), `import kvblend` loads the bundled library, which carries the
# KVBLEND_1 symbol versions, and a PUT and GET of a small chunk round-trip through a
# kvblendd this script starts. An explicit $KVBLEND_LIB still wins over the bundled copy.
#
# usage: test_install.sh BUILD_DIR SOURCE_DIR [PYTHON]   (PYTHON: default /usr/bin/python3)
#
# Offline: the venv sees the system's numpy (--system-site-packages), pip has no index.
# It removes client/python/build/ (what a previous install left there, ignored by git) so
# that the install it times builds libkvblend from nothing.
set -u
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR SOURCE_DIR [PYTHON]" >&2; exit 2; }
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd)
py=${3:-/usr/bin/python3}
daemon=$build/bin/kvblendd
[ -x "$daemon" ] || { echo "test_install.sh: $daemon is missing; build first" >&2; exit 1; }
pass=0 failed=0
ok() { pass=$((pass + 1)); echo "ok - $1"; }
bad() { failed=$((failed + 1)); echo "not ok - $1"; [ -n "${2:-}" ] && echo "# $2"; }
tmp=$(mktemp -d /tmp/kvb-pip-XXXXXX)
dpid=
cleanup() {
	[ -n "$dpid" ] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT

venv=$tmp/venv
"$py" -m venv --system-site-packages "$venv" || { bad "python3 -m venv"; exit 1; }
rm -rf "$src/client/python/build"
start=$(date +%s.%N)
if (cd "$src" && env -u KVBLEND_LIB PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
	"$venv/bin/python" -m pip install -v --no-build-isolation ./client/python) \
	>"$tmp/pip.log" 2>&1; then
	secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
	ok "pip install --no-build-isolation ./client/python ($secs s)"
else
	bad "pip install --no-build-isolation ./client/python" "$(tail -40 "$tmp/pip.log")"
	echo "$pass passed, $failed failed"
	exit 1
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
bundled=$site/kvblend/_libs/libkvblend.so.1
if [ -f "$bundled" ]; then
	ok "the package holds kvblend/_libs/libkvblend.so.1"
else
	bad "the package holds kvblend/_libs/libkvblend.so.1" "$(find "$site/kvblend" | head -20)"
fi
# Every KVB_API function, each bound to KVBLEND_1, as in the build's library (test_abi).
n=$(readelf --dyn-syms -W "$bundled" 2>/dev/null | grep -c ' kvb_[a-z0-9_]*@@KVBLEND_1$')
want=$(readelf --dyn-syms -W "$build/lib/libkvblend.so" 2>/dev/null |
	grep -c ' kvb_[a-z0-9_]*@@KVBLEND_1$')
if [ "$n" -gt 0 ] && [ "$n" = "$want" ]; then
	ok "bundled library exports $n kvb_* functions at KVBLEND_1"
else
	bad "bundled library's KVBLEND_1 symbols" "$n in the bundled library, $want in the build's"
fi
soname=$(readelf -d "$bundled" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libkvblend.so.1 ] && ok "soname $soname" || bad "soname" "'$soname'"

mkdir -p "$tmp/data" "$tmp/cwd"
endpoint=ipc://$tmp/kvblend.sock
"$daemon" --data-dir "$tmp/data" --listen "$endpoint" --map-size 256M >"$tmp/kvblendd.log" 2>&1 &
dpid=$!

# A clean environment: no KVBLEND_LIB, no PYTHONPATH, cwd outside the checkout.
clean() { (cd "$tmp/cwd" && env -i PATH=/usr/bin:/bin HOME="$tmp" LANG=C.UTF-8 "$@"); }
cat >"$tmp/roundtrip.py" <<'EOF'
import sys
import time

import numpy as np

import kvblend

expect, endpoint = sys.argv[1], sys.argv[2]
print("library_path", kvblend.library_path)
assert kvblend.library_path == expect, (kvblend.library_path, expect)
deadline = time.monotonic() + 20
while True:
    try:
        c = kvblend.Client(endpoint, timeout_ms=500)
        break
    except kvblend.Unavailable:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
with c:
    m = kvblend.Model("pkgtest", num_layers=2, num_kv_heads=2, head_dim=8, dtype="f32")
    c.model_register(m)
    h = kvblend.chunk_hash([1, 2, 3, 4, 5])
    kv = np.random.default_rng(21).standard_normal((2, 2, 5, 2, 8)).astype(np.float32)
    assert c.put("pkgtest", h, kv) is False
    got = c.get("pkgtest", h)
    assert np.array_equal(got, kv), "GET returned other bytes than PUT stored"
print("round trip ok")
EOF
if out=$(clean "$venv/bin/python" "$tmp/roundtrip.py" "$bundled" "$endpoint" 2>&1); then
	ok "clean environment: import kvblend loads the bundled library; PUT/GET round trip"
else
	bad "clean environment: bundled library and round trip" "$out
$(tail -20 "$tmp/kvblendd.log")"
fi
# $KVBLEND_LIB, when set, is final: the build's library instead, and a wrong path fails.
lib=$build/lib/libkvblend.so
check='import kvblend, sys; assert kvblend.library_path == sys.argv[1], kvblend.library_path'
if out=$(clean KVBLEND_LIB="$lib" "$venv/bin/python" -c "$check" "$lib" 2>&1); then
	ok "KVBLEND_LIB wins over the bundled library"
else
	bad "KVBLEND_LIB wins over the bundled library" "$out"
fi
if out=$(clean KVBLEND_LIB=/nonexistent/libkvblend.so "$venv/bin/python" -c 'import kvblend' \
	2>&1); then
	bad "a wrong KVBLEND_LIB fails" "import succeeded"
else
	echo "$out" | grep -q 'cannot load libkvblend' && ok "a wrong KVBLEND_LIB fails, not falls back" ||
		bad "a wrong KVBLEND_LIB fails" "$out"
fi

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
