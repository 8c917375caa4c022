#!/usr/bin/env bash
# The learner's CUDA path on one GPU: FSDP2 over 1 rank with NCCL, a DCP checkpoint written and resumed, and the
# learner's update throughput (tokens/s, samples/s) on generated Qwen3-MoE models (learner/dist_check.py).
#
# Needs: python3 with torch (CUDA), transformers, safetensors, numpy; the repo on PYTHONPATH (done here). What
# liverl's learner path adds (pydantic, pydantic-settings and their needs) is installed from .whl/ into /tmp/site
# when python3 lacks it; the import check below names anything still missing and stops.
#
# Usage (repo root):   bash scripts/gpu_learner_check.sh
# Dry run on CPU:      PYTHON=.venv/bin/python BACKEND=gloo SIZES=tiny STEPS=2 WARMUP=1 bash scripts/gpu_learner_check.sh
# Env: PYTHON (python3), BACKEND (nccl), SIZES ("tiny moe24m moe400m"), STEPS (10), WARMUP (2), BATCH (32),
#      PROMPT_LEN (64-256), COMPLETION_LEN (16-128), OUT (gets learner_summary.md and learner_rows.json; default
#      /tmp/liverl-gpu-learner), WORK (models, checkpoints, whole logs; default /tmp/liverl-gpu-learner-work)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-nccl}
SIZES=${SIZES:-tiny moe24m moe400m}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
BATCH=${BATCH:-32}
PROMPT_LEN=${PROMPT_LEN:-64-256}
COMPLETION_LEN=${COMPLETION_LEN:-16-128}
RESULTS=${OUT:-/tmp/liverl-gpu-learner}
WORK=${WORK:-/tmp/liverl-gpu-learner-work}
LOGS=$WORK/logs  # whole logs and per-run JSON stay here; $RESULTS gets two files: learner_summary.md, learner_rows.json
mkdir -p "$RESULTS" "$WORK" "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say() { echo "== $*"; }

# 1. what liverl's learner path imports beyond torch/transformers: from the carried wheels when python3 lacks it
if ! "$PY" -c 'import pydantic, pydantic_settings' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing the carried wheels (.whl/) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "FAILED: pip could not install .whl/*.whl into /tmp/site (wrong python version for the wheels?)"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "NOTE: python3 has no pydantic/pydantic-settings and there is no .whl/ folder to install them from"
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# 2. the import check: every module the learner path needs, each one named when missing
"$PY" - "$BACKEND" <<'EOF' || exit 3
import importlib, sys
need = {"torch": "torch (with CUDA for nccl)", "transformers": "transformers >= 5", "safetensors": "safetensors",
        "numpy": "numpy", "pydantic": "pydantic 2 (carry as .whl)", "pydantic_core": "pydantic-core (carry as .whl)",
        "pydantic_settings": "pydantic-settings (carry as .whl)", "dotenv": "python-dotenv (carry as .whl)",
        "annotated_types": "annotated-types (carry as .whl)", "typing_inspection": "typing-inspection (carry as .whl)",
        "torch.distributed.fsdp": "torch >= 2.6 (FSDP2 fully_shard)", "torch.distributed.checkpoint": "torch DCP"}
missing = []
for mod, what in need.items():
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - report every missing piece, then stop
        missing.append(f"  {mod}: needs {what} ({type(e).__name__}: {e})")
for mod in ("learner.dist", "learner.policy_trainer", "learner.dist_check", "core.config"):
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        missing.append(f"  {mod}: {type(e).__name__}: {e}")
try:
    import torch
except ImportError:
    torch = None
if torch is not None and not hasattr(torch.nn.utils, "get_total_norm"):
    missing.append("  torch.nn.utils.get_total_norm: needs torch >= 2.6")
if torch is not None and sys.argv[1] == "nccl" and not torch.cuda.is_available():
    missing.append("  CUDA: torch.cuda.is_available() is False (BACKEND=gloo runs the CPU path)")
if missing:
    print("MISSING for the learner path:\n" + "\n".join(missing))
    sys.exit(3)
import transformers
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(f"imports ok: python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"transformers {transformers.__version__}, device {dev}")
EOF
[ "$BACKEND" = nccl ] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

run() {  # run NAME ARGS...: one torchrun of learner.dist_check over 1 rank, its log and JSON under $RESULTS
  local name=$1; shift
  say "$name: torchrun --standalone --nproc-per-node 1 -m learner.dist_check $*"
  timeout 420 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m learner.dist_check \
    --backend "$BACKEND" --work "$WORK" --json "$LOGS/$name.json" "$@" 2>&1 | tee "$LOGS/$name.log" \
    | grep -v -E "^W[0-9]{4} |OMP_NUM_THREADS|^\*+$|Warning"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ] && [ -z "${RETRIED:-}" ]; then  # e.g. transformers' grouped_mm experts kernel refusing fp32
    echo "FAILED: $name (exit $rc); its last lines (whole log: $LOGS/$name.failed.log):"
    grep -E "^\[rank[0-9]+\]:|Error|error:" "$LOGS/$name.log" | grep -v -E "elastic|ChildFailedError" | tail -30
    cp "$LOGS/$name.log" "$LOGS/$name.failed.log"
    echo "retrying $name with --experts eager"
    RETRIED=1 run "$name" "$@" --experts eager
    return
  fi
  if [ "$rc" != 0 ]; then
    echo "FAILED: $name (exit $rc); its last lines (whole log: $LOGS/$name.log):"
    grep -E "^\[rank[0-9]+\]:|Error|error:" "$LOGS/$name.log" | grep -v -E "elastic|ChildFailedError" | tail -30
    FAILED=1
  fi
}
FAILED=0

# 3. DCP on this backend: 4 updates with a checkpoint every 2, then a resume from step 4 for 2 more updates
rm -rf "$WORK/ckpt"
run dcp_write --size tiny --steps 4 --batch 8 --ckpt "$WORK/ckpt" --ckpt-every 2
run dcp_resume --size tiny --steps 6 --batch 8 --ckpt "$WORK/ckpt" --resume
grep -q "^step 5:" "$LOGS/dcp_resume.log" && ! grep -q "^step 1:" "$LOGS/dcp_resume.log" \
  && say "DCP resume: ok (continued at step 5)" || { echo "FAILED: the resume did not continue from step 4"; FAILED=1; }

# 4. throughput of the update path, per model size
for size in $SIZES; do
  run "tput_$size" --size "$size" --steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH" \
    --prompt-len "$PROMPT_LEN" --completion-len "$COMPLETION_LEN"
done

say "summary (learner update path, FSDP2 over 1 rank, backend $BACKEND)"
"$PY" - "$LOGS" "$RESULTS/learner_rows.json" <<'EOF' | tee "$RESULTS/learner_summary.md"
import json, pathlib, sys
rows = [json.loads(p.read_text()) | {"run": p.stem} for p in sorted(pathlib.Path(sys.argv[1]).glob("tput_*.json"))]
pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=2))
if rows:
    keys = ["run", "device", "experts", "params_M", "batch", "timed_steps", "s_per_step", "tokens_per_s", "samples_per_s"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k)) for k in keys) + " |")
EOF
echo "reproduce: BACKEND=$BACKEND SIZES=\"$SIZES\" STEPS=$STEPS WARMUP=$WARMUP BATCH=$BATCH PROMPT_LEN=$PROMPT_LEN" \
  "COMPLETION_LEN=$COMPLETION_LEN bash scripts/gpu_learner_check.sh"
[ "$FAILED" = 0 ] && say "ALL OK" || say "SOME RUNS FAILED"
exit "$FAILED"
