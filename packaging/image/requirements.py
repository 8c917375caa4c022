"""Print liverl's runtime requirements from pyproject.toml (and the SDK's), as scripts/setup.sh resolves them: without
torch, the packages vLLM brings in its own resolve (transformers, tokenizers, safetensors) and the SDK itself (it is
installed from ./sdk), so that no later pin can downgrade what vLLM needs.

    python3 requirements.py REPO > requirements.txt
"""

import re
import sys
import tomllib
from pathlib import Path

SKIP = {"torch", "transformers", "tokenizers", "safetensors", "liverl-sdk"}

root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
reqs = []
for f in (root / "pyproject.toml", root / "sdk" / "pyproject.toml"):
    reqs += tomllib.loads(f.read_text())["project"]["dependencies"]
for r in reqs:
    if re.split(r"[<>=\[ ;~!]", r, maxsplit=1)[0].strip().lower() not in SKIP:
        print(r)
