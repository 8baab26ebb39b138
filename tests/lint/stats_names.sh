#!/usr/bin/env bash
# The names a kvblendd reports: its STATS keys (`kvblend stats --json`, nested keys joined
# by dots) and its /metrics series, one file each, sorted; to compare two builds when code
# moves (issue 59: "STATS and /metrics names compared before and after"):
#
#   tests/lint/stats_names.sh OLD_BUILD /tmp/old && tests/lint/stats_names.sh build /tmp/new
#   diff /tmp/old.stats /tmp/new.stats && diff /tmp/old.metrics /tmp/new.metrics
#
# usage: stats_names.sh BUILD_DIR OUT_PREFIX   (writes OUT_PREFIX.stats, OUT_PREFIX.metrics)
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BUILD_DIR OUT_PREFIX" >&2; exit 2; }
b=$1 out=$2
d=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$b/bin/kvblendd" --data-dir "$d/data" --listen "ipc://$d/s.sock" --metrics-port "$port" \
	--map-size 1G >"$d/log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$d"' EXIT
for _ in $(seq 100); do
	"$b/bin/kvblend" --endpoint "ipc://$d/s.sock" stats --json >"$d/stats.json" 2>/dev/null && break
	sleep 0.1
done
python3 - "$d/stats.json" >"$out.stats" <<'PY'
import json, sys
def keys(o, p=""):
    if isinstance(o, dict):
        for k, v in o.items():
            yield from keys(v, p + k + ".")
    else:
        yield p.rstrip(".")
print("\n".join(sorted(set(keys(json.load(open(sys.argv[1])))))))
PY
curl -sf "http://127.0.0.1:$port/metrics" | grep -v '^#' | sed -E 's/[{ ].*//' | sort -u >"$out.metrics"
echo "$(wc -l <"$out.stats") STATS names, $(wc -l <"$out.metrics") /metrics names"
