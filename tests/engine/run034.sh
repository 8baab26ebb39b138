#!/usr/bin/env bash
# Run one test in the vLLM 0.34 venv (.ci/vllm034-env: PyPI's vllm 0.34.0, whose scheduler
# runs on the CPU) against this build's libkvblend and kvblendd, as run.sh does for the
# 0.32 engine venv: run034.sh LIBKVBLEND KVBLENDD TEST.py [ARGS...]
exec env KVBLEND_ENGINE_ENV=vllm034-env bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
