#!/usr/bin/env bash
# bench/gpu.sh [OUT] — everything the CUDA backend needs checked on a machine with an
# NVIDIA GPU, as one command: a Release build with the CUDA backend, the parity suite
# (ctest -L gpu: the blend reference tests and the fuse tests on the GPU, against the
# same references as the CPU), then the benchmarks (bench_cuda: kernels against a
# device-to-device copy and the pipelined upload against host-to-device bandwidth;
# bench_fuse on --device cpu and --device cuda, the latter with fused layers read from
# the shared ring and handed over on the GPU, against host-to-device bandwidth). Every log and table goes to OUT
# (default $OUT, else ./gpu-out). Needs the build dependencies (.ci/install-deps) and
# nvcc. Exits non-zero when the build or the parity suite fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
jobs=$(nproc)
status=0

{ nvidia-smi || true; nvcc --version || true; } > "$out/machine.txt" 2>&1
if ! { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_WERROR=ON &&
	cmake --build build-gpu -j"$jobs"; } > "$out/build.log" 2>&1; then
	echo "gpu.sh: build failed; see $out/build.log"
	tail -30 "$out/build.log"
	exit 1
fi
build-gpu/bin/blend_tool probe | tee "$out/device.txt"

# The parity suite, then the CPU tests of blend/ for comparison.
ctest --test-dir build-gpu -L gpu -V > "$out/parity.log" 2>&1 || status=1
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

