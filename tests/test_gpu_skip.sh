#!/usr/bin/env bash
# test_gpu_skip.sh GPU_RUN — gpu_run.sh's rule, with a fake nvidia-smi and a fake probe on
# PATH: without a GPU listed a skip stays a skip (77); where nvidia-smi lists one, a
# skip (the probe's or the test's own) fails with the reason; a pass stays a pass.
set -uo pipefail
run=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

check() { # NAME WANT_RC GOT_RC OUTPUT [WORD]
	if [ "$2" != "$3" ] || { [ -n "${5:-}" ] && ! grep -q "$5" <<< "$4"; }; then
		echo "not ok - $1: exit $3 (want $2)"
		echo "$4" | sed 's/^/    /'
		failed=1
	else
		echo "ok - $1"
	fi
}

mkdir -p "$tmp/gpu" "$tmp/nogpu"
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"\n' \
	> "$tmp/gpu/nvidia-smi"
printf '#!/bin/sh\necho "No devices were found"\nexit 6\n' > "$tmp/nogpu/nvidia-smi"
# The probe: 77 when FAKE_PROBE says "skip", else a device name.
printf '#!/bin/sh\nif [ "$FAKE_PROBE" = skip ]; then echo "skip: no CUDA device"; exit 77; fi\necho "Fake GPU"\n' \
	> "$tmp/tool"
chmod +x "$tmp/gpu/nvidia-smi" "$tmp/nogpu/nvidia-smi" "$tmp/tool"

for where in nogpu gpu; do
	for probe in skip ok; do
		for test_rc in 0 77 3; do
			out=$(PATH="$tmp/$where:$PATH" FAKE_PROBE=$probe bash "$run" "$tmp/tool" \
				sh -c "exit $test_rc" 2>&1)
			rc=$?
			want=$test_rc word=
			[ "$probe" = skip ] && want=77
			if [ "$where" = gpu ] && [ "$want" = 77 ]; then
				want=1 word="nvidia-smi lists a GPU"
			fi
			check "$where, probe $probe, test exits $test_rc" "$want" "$rc" "$out" "$word"
		done
	done
done
# No nvidia-smi at all: a skip is a skip. PATH holds only what gpu_run.sh runs (a GPU
# machine may have nvidia-smi in /usr/bin itself).
mkdir -p "$tmp/bare"
for c in bash sh grep true; do
	ln -s "$(command -v "$c")" "$tmp/bare/$c"
done
bash=$(command -v bash)
out=$(PATH="$tmp/bare" FAKE_PROBE=skip "$bash" "$run" "$tmp/tool" true 2>&1)
check "no nvidia-smi on PATH, probe skip" 77 $? "$out"
exit $failed
