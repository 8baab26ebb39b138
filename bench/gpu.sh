#!/usr/bin/env bash
# bench/gpu.sh [OUT] — everything the CUDA backend needs checked on a machine with an
# NVIDIA GPU, as one command: a Release build with the CUDA backend, the parity suite
# (ctest -L gpu: the blend reference tests and the fuse tests on the GPU, against the
# same references as the CPU), then the benchmarks (bench_cuda: kernels against a
# device-to-device copy and the pipelined upload against host-to-device bandwidth;
# bench_fuse on --device cpu and --device cuda, the latter with fused layers read from
# the shared ring and handed over on the GPU, against host-to-device bandwidth). Every log and table goes to OUT
# (default $OUT, else ./gpu-out). Needs the build dependencies (.ci/install-deps) and
# nvcc. Exits non-zero when nvidia-smi lists no GPU, or the build or the parity suite
# fails (a skipped test is a failed one here: tests/gpu_run.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
jobs=$(nproc)
status=0

{ nvidia-smi || true; nvcc --version || true; } > "$out/machine.txt" 2>&1
# Without a GPU there is nothing for this script to prove: say so, and fail.
if ! nvidia-smi -L 2> /dev/null | grep -qE '^GPU [0-9]+:'; then
	echo "gpu.sh: nvidia-smi lists no GPU; this script is for a machine with one"
	exit 1
fi
if ! { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_WERROR=ON &&
	cmake --build build-gpu -j"$jobs"; } > "$out/build.log" 2>&1; then
	echo "gpu.sh: build failed; see $out/build.log"
	tail -30 "$out/build.log"
	exit 1
fi
build-gpu/bin/blend_tool probe | tee "$out/device.txt"

# The parity suite, then the CPU tests of blend/ for comparison.
# On this machine a skip is a failure (tests/gpu_run.sh makes it one); and a suite where
# nothing ran proves nothing.
ctest --test-dir build-gpu -L gpu -V > "$out/parity.log" 2>&1 || status=1
if grep -qE "No tests were found|\*\*\*Skipped|Not Run" "$out/parity.log"; then
	echo "gpu.sh: the gpu suite skipped or ran nothing; see $out/parity.log"
	status=1
fi
ctest --test-dir build-gpu -R 'test_blend' --output-on-failure > "$out/blend_cpu.log" 2>&1 ||
	status=1
grep -E "tests passed|Skipped|Failed|passed, " "$out/parity.log" | tail -12

build-gpu/bin/bench_cuda --tokens 4096,32768 2>&1 | tee "$out/bench_cuda.md"
for dev in cpu cuda; do
	build-gpu/bin/bench_fuse --device "$dev" --tokens 4096,32768 --repeats 3 2>&1 |
		tee "$out/bench_fuse_$dev.md"
done
# The fused layers handed over on the GPU (CUDA IPC) instead of the shared ring.
build-gpu/bin/bench_fuse --device cuda --on-device --tokens 4096,32768 --repeats 3 2>&1 |
	tee "$out/bench_fuse_cuda_ipc.md"
exit $status

