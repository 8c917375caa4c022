#!/usr/bin/env bash
# The main job: set up .venv, then run the whole loop on the embedded stack (`liverl demo`).
# Extra arguments go to `liverl demo` (e.g. scripts/demo.sh --duration 300 --summary out/summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
bash scripts/compile.sh
exec liverl demo "$@"
