#!/usr/bin/env bash
# Compile the delta codec's numba kernels once per checkout (about 10 s per element width on a fresh
# clone; a few seconds when numba's on-disk cache in deploy/__pycache__ is current). Serving workers and
# tests then load them from the cache instead of compiling in the middle of a hot-swap or a timed test.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# our own modules' bytecode (setup.sh does the installed ones; see there why)
python -m compileall -q -j 0 ingest learner serving deploy liverl >/dev/null
python -c '
import time
t0 = time.monotonic()
from deploy.registry.delta import warm_up
warm_up(("bfloat16", "float32", "float8_e4m3fn"))  # bf16/fp16 share the 16-bit kernels, e4m3/e5m2 the 8-bit ones
dt = time.monotonic() - t0
if dt > 10:
    print(f"[compile] delta codec kernels compiled in {dt:.0f} s (cached for later runs)", flush=True)
'
