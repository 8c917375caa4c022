#!/usr/bin/env bash
# Run pytest ROUNDS times in a row while a busy loop per core hogs the CPUs (a test that fails under load is a
# defect). Prints one line per round and a table at the end; exits 1 if any round failed.
#
#   bash scripts/under_hog.sh 10 tests/ingest/test_restart.py tests/learner/test_trainer.py
#
# The hog is one `while :; do :; done` shell per core (nproc), at the same priority as the tests: the tests get
# about half the machine. Each round's pytest output is kept in $LOGS (default /tmp/liverl-hog) as round-N.log.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export LIVERL_TEST_MODEL_CACHE=${LIVERL_TEST_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/liverl/models}
ROUNDS=${1:?usage: under_hog.sh ROUNDS PYTEST_ARGS...}
shift
LOGS=${LOGS:-/tmp/liverl-hog}
mkdir -p "$LOGS"
hogs=()
for _ in $(seq "$(nproc)"); do
  bash -c 'while :; do :; done' &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
echo "under_hog: ${#hogs[@]} busy loops on $(nproc) cores; $ROUNDS rounds of: pytest $*"
failed=0
rows=()
for i in $(seq "$ROUNDS"); do
  t0=$(date +%s)
  python -m pytest -q -p no:randomly -p no:cacheprovider "$@" >"$LOGS/round-$i.log" 2>&1
  rc=$?
  dt=$(($(date +%s) - t0))
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|error)' "$LOGS/round-$i.log" | tail -1 | sed 's/=//g')
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  rows+=("| $i | $rc | ${dt} s | ${summary} |")
  echo "round $i: exit $rc in ${dt} s: ${summary}"
done
echo
echo "| round | exit | time | pytest |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "$failed of $ROUNDS rounds failed (logs in $LOGS)"
[ "$failed" -eq 0 ]
