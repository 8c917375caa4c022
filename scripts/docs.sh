#!/usr/bin/env bash
# The documentation site (mkdocs.yml, docs/): built with --strict into a temporary folder, so that a broken link, a
# missing anchor or a page left out of the nav fails. scripts/lint.sh (and so CI) runs it; `mkdocs serve` previews.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# Not --quiet: it silences the warnings that --strict counts, and the build would pass whatever they say.
mkdocs build --strict --site-dir "$site"
