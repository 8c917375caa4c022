#!/usr/bin/env bash
# Lint: ruff with the rules in pyproject.toml ([tool.ruff.lint]: pyflakes, pycodestyle's errors, sorted imports) and
# ruff's formatter (`ruff format` fixes what `--check` reports), then the documentation site's strict build
# (scripts/docs.sh). scripts/test.sh (and so CI) runs it first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ruff check sdk core ingest learner serving deploy liverl tests scripts
ruff format --check sdk core ingest learner serving deploy liverl tests scripts
bash scripts/docs.sh
