#!/usr/bin/env bash
# Lint: ruff with the rules in pyproject.toml ([tool.ruff.lint]: pyflakes, pycodestyle's errors, sorted imports,
# bugbear, blind excepts, pyupgrade, line length), ruff's formatter (`ruff format` fixes what `--check` reports),
# mypy over the files [tool.mypy] names (the SDK, core, ingest, deploy), and the documentation site's strict build
# (scripts/docs.sh). scripts/test.sh (and so CI) runs it first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ruff check sdk core ingest learner serving deploy liverl tests scripts
ruff format --check sdk core ingest learner serving deploy liverl tests scripts
mypy
bash scripts/docs.sh
