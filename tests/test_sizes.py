"""Modules stay small enough to read in one sitting: no source file over 600 lines and no class over 350.

A file that grows past this usually holds two ideas; split it along the jobs it already has. The numba kernels of
the delta codec are the one exception: each kernel is one loop that numba compiles whole, and splitting it would cost
the codec's speed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdk", "core", "ingest", "learner", "serving", "deploy", "liverl", "scripts")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 350
EXEMPT = {"deploy/registry/kernels.py": "numba kernels: one compiled loop each"}


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "migrations/versions" not in str(p))


def test_no_source_file_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES and str(p.relative_to(ROOT)) not in EXEMPT
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split them along their jobs): {long}"


def test_no_class_is_over_350_lines():
    long = {}
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"
