#!/usr/bin/env bash
# bench/gpu.sh [OUT] — everything the CUDA backend needs checked on a machine with an
# NVIDIA GPU, as one command (issue 23's first GPU run): the driver and compute mode; a
# Release build with the CUDA backend and warnings as errors; the parity suite (ctest -L
# gpu: the blend reference tests, the large-shape parity of test_device_parity, and the fuse
# tests on the GPU, against the same references as the CPU; a skip is a failure here); the
# device tests of the CPU suite (emulated device); the daemon's start log under --device
# auto; the benchmarks (bench_cuda: kernels against a device-to-device copy and the
# pipelined upload against host-to-device bandwidth; bench_fuse with --device cpu, --device
# cuda, --device cuda --reserve 4G and --device cuda --on-device, each with the open time,
# the daemon's CPU time per layer and the blocks allocated and rings pinned per open;
# bench_land_device: landing into another process's device memory in vLLM's GPU layout,
# issue 33); and, where nsys is installed, a trace of device sessions (copies from
# pageable memory, kernel launches per layer, allocations). Last, a summary: for each of
# issue 23's findings 1-13 and for issue 33's device landing one line saying what this
# run showed, printed and written to OUT/summary.txt. Every log and table goes to OUT
# (default $OUT, else ./gpu-out). Needs the build dependencies (.ci/install-deps) and
# nvcc, or KVB_GPU_PREBUILT=1 and a build-gpu built elsewhere (the same configuration).
# Exits non-zero when nvidia-smi lists no GPU, or the build, the parity suite, the device
# tests or the device landing's parity fail.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
jobs=$(nproc)
status=0
sizes=4096,32768

{
	nvidia-smi || true
	nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total --format=csv || true
	nvcc --version || true
} > "$out/machine.txt" 2>&1
# Without a GPU there is nothing for this script to prove: say so, and fail.
if ! nvidia-smi -L 2> /dev/null | grep -qE '^GPU [0-9]+:'; then
	echo "gpu.sh: nvidia-smi lists no GPU; this script is for a machine with one"
	exit 1
fi
# KVB_GPU_PREBUILT=1: build-gpu was built elsewhere (the same configuration, on a machine with
# the build dependencies) and is used as it is: a GPU machine without them still runs the rest.
if [ "${KVB_GPU_PREBUILT:-0}" = 1 ]; then
	if [ ! -x build-gpu/bin/kvblendd ] || [ ! -x build-gpu/bin/blend_tool ]; then
		echo "gpu.sh: KVB_GPU_PREBUILT=1 but build-gpu/bin has no kvblendd or blend_tool"
		exit 1
	fi
	echo "prebuilt build-gpu used as it is" > "$out/build.log"
elif ! { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_WERROR=ON &&
	cmake --build build-gpu -j"$jobs"; } > "$out/build.log" 2>&1; then
	echo "gpu.sh: build failed; see $out/build.log"
	tail -30 "$out/build.log"
	exit 1
fi
build-gpu/bin/blend_tool probe | tee "$out/device.txt"

# The parity suite, then the CPU tests of blend/ for comparison. test_blend_cuda runs
# last, after the benchmarks: it once started CUDA for each of its 536 cases (167 s on an
# H200, 2026-12-04; blend_tool's batch mode now starts it once), and a lease that ends
# first should have the figures.
# On this machine a skip is a failure (tests/gpu_run.sh makes it one); and a suite where
# nothing ran proves nothing.
ctest --test-dir build-gpu -L gpu -E '^test_blend_cuda$' -V > "$out/parity.log" 2>&1 ||
	status=1
ctest --test-dir build-gpu -R '^test_blend$' --output-on-failure > "$out/blend_cpu.log" 2>&1 ||
	status=1
grep -E "tests passed|Skipped|Failed|passed, " "$out/parity.log" | tail -12
# Issue 33: landing into another process's device allocation in vLLM's GPU layout (this
# process the node: CUDA IPC to the daemon), parity with the host landing, GB/s against
# host-to-device and device-to-device copies (target: 25 GB/s). Exits 1 on a parity miss.
build-gpu/bin/bench_land_device --device cuda --tokens 4096,16384 --repeats 5 2>&1 |
	tee "$out/bench_land_device.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The large shapes once more on their own, for the summary's lines.
build-gpu/bin/test_device_parity cuda > "$out/large_parity.log" 2>&1 || status=1
cat "$out/large_parity.log"
# The device path's tests on the emulated device (the close order, the sticky failure,
# the device budget, the placement under auto, the pooled blocks): they ran without a GPU
# too; here they show the GPU build passes them.
ctest --test-dir build-gpu -R 'test_device_(export|fault|parity_emulated|gpu_skip)|test_land_device$' \
	--output-on-failure > "$out/device_tests.log" 2>&1 || status=1

# The daemon's start under --device auto: the driver floor, blocking sync, the placement.
tmp=$(mktemp -d)
build-gpu/bin/kvblendd --help > "$out/kvblendd_help.txt" 2>&1
build-gpu/bin/kvblendd --data-dir "$tmp/data" --listen "ipc://$tmp/kvblend.sock" \
	--map-size 1G --device auto --log-level info > "$out/daemon_auto.log" 2>&1 &
dpid=$!
sleep 5
kill "$dpid" 2> /dev/null
wait "$dpid" 2> /dev/null
rm -rf "$tmp"

build-gpu/bin/bench_cuda --tokens "$sizes" 2>&1 | tee "$out/bench_cuda.md"
for dev in cpu cuda; do
	build-gpu/bin/bench_fuse --device "$dev" --tokens "$sizes" --repeats 3 2>&1 |
		tee "$out/bench_fuse_$dev.md"
done
# Sessions' blocks carved from memory the daemon reserved at start (fuse_device_reserve):
# even the first session of a size should allocate nothing on its open.
build-gpu/bin/bench_fuse --device cuda --reserve 4G --tokens "$sizes" --repeats 3 2>&1 |
	tee "$out/bench_fuse_cuda_reserve.md"
# The fused layers handed over on the GPU (CUDA IPC) instead of the shared ring.
build-gpu/bin/bench_fuse --device cuda --on-device --tokens "$sizes" --repeats 3 2>&1 |
	tee "$out/bench_fuse_cuda_ipc.md"

# A trace of device sessions: one size, one repeat (two sessions of 32 layers), the
# daemon followed across its fork.
trace=
if command -v nsys > /dev/null 2>&1; then
	trace="$out/trace"
	nsys profile --trace=cuda,osrt --trace-fork-before-exec=true --force-overwrite=true \
		--output "$trace" build-gpu/bin/bench_fuse --device cuda --tokens 4096 \
		--repeats 1 > "$out/trace_run.md" 2>&1
	nsys stats --force-export=true --report cuda_api_sum,cuda_gpu_kern_sum --format csv \
		--output "$trace" "$trace.nsys-rep" > "$out/trace_stats.log" 2>&1
	nsys analyze --rule cuda_memcpy_async "$trace.nsys-rep" > "$out/trace_pageable.txt" 2>&1
fi

# The blend reference cases on the GPU (test_blend.py --backend cuda), appended to the
# parity log; then whether anything of the suite skipped or nothing ran.
ctest --test-dir build-gpu -R '^test_blend_cuda$' -V >> "$out/parity.log" 2>&1 || status=1
if grep -qE "No tests were found|\*\*\*Skipped|Not Run" "$out/parity.log"; then
	echo "gpu.sh: the gpu suite skipped or ran nothing; see $out/parity.log"
	status=1
fi
grep -E "Test +#.*(Passed|Failed)|passed, | passed in " "$out/parity.log" | tail -14

# ---- the summary: one line per finding of issue 23, from what this run wrote ----

# Column c (1 = tokens) of a bench_fuse table's row for T tokens, or "?".
col() { # FILE T C
	awk -F'|' -v t="$2" -v c="$3" '$2 + 0 == t && NF > 10 { v = $(c + 1); gsub(/ /, "", v);
		print v; found = 1; exit } END { if (!found) print "?" }' "$1" 2> /dev/null
}
# a / b with two decimals, or "?".
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b;
	else print "?" }'; }
# Calls of a CUDA API in the trace (its cuda_api_sum CSV), or "?".
api_calls() {
	local f
	f=$(ls "$out"/trace*cuda_api_sum*.csv 2> /dev/null | head -1)
	[ -n "$f" ] || { echo "?"; return; }
	awk -F',' -v n="$1" '{ gsub(/"/, "") } $NF == n || $NF ~ "^"n"_v[0-9]+$" { s += $3 }
		END { print s + 0 }' "$f"
}
# Instances of a kernel in the trace, or "?".
kern_count() {
	local f
	f=$(ls "$out"/trace*cuda_gpu_kern_sum*.csv 2> /dev/null | head -1)
	[ -n "$f" ] || { echo "?"; return; }
	grep -F "$1" "$f" | awk -F',' '{ gsub(/"/, ""); s += $3 } END { print s + 0 }'
}
passed() { grep -qE "^ *[0-9]+/[0-9]+ Test +#[0-9]+: $1 .*Passed" "$2" && echo passed ||
	echo "NOT passed"; }

driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2> /dev/null | head -1)
mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2> /dev/null | head -1)
floor=$(grep -o 'needs NVIDIA driver [0-9]*' "$out/kvblendd_help.txt" | grep -o '[0-9]*$')
ran=$(grep -cE "Test +#[0-9]+: .*Passed" "$out/parity.log")
skipped=$(grep -cE "\*\*\*Skipped|Not Run" "$out/parity.log")
failed_t=$(grep -cE "\*\*\*Failed|\(Failed\)|Exception" "$out/parity.log")
ok_large=$(grep -c '^ok - ' "$out/large_parity.log")
bad_large=$(grep -c '^not ok - ' "$out/large_parity.log")
t=32768
# Finding 6 from the daemon's own counts (bench_fuse's columns from FUSE_CLOSE's statistics).
pool6="per session open at $t tokens on cuda: blocks allocated (first; later sessions on average) $(col "$out/bench_fuse_cuda.md" $t 17), shared rings pinned $(col "$out/bench_fuse_cuda.md" $t 18) (goal for later sessions: 0; 0); with --on-device $(col "$out/bench_fuse_cuda_ipc.md" $t 17) allocated (an exported block is never reused); with --fuse-device-reserve 4G $(col "$out/bench_fuse_cuda_reserve.md" $t 17) allocated (goal: 0; 0); open ms: cpu $(col "$out/bench_fuse_cpu.md" $t 14), cuda $(col "$out/bench_fuse_cuda.md" $t 14), cuda with the reserve $(col "$out/bench_fuse_cuda_reserve.md" $t 14)"
{
	echo "gpu.sh summary ($(head -1 "$out/device.txt"); driver ${driver:-?}, compute mode ${mode:-?})"
	echo "finding 1 (exported ring freed under the node's mapping): close order on the emulated export $(passed test_device_export "$out/device_tests.log"); on this GPU bench_fuse --on-device $(grep -q '^| 4096' "$out/bench_fuse_cuda_ipc.md" && echo 'fused through CUDA IPC at every size' || echo 'did NOT complete: see bench_fuse_cuda_ipc.md') (an unmap after the free would fault the node)"
	echo "finding 2 (sticky errors): emulated sticky failure $(passed test_device_fault "$out/device_tests.log") (a real illegal address is not provoked on the GPU)"
	echo "finding 3 (driver floor): this build needs driver ${floor:-?} or newer, this machine has ${driver:-?}$(awk -v d="${driver%%.*}" -v f="${floor:-0}" 'BEGIN { if (d + 0 >= f + 0 && f + 0 > 0) print ": at or above the floor"; else print ": BELOW the floor or unknown" }'); start log: $(grep -o '\[CUDA runtime[^]]*\]' "$out/daemon_auto.log" | head -1)"
	echo "finding 4 (skips counted as passes): gpu suite ${ran} passed, ${skipped} skipped, ${failed_t} failed (a skip fails the run)"
	if [ -n "$trace" ]; then
		echo "finding 5 (pageable copies): nsys cuda_memcpy_async rule: $(grep -ciE 'pageable' "$out/trace_pageable.txt") lines naming pageable memory (see trace_pageable.txt; 0 is the goal); on the emulated device no copy of a session is pageable: test_device_export $(passed test_device_export "$out/device_tests.log")"
		echo "finding 6 (allocation in the hot path): 2 sessions traced: cudaMalloc $(api_calls cudaMalloc), cudaFree $(api_calls cudaFree), cudaMallocHost $(api_calls cudaMallocHost), cudaFreeHost $(api_calls cudaFreeHost), cudaHostRegister $(api_calls cudaHostRegister), cudaHostUnregister $(api_calls cudaHostUnregister), cudaStreamCreateWithFlags $(api_calls cudaStreamCreateWithFlags) (the second session should add none: at most one cudaHostRegister, the shared ring's, and the spares' allocations off the open path); ${pool6}"
	else
		echo "finding 5 (pageable copies): not traced: nsys is not installed; on the emulated device no copy of a session is pageable (fresh rows, replies, rotation tables and spans staged through pinned memory): test_device_export $(passed test_device_export "$out/device_tests.log")"
		echo "finding 6 (allocation in the hot path): no trace (nsys not installed); ${pool6}"
	fi
	echo "finding 7 (waiting threads spin): start log says '$(grep -o 'waits [a-z]*' "$out/daemon_auto.log" | head -1)'; daemon CPU ms per layer at $t tokens: cuda $(col "$out/bench_fuse_cuda.md" $t 15) against a layer wait of $(col "$out/bench_fuse_cuda.md" $t 9 | cut -d'(' -f1) ms; cpu $(col "$out/bench_fuse_cpu.md" $t 15)"
	if [ -n "$trace" ]; then
		echo "finding 8 (one rotate launch per chunk): k_rotate_spans launches $(kern_count k_rotate_spans), k_rotate launches $(kern_count 'k_rotate(') for 2 sessions of 8 chunks and 32 layers (one launch per layer load is the goal)"
	else
		echo "finding 8 (one rotate launch per chunk): not counted: nsys is not installed"
	fi
	echo "finding 9 (whole pinned ring zeroed at open): fresh rows only, checked on the emulated device ($(passed test_device_export "$out/device_tests.log")); open ms at $t tokens on cuda: $(col "$out/bench_fuse_cuda.md" $t 14)"
	echo "finding 10 (no device budget): budget and host-path fallback $(passed test_device_fault "$out/device_tests.log") on the emulated device; on this GPU the default budget is 9/10 of $(nvidia-smi --query-gpu=memory.total --format=csv,noheader 2> /dev/null | head -1)"
	echo "finding 11 (failed CUB size query): top-k of 400K candidates on the GPU: $(grep -E '^(not )?ok - top-' "$out/large_parity.log" | grep -v 'too little scratch' | cut -d' ' -f1-2 | head -1 || echo '?'); with too little scratch: $(grep -E '^(not )?ok - top-.*too little scratch' "$out/large_parity.log" | cut -d' ' -f1-2 | head -1 || echo '?') (-EINVAL, no selection); a failing size query refuses the open on the emulated device: test_device_fault $(passed test_device_fault "$out/device_tests.log")"
	echo "finding 12 (large-shape parity): ${ok_large} checks byte for byte as the CPU, ${bad_large} not (large_parity.log)"
	for s in ${sizes//,/ }; do
		cpu_c=$(col "$out/bench_fuse_cpu.md" "$s" 6)
		gpu_c=$(col "$out/bench_fuse_cuda.md" "$s" 6)
		echo "finding 13 (host-memory nodes, $s tokens): fused GB/s copied out cpu ${cpu_c}, cuda ${gpu_c} (cuda/cpu $(ratio "$gpu_c" "$cpu_c")x); in place cpu $(col "$out/bench_fuse_cpu.md" "$s" 4), cuda $(col "$out/bench_fuse_cuda.md" "$s" 4); $(awk -v a="$gpu_c" -v b="$cpu_c" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) print (a < b ? "device auto is right to keep them on the CPU" : "the GPU was faster: device auto should put them there"); else print "not measured" }')"
	done
	land_row() { grep -E "^\| $1 \|" "$out/bench_land_device.md" 2> /dev/null | head -1; }
	for s in 4096 16384; do
		r=$(land_row $s)
		if [ -n "$r" ]; then
			echo "issue 33 (landing into a node's device memory, $s tokens): $(echo "$r" | awk -F'|' '{ gsub(/ /, ""); printf "%s GB/s (H2D %s, land/H2D %s; D2D %s; host landing %s GB/s); parity: %s", $6, $7, $8, $9, $11, $13 }') (target: 25 GB/s); test_land_device on the GPU $(passed test_land_device_cuda "$out/parity.log")"
		else
			echo "issue 33 (landing into a node's device memory, $s tokens): did NOT run (see bench_land_device.md)"
		fi
	done
} | tee "$out/summary.txt"
exit $status
