#!/usr/bin/env bash
# The systemd unit and the .deb: the unit verifies, its hardening rates OK
# (exposure <= 2.0), and the package's files land where the unit expects them.
# usage: test_unit.sh BUILD_DIR SOURCE_DIR
set -u
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd)
pass=0 failed=0
ok() { pass=$((pass + 1)); echo "ok - $1"; }
bad() { failed=$((failed + 1)); echo "not ok - $1"; [ -n "${2:-}" ] && echo "# $2"; }
tmp=$(mktemp -d /tmp/kvb-unit-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

unit=$build/systemd/kvblendd.service
# verify needs the executable to exist: check a copy that names the build's daemon.
sed "s|^ExecStart=[^ ]*|ExecStart=$build/bin/kvblendd|" "$unit" >"$tmp/kvblendd.service"
if out=$(systemd-analyze verify --man=no "$tmp/kvblendd.service" 2>&1) && [ -z "$out" ]; then
	ok "systemd-analyze verify"
else
	bad "systemd-analyze verify" "$out"
fi
level=$(systemd-analyze security --offline=yes "$tmp/kvblendd.service" 2>&1 |
	sed -n 's/.*Overall exposure level for kvblendd.service: \([0-9.]*\).*/\1/p')
if [ -n "$level" ] && awk -v l="$level" 'BEGIN { exit !(l <= 2.0) }'; then
	ok "systemd-analyze security: exposure $level <= 2.0"
else
	bad "systemd-analyze security" "exposure '$level'"
fi
grep -q '^Type=notify$' "$unit" && grep -q '^WatchdogSec=' "$unit" &&
	grep -q '^StateDirectory=kvblend$' "$unit" && grep -q '^RuntimeDirectory=kvblend$' "$unit" &&
	grep -q '^ConfigurationDirectory=kvblend$' "$unit" && ok "unit: notify, watchdog, directories" ||
	bad "unit: notify, watchdog, directories"
# systemctl reload sends SIGHUP, which the daemon handles (re-reads its config).
grep -q '^ExecReload=/bin/kill -HUP \$MAINPID$' "$unit" && ok "unit: ExecReload sends SIGHUP" ||
	bad "unit: ExecReload sends SIGHUP" "$(grep '^ExecReload' "$unit")"

# The package, built from a tree configured for /usr, unpacked into a scratch root.
cmake -S "$src" -B "$tmp/pkg" -DCMAKE_INSTALL_PREFIX=/usr -DKVB_TESTS=OFF >/dev/null &&
	cmake --build "$tmp/pkg" -j"$(nproc)" >/dev/null &&
	(cd "$tmp/pkg" && cpack -G DEB >/dev/null) || { bad "cpack -G DEB"; echo "$pass passed, $failed failed"; exit 1; }
deb=$(ls "$tmp"/pkg/kvblend_*.deb)
ok "cpack -G DEB: $(basename "$deb")"
root=$tmp/root
dpkg-deb -x "$deb" "$root"
dpkg-deb -I "$deb" | grep -q 'Depends:.*libzmq5' && ok "package depends on its libraries" ||
	bad "package depends on its libraries" "$(dpkg-deb -I "$deb")"
exec_path=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$root/usr/lib/systemd/system/kvblendd.service")
[ "$exec_path" = /usr/sbin/kvblendd ] && [ -x "$root$exec_path" ] &&
	ok "unit's ExecStart $exec_path is in the package" || bad "ExecStart" "$exec_path"
missing=
for f in usr/bin/kvblend usr/include/kvblend.h usr/lib/x86_64-linux-gnu/libkvblend.so.1 \
	usr/lib/x86_64-linux-gnu/pkgconfig/kvblend.pc usr/lib/sysusers.d/kvblend.conf \
	usr/lib/tmpfiles.d/kvblend.conf etc/kvblend/kvblendd.conf usr/share/man/man8/kvblendd.8 \
	usr/share/man/man1/kvblend.1 usr/share/doc/kvblend/kvblendd-gpu.conf; do
	[ -e "$root/$f" ] || missing="$missing /$f"
done
[ -z "$missing" ] && ok "package has binaries, library, header, pkg-config, unit entries, config, man pages and the GPU drop-in" ||
	bad "package lacks$missing"
systemd-sysusers --root="$root" "$root/usr/lib/sysusers.d/kvblend.conf" &&
	grep -q '^kvblend:' "$root/etc/passwd" && ok "sysusers entry creates user kvblend" ||
	bad "sysusers entry"
systemd-tmpfiles --root="$root" --create "$root/usr/lib/tmpfiles.d/kvblend.conf" &&
	[ -d "$root/etc/kvblend" ] && ok "tmpfiles entry" || bad "tmpfiles entry"
# The packaged daemon reads the packaged config (every key commented: the defaults).
if out=$("$root/usr/sbin/kvblendd" --config "$root/etc/kvblend/kvblendd.conf" --print-config 2>&1) &&
	grep -q '^map_size = ' <<<"$out"; then
	ok "packaged daemon reads the packaged config"
else
	bad "packaged daemon reads the packaged config" "$out"
fi
# Start the packaged daemon as the unit would (its config, the directories systemd would
# make, passed the same way) and talk to it with the packaged CLI and library.
mkdir -p "$root/var/lib/kvblend" "$root/run/kvblend"
STATE_DIRECTORY=$root/var/lib/kvblend RUNTIME_DIRECTORY=$root/run/kvblend \
	CONFIGURATION_DIRECTORY=$root/etc/kvblend \
	"$root/usr/sbin/kvblendd" --config "$root/etc/kvblend/kvblendd.conf" --map-size 64M \
	2>"$tmp/packaged.log" &
pid=$!
cli=("$root/usr/bin/kvblend" --endpoint "ipc://$root/run/kvblend/kvblend.sock" --timeout 300)
for _ in $(seq 100); do
	LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu "${cli[@]}" ping >/dev/null 2>&1 && break
	sleep 0.1
done
if LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu "${cli[@]}" demo >"$tmp/demo.out" 2>&1 &&
	grep -q "demo done" "$tmp/demo.out" && [ -f "$root/var/lib/kvblend/data.mdb" ]; then
	ok "packaged daemon starts on the unit's directories and serves the packaged CLI"
else
	bad "packaged daemon starts" "$(cat "$tmp/demo.out" "$tmp/packaged.log")"
fi
kill -TERM "$pid"
wait "$pid" && ok "packaged daemon stops cleanly" || bad "packaged daemon stops cleanly"
if command -v groff >/dev/null; then
	groff -man -Tutf8 -ww "$root/usr/share/man/man8/kvblendd.8" "$root/usr/share/man/man1/kvblend.1" \
		>/dev/null 2>"$tmp/groff.err" && [ ! -s "$tmp/groff.err" ] && ok "man pages render" ||
		bad "man pages render" "$(cat "$tmp/groff.err")"
fi
echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
