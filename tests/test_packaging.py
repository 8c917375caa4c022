"""Packaging: every package liverl's code lives in is in the wheel, every third-party module it imports
is declared in pyproject.toml (not only pulled in by another package), and faust-streaming is no runtime dependency
(only `liverl bench ingest` uses it, from the ``bench`` extra)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TOPS = ("core", "liverl", "ingest", "learner", "serving", "deploy")
SDK = REPO / "sdk"
SDK_PROJECT = tomllib.loads((SDK / "pyproject.toml").read_text())


def _name(req: str) -> str:
    return re.split(r"[<>=\[ ;~!]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _shipped() -> list[Path]:
    return [p for top in TOPS for p in sorted((REPO / top).rglob("*.py")) if "__pycache__" not in p.parts]


def test_every_package_of_the_code_is_in_the_wheel():
    from setuptools import find_packages

    listed = set(find_packages(str(REPO), include=PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]))
    found = {".".join(p.parent.relative_to(REPO).parts) for top in TOPS for p in (REPO / top).rglob("__init__.py")}
    assert found - listed == set(), f"packages the wheel leaves out: {sorted(found - listed)}"
    assert "liverl.testing" in listed  # `liverl bench logprobs` imports it
    assert not {p for p in listed if p.split(".")[0] not in TOPS}, "the wheel takes a folder that is no liverl package"


def test_the_sdk_wheel_holds_its_packages_and_declares_its_imports():
    listed = set(SDK_PROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(SDK).parts) for p in (SDK / "liverl_sdk").rglob("__init__.py")}
    assert found == listed
    declared = {_name(r) for r in SDK_PROJECT["project"]["dependencies"]}
    dists = packages_distributions()
    for path in sorted((SDK / "liverl_sdk").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
            elif isinstance(node, ast.Import):
                top = node.names[0].name.split(".")[0]
            else:
                continue
            if top in sys.stdlib_module_names or top == "liverl_sdk":
                continue
            names = {d.lower().replace("_", "-") for d in dists.get(top, [])}
            assert names & declared, f"{path.name} imports {top}, which sdk/pyproject.toml does not declare"


def test_faust_is_a_bench_extra_only():
    runtime = {_name(r) for r in PROJECT["project"]["dependencies"]}
    assert "faust-streaming" not in runtime
    assert "faust-streaming" in {_name(r) for r in PROJECT["project"]["optional-dependencies"]["bench"]}
    users = [
        p.relative_to(REPO).as_posix()
        for p in _shipped()
        if re.search(r"^\s*(import faust|from faust)", p.read_text(), re.M)
    ]
    assert users == ["liverl/bench/ingest.py"], users


def test_every_third_party_import_is_declared():
    extras = PROJECT["project"]["optional-dependencies"]
    declared = {_name(r) for r in PROJECT["project"]["dependencies"]}
    declared |= {_name(r) for name in ("cpu", "gpu", "bench") for r in extras[name]}
    dists = packages_distributions()
    missing: dict[str, list[str]] = {}
    for path in _shipped():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top in TOPS or top == "tests":
                    continue
                names = {d.lower().replace("_", "-") for d in dists.get(top, [])}
                if not names & declared:
                    missing.setdefault(f"{top} ({', '.join(sorted(names)) or 'not installed'})", []).append(
                        path.relative_to(REPO).as_posix()
                    )
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
