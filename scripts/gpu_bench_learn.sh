#!/usr/bin/env bash
# liverl bench learn --device cuda on a GPU machine: the learner's update against the plain transformers loop, on the
# generated moe24m and the demo model. Results and logs go to $OUT.
#
# The GPU machine may have torch and transformers but not pydantic (core.config). Make the wheels here first
# and carry them (the device tool's carry: [".whl"]):
#   mkdir -p .whl && for v in 3.10 3.11 3.12; do .venv/bin/pip download -q --only-binary :all: --python-version $v \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-settings python-dotenv; done
# (keep one pydantic_settings wheel). Usage on the machine: OUT=/tmp/out bash scripts/gpu_bench_learn.sh
set -u
OUT=${OUT:-/tmp/liverl-gpu-bench-learn}
mkdir -p "$OUT"
PY=python3
$PY -V; nvidia-smi -L
V=$($PY -c 'import sys;print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
if ! $PY -c 'import pydantic, pydantic_settings' 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/pydantic-2*.whl .whl/pydantic_core-*-$V-*.whl \
    .whl/pydantic_settings-*.whl .whl/python_dotenv*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl \
    .whl/typing_extensions*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
$PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))'
timeout 240 $PY -m liverl.bench.learn --device cuda --models moe24m --rounds 3 --json $OUT/moe24m.json > $OUT/moe24m.log 2>&1; echo "moe24m rc=$?"
tail -25 $OUT/moe24m.log
timeout 200 $PY -m liverl.bench.learn --device cuda --models demo --rounds 3 --json $OUT/demo.json > $OUT/demo.log 2>&1; echo "demo rc=$?"
tail -25 $OUT/demo.log
