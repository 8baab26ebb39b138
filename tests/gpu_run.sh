#!/usr/bin/env bash
# gpu_run.sh BLEND_TOOL COMMAND... — run a test of the gpu label with the daemon's fuse on
# CUDA device 0 (KVBLEND_TEST_DEVICE=cuda, read by the test harnesses; test_blend.py
# --backend cuda ignores it): the parity suite. Exits 77 (skipped), saying why, without
# a usable GPU. But where `nvidia-smi -L` lists a GPU, a skip is a failure: the probe's
# or the test's 77 becomes 1, with the reason, so that a GPU machine where nothing ran
# cannot pass the suite.
set -uo pipefail
tool=$1
shift

# The GPUs nvidia-smi lists ("GPU 0: NVIDIA H200 (UUID: ...)"), or nothing.
gpus() {
	command -v nvidia-smi > /dev/null 2>&1 || return 0
	nvidia-smi -L 2> /dev/null | grep -E '^GPU [0-9]+:' || true
}

skipped() {
	local why=$1 listed
	listed=$(gpus)
	if [ -n "$listed" ]; then
		echo "gpu_run.sh: FAIL: skipped ($why) on a machine where nvidia-smi lists a GPU:"
		echo "$listed"
		exit 1
	fi
	exit 77
}

"$tool" probe
rc=$?
[ "$rc" = 77 ] && skipped "no usable CUDA device"
[ "$rc" = 0 ] || exit "$rc"
export KVBLEND_TEST_DEVICE=cuda
"$@"
rc=$?
[ "$rc" = 77 ] && skipped "the test skipped itself"
exit "$rc"
