#!/usr/bin/env bash
# End-to-end test of the kvblend CLI against a real kvblendd, with NumPy as the
# independent reference for .npy files and the chunk hash.
# usage: test_cli.sh KVBLENDD KVBLEND PYTHON
set -u
KVBLENDD=$1 KVBLEND=$2 PY=$3
dir=$(mktemp -d /tmp/kvb-cli-XXXXXX)
export KVBLEND_ENDPOINT=ipc://$dir/kvblend.sock
pass=0 failed=0
daemon_pid=

cleanup() {
	[ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null
	[ -z "${KVB_KEEP_TMP:-}" ] && rm -rf "$dir"
}
trap cleanup EXIT

ok() { pass=$((pass + 1)); echo "ok - $1"; }
bad() { failed=$((failed + 1)); echo "not ok - $1"; [ -n "${2:-}" ] && echo "# $2"; }

# check NAME EXPECTED_STATUS STDERR_SUBSTRING -- command...
check() {
	local name=$1 want=$2 substr=$3
	shift 4
	local out err st
	out=$("$@" 2>"$dir/err"); st=$?
	err=$(cat "$dir/err")
	if [ "$st" != "$want" ]; then
		bad "$name" "exit $st, wanted $want; stderr: $err"
	elif [ -n "$substr" ] && [[ "$err$out" != *"$substr"* ]]; then
		bad "$name" "output lacks '$substr': $err $out"
	elif [ "$want" != 0 ] && [ "$(printf '%s' "$err" | wc -l)" -gt 0 ]; then
		bad "$name" "error is more than one line: $err"
	else
		ok "$name"
	fi
}

start_daemon() {
	"$KVBLENDD" --data-dir "$dir/data" --listen "$KVBLEND_ENDPOINT" --map-size 1G \
		--log-level debug >>"$dir/kvblendd.log" 2>&1 &
	daemon_pid=$!
	for _ in $(seq 100); do
		"$KVBLEND" --timeout 200 ping >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "kvblendd did not start"; cat "$dir/kvblendd.log"; exit 1
}

stop_daemon() {
	kill -TERM "$daemon_pid"
	if wait "$daemon_pid"; then ok "daemon exits 0 on SIGTERM"; else bad "daemon exit status $?"; fi
	daemon_pid=
}

# Help needs no daemon.
check "command --help" 0 "usage: kvblend" -- "$KVBLEND" --timeout 300 put --help
check "kvblendd --help" 0 "--map-size SIZE" -- "$KVBLENDD" --help
# kvblend --help names every command the CLI accepts.
help=$("$KVBLEND" --help 2>&1)
for cmd in ping stats "model add" "model ls" put get get-rerotated ls lookup rm pin unpin fuse \
	hash keygen demo; do
	if [[ "$help" == *"  $cmd "* ]]; then ok "--help lists $cmd"; else bad "--help lists $cmd" "$help"; fi
done

# An unreachable daemon is a one-line error and a non-zero exit.
check "unreachable daemon" 1 "no reply from kvblendd" -- "$KVBLEND" --timeout 300 ping

start_daemon
check "ping" 0 "kvblendd" -- "$KVBLEND" ping
check "model add" 0 "registered model m7" -- "$KVBLEND" model add m7 --layers 3 --kv-heads 2 \
	--head-dim 8 --dtype f16 --rope-theta 10000 --rope-style gptj --rope-scaling llama3:8,1,4,8192
check "model add again" 0 "already registered" -- "$KVBLEND" model add m7 --layers 3 \
	--kv-heads 2 --head-dim 8 --dtype f16 --rope-theta 10000 --rope-style gptj \
	--rope-scaling llama3:8,1,4,8192
check "model add conflict" 1 "different layout" -- "$KVBLEND" model add m7 --layers 4 \
	--kv-heads 2 --head-dim 8 --dtype f16 --rope-theta 10000
check "model add bad scaling" 2 "--rope-scaling" -- "$KVBLEND" model add m8 --layers 4 \
	--kv-heads 2 --head-dim 8 --dtype f16 --rope-theta 10000 --rope-scaling yarn:4
check "model add bf16" 0 "registered" -- "$KVBLEND" model add mb --layers 2 --kv-heads 1 \
	--head-dim 4 --dtype bf16 --rope-theta 500000
check "model ls" 0 "rope_scaling=llama3:8,1,4,8192" -- "$KVBLEND" model ls

"$PY" - "$dir" <<'PYEOF'
import sys, numpy as np
d = sys.argv[1]
rng = np.random.default_rng(7)
kv = rng.standard_normal((3, 2, 37, 2, 8)).astype('<f2')
kv[..., 3] *= 30  # a few large-magnitude channels, as in real KV
np.save(f"{d}/kv.npy", kv)
np.save(f"{d}/ids.npy", np.arange(1000, 1037, dtype=np.int64))
with open(f"{d}/ids.txt", "w") as f:
    f.write(" ".join(str(i) for i in range(1000, 1037)) + "\n")
np.save(f"{d}/kv_f32.npy", kv.astype('<f4'))
np.save(f"{d}/kv_badshape.npy", kv[:, :, :, :, :4].copy())
bf = rng.integers(0, 65535, size=(2, 2, 5, 1, 4), dtype=np.uint16)
np.save(f"{d}/kv_bf16.npy", bf.astype('<u2'))
open(f"{d}/garbage.npy", "wb").write(b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f2'")
import hashlib
h = hashlib.blake2b(np.arange(1000, 1037).astype('<u4').tobytes(), digest_size=32).hexdigest()
open(f"{d}/expected_hash", "w").write(h)
PYEOF
want=$(cat "$dir/expected_hash")

check "hash matches hashlib.blake2b" 0 "$want" -- "$KVBLEND" hash --tokens "$dir/ids.npy"
check "hash from text ids" 0 "$want" -- "$KVBLEND" hash --tokens "$dir/ids.txt"
# from a pipe: the bytes read to look for a .npy header must not be lost
check "hash from text ids on a pipe" 0 "$want" -- bash -c "cat '$dir/ids.txt' | '$KVBLEND' hash --tokens /dev/stdin"
check "a .npy on a pipe is refused, named" 1 "must be a file, not a pipe" -- \
	bash -c "cat '$dir/ids.npy' | '$KVBLEND' hash --tokens /dev/stdin"
check "put --tokens" 0 "$want" -- "$KVBLEND" put --model m7 --kv "$dir/kv.npy" \
	--tokens "$dir/ids.npy" --pos 12
check "put again is a no-op" 0 "already stored" -- "$KVBLEND" put --model m7 --kv "$dir/kv.npy" \
	--tokens "$dir/ids.txt"
check "get" 0 "37 tokens at base_pos 12" -- "$KVBLEND" get --model m7 --hash "$want" \
	--out "$dir/back.npy"
check "get layers 1:3" 0 "layers 1:3" -- "$KVBLEND" get --model m7 --hash "$want" \
	--layers 1:3 --out "$dir/back13.npy"
if "$PY" -c "
import numpy as np, sys
a = np.load('$dir/kv.npy'); b = np.load('$dir/back.npy'); c = np.load('$dir/back13.npy')
assert b.dtype == np.dtype('<f2') and b.shape == a.shape, (b.dtype, b.shape)
assert a.tobytes() == b.tobytes()
assert c.tobytes() == a[1:3].tobytes() and c.shape == (2, 2, 37, 2, 8)
"; then ok "get returns the stored bytes"; else bad "get returns the stored bytes"; fi
check "put bf16 by --hash" 0 "" -- "$KVBLEND" put --model mb --kv "$dir/kv_bf16.npy" \
	--hash 00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff
check "get bf16" 0 "" -- "$KVBLEND" get --model mb \
	--hash 00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff --out "$dir/bf.npy"
if "$PY" -c "
import numpy as np
a = np.load('$dir/kv_bf16.npy'); b = np.load('$dir/bf.npy')
assert b.dtype == np.dtype('<u2') and a.tobytes() == b.tobytes()
"; then ok "bf16 round trip as <u2"; else bad "bf16 round trip as <u2"; fi

check "ls --json" 0 "\"tokens\": 37" -- "$KVBLEND" ls --model m7 --json
"$KVBLEND" ls --model m7 --json >"$dir/ls.json"
if "$PY" -c "import json; j = json.load(open('$dir/ls.json')); assert j[0]['hash'] == '$want' and j[0]['base_pos'] == 12"; then
	ok "ls --json parses"; else bad "ls --json parses"; fi
"$KVBLEND" stats --json >"$dir/stats.json"
if "$PY" -c "import json; j = json.load(open('$dir/stats.json')); assert j['chunks'] == 2 and j['models'] == 2, j"; then
	ok "stats --json parses"; else bad "stats --json parses"; fi
check "lookup" 0 "missing" -- "$KVBLEND" lookup --model m7 "$want" \
	0000000000000000000000000000000000000000000000000000000000000000

# Bad input: one line, non-zero exit, nothing stored.
check "malformed npy" 1 "truncated .npy header" -- "$KVBLEND" put --model m7 \
	--kv "$dir/garbage.npy" --tokens "$dir/ids.npy"
check "missing file" 1 "No such file" -- "$KVBLEND" put --model m7 --kv "$dir/nope.npy" \
	--tokens "$dir/ids.npy"
check "dtype mismatch" 1 "does not match model 'm7'" -- "$KVBLEND" put --model m7 \
	--kv "$dir/kv_f32.npy" --tokens "$dir/ids.npy"
check "shape mismatch" 1 "shape must be [3, 2, T, 2, 8]" -- "$KVBLEND" put --model m7 \
	--kv "$dir/kv_badshape.npy" --tokens "$dir/ids.npy"
echo "1 2 3 4 5" >"$dir/ids5.txt"
check "token count mismatch" 1 "has 5 token ids but" -- "$KVBLEND" put --model m7 \
	--kv "$dir/kv.npy" --tokens "$dir/ids5.txt"
check "float token ids" 1 "1-D integer array" -- "$KVBLEND" put --model m7 --kv "$dir/kv.npy" \
	--tokens "$dir/kv_f32.npy"
check "unknown model" 1 "unknown model 'zz'" -- "$KVBLEND" put --model zz --kv "$dir/kv.npy" \
	--tokens "$dir/ids.npy"
check "bad hash" 2 "not a chunk hash" -- "$KVBLEND" get --model m7 --hash abc --out "$dir/x.npy"
check "get missing" 1 "not found" -- "$KVBLEND" get --model m7 \
	--hash 0000000000000000000000000000000000000000000000000000000000000000 --out "$dir/x.npy"
check "bad layers" 2 "--layers" -- "$KVBLEND" get --model m7 --hash "$want" --layers 2:9 \
	--out "$dir/x.npy"
check "unknown command" 2 "unknown command" -- "$KVBLEND" frobnicate
"$KVBLEND" stats --json >"$dir/stats2.json"
if cmp -s <("$PY" -c "import json; print(json.load(open('$dir/stats.json'))['chunks'])") \
	<("$PY" -c "import json; print(json.load(open('$dir/stats2.json'))['chunks'])"); then
	ok "failed puts stored nothing"; else bad "failed puts stored nothing"; fi

# Restart: every committed chunk is found again.
stop_daemon
start_daemon
check "get after restart" 0 "37 tokens" -- "$KVBLEND" get --model m7 --hash "$want" \
	--out "$dir/back2.npy"
if cmp -s "$dir/back.npy" "$dir/back2.npy"; then ok "same bytes after restart"; else bad "same bytes after restart"; fi
check "rm" 0 "deleted" -- "$KVBLEND" rm --model m7 --hash "$want"
check "rm again" 1 "not found" -- "$KVBLEND" rm --model m7 --hash "$want"
check "demo" 0 "demo done" -- "$KVBLEND" demo
stop_daemon

# A second daemon on the same data directory is refused with a clear message.
start_daemon
check "second daemon refused" 1 "in use by another kvblendd" -- "$KVBLENDD" --data-dir "$dir/data" \
	--listen "ipc://$dir/other.sock"
check "bad config value" 2 "workers: invalid value '9999'" -- "$KVBLENDD" --workers 9999
check "bad device" 2 "device: invalid value 'gpu'" -- "$KVBLENDD" --device gpu
stop_daemon

# --device cuda:N without that device: refused at start, the cause named. (Where device 9
# exists this machine has ten GPUs; the check then only asks for a clean failure.)
check "device cuda:9 refused" 1 "device cuda:9:" -- "$KVBLENDD" --data-dir "$dir/data" \
	--listen "ipc://$dir/gpu.sock" --device cuda:9

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
