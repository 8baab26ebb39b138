#!/usr/bin/env bash
# gpu_run.sh BLEND_TOOL COMMAND... — run an integration test with the daemon's fuse on
# CUDA device 0 (KVBLEND_TEST_DEVICE=cuda, read by the test harnesses): the parity
# suite's half of the fuse tests. Exits 77 (skipped), saying why, without a usable GPU.
set -euo pipefail
tool=$1
shift
"$tool" probe || exit $?
export KVBLEND_TEST_DEVICE=cuda
exec "$@"
