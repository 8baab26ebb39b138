#!/bin/sh
# libkvblend's exports against its header (the ABI policy at the top of kvblend.h):
# every KVB_API function of the header is exported, bound to a KVBLEND_* version node,
# and nothing else is exported at all (no internal kvbc_*/kvbp_* symbol, no unversioned
# one). Usage: check_exports.sh LIBKVBLEND.so KVBLEND.H
set -eu
lib=$1
header=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

grep '^KVB_API' "$header" | grep -o 'kvb_[a-z0-9_]*(' | tr -d '(' | sort -u >"$tmp/declared"
# "ADDR TYPE NAME@@NODE"; the nodes themselves appear as absolute (A) symbols.
nm -D --defined-only "$lib" | awk '$2 != "A" { print $3 }' | sort >"$tmp/exported"
nm -D --defined-only "$lib" | awk '$2 == "A" { print $3 }' >"$tmp/nodes"

bad=$(grep -v '^kvb_[a-z0-9_]*@@\?KVBLEND_[0-9.]*$' "$tmp/exported" || true)
if [ -n "$bad" ]; then
	echo "FAIL exported beyond the kvb_* functions, or without a KVBLEND_* version:"
	echo "$bad" | sed 's/^/  /'
	fail=1
fi
sed 's/@.*//' "$tmp/exported" | sort -u >"$tmp/names"
missing=$(comm -23 "$tmp/declared" "$tmp/names")
if [ -n "$missing" ]; then
	echo "FAIL declared in kvblend.h but not exported (kvblend.map?):"
	echo "$missing" | sed 's/^/  /'
	fail=1
fi
extra=$(comm -13 "$tmp/declared" "$tmp/names")
if [ -n "$extra" ]; then
	echo "FAIL exported but not declared KVB_API in kvblend.h:"
	echo "$extra" | sed 's/^/  /'
	fail=1
fi
if ! grep -q '^KVBLEND_[0-9.]*$' "$tmp/nodes"; then
	echo "FAIL no KVBLEND_* version node in $lib"
	fail=1
fi
[ $fail = 0 ] && echo "ok: $(wc -l <"$tmp/declared") functions, all exported as" \
	"$(tr '\n' ' ' <"$tmp/nodes")and nothing else"
exit $fail
