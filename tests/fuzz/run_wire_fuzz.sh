#!/usr/bin/env bash
# Start a real kvblendd on a temporary directory and IPC socket, replay the saved wire
# regressions (CORPUS_DIR/*.kvbw), fuzz it with fuzz_wire_daemon, stop it with SIGTERM
# and require a clean exit: status 0 and no sanitizer report in its log.
#
# usage: run_wire_fuzz.sh KVBLENDD FUZZER CORPUS_DIR [FUZZER OPTIONS: --seconds S --seed N ...]
# KVB_FUZZ_DEVICE: the daemon's --device (e.g. emulated: fuse sessions on the device path)
# env:   KVB_FUZZ_KEEP=1 keeps the temporary directory (daemon log, saved .kvbw files)
#        KVB_FUZZ_FOUND=DIR also copies the saved .kvbw files and the daemon log there
#        KVB_FUZZ_LOG_LEVEL=info: the daemon's log level (default warn)
set -u
kvblendd=$1 fuzzer=$2 corpus=$3
shift 3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-wirefuzz.XXXXXX")
ep="ipc://$tmp/kvblend.sock"
max_message=4M
# Small limits, so that the fuzzer reaches them (frame cap, sizes, sessions, eviction).
"$kvblendd" --data-dir "$tmp/data" --listen "$ep" --map-size 256M --max-message "$max_message" \
	--max-layers 16 --max-tokens 4096 --max-kv-heads 64 --max-head-dim 256 \
	--shm-max 4M --shm-total 32M --shm-idle 5 --fuse-max-sessions 8 --fuse-max-tokens 2048 \
	--fuse-idle 3 --fuse-max-bytes 64M --capacity 32M --no-sync --log-level ${KVB_FUZZ_LOG_LEVEL:-warn} \
	${KVB_FUZZ_DEVICE:+--device "$KVB_FUZZ_DEVICE"} 2>"$tmp/daemon.log" &
pid=$!
rc=0

if compgen -G "$corpus/*.kvbw" >/dev/null; then
	"$fuzzer" --endpoint "$ep" --pid "$pid" --max-message "$max_message" --save "$tmp/found" \
		--replay "$corpus" || rc=1
fi
if [ "$rc" = 0 ]; then
	"$fuzzer" --endpoint "$ep" --pid "$pid" --max-message "$max_message" --save "$tmp/found" \
		"$@" || rc=1
fi

# Stop: SIGTERM, then up to 60 s (a sanitized daemon drains and checks for leaks).
if kill -TERM "$pid" 2>/dev/null; then
	for _ in $(seq 600); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		echo "run_wire_fuzz: kvblendd did not stop within 60 s of SIGTERM"
		kill -KILL "$pid"
		rc=1
	fi
fi
wait "$pid"
status=$?
if [ "$status" != 0 ]; then
	echo "run_wire_fuzz: kvblendd exited with status $status" \
		"$([ "$status" -gt 128 ] && echo "(signal $((status - 128)))")"
	rc=1
fi
if grep -qE 'ERROR: (Address|Leak|Thread|Memory)Sanitizer|runtime error:|SUMMARY: .*Sanitizer' \
	"$tmp/daemon.log"; then
	echo "run_wire_fuzz: sanitizer report in the daemon log"
	rc=1
fi
# Segments of a daemon that died are left behind; its pid is in their names.
rm -f /dev/shm/kvblend-"$pid"-* 2>/dev/null
if [ "$rc" != 0 ]; then
	echo "---- kvblendd log (last 150 lines) ----"
	tail -n 150 "$tmp/daemon.log"
	echo "---- end of log; kept in $tmp ----"
	if [ -n "${KVB_FUZZ_FOUND:-}" ]; then
		mkdir -p "$KVB_FUZZ_FOUND"
		cp "$tmp"/found/*.kvbw "$KVB_FUZZ_FOUND"/ 2>/dev/null
		cp "$tmp/daemon.log" "$KVB_FUZZ_FOUND/daemon-$(date +%s).log"
	fi
elif [ -z "${KVB_FUZZ_KEEP:-}" ]; then
	rm -rf "$tmp"
fi
exit "$rc"
