#!/usr/bin/env bash
# Run one engine test (tests/engine/*.py) with the engine venv's python from .ci/engine-env
# (or the script KVBLEND_ENGINE_ENV names in .ci/, e.g. vllm034-env: run034.sh),
# against this build's libkvblend and kvblendd:
#   run.sh [--pytest] LIBKVBLEND KVBLENDD TEST.py [ARGS...]
# --pytest: TEST.py is a pytest file, run by the venv's pytest (.ci/engine-env installs it;
# tests/conftest.py has the options, e.g. --model); without it TEST.py runs as a script.
# Exit 77 (skipped) only when KVBLEND_SKIP_ENGINE=1; otherwise a missing environment fails.
set -euo pipefail
if [ "${KVBLEND_SKIP_ENGINE:-}" = 1 ]; then
	echo "engine test skipped: KVBLEND_SKIP_ENGINE=1"
	exit 77
fi
runner=()
if [ "$1" = --pytest ]; then
	runner=(-m pytest -q -p no:cacheprovider -rs)
	shift
fi
lib=$1 daemon=$2 test=$3
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
env_out=$(bash "$here/../../.ci/${KVBLEND_ENGINE_ENV:-engine-env}" | tail -2)
python=$(sed -n 1p <<<"$env_out")
model=$(sed -n 2p <<<"$env_out")
src=$(cd "$here/../../client/python/src" && pwd)
# the package of this tree; the tests' harness (tests/harness/kvbtest.py) and eval/ (its
# harness.py, engine_setup.py and the NumPy references): the one place that puts them on
# the engine tests' path
harness=$(cd "$here/../harness" && pwd)
evals=$(cd "$here/../../eval" && pwd)
export KVBLEND_LIB=$lib KVBLENDD=$daemon KVBLEND_ENGINE_MODEL=$model
export PYTHONPATH=$src:$harness:$evals${PYTHONPATH:+:$PYTHONPATH}
exec "$python" "${runner[@]}" "$test" "$@"
