#!/usr/bin/env bash
# The test suite, exactly as CI runs it: set up .venv, make sure Redis and PostgreSQL answer, run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k delta). Tests marked gpu skip on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# models built by tests are content-addressed (a hash of their recipe), so one cache per user serves every clone
export LIVERL_TEST_MODEL_CACHE=${LIVERL_TEST_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/liverl/models}
bash scripts/lint.sh
bash scripts/compile.sh
# two workers, a file (or a package that shares one vLLM node) at a time: tests/conftest.py says how and in which order;
# LIVERL_TEST_WORKERS=0 runs it in one process
python -m pytest -n "${LIVERL_TEST_WORKERS:-2}" --dist loadgroup "$@"
