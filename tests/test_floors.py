"""One floor per package, enforced: every import in the source (top of file or inside a function) may only point
down (or sideways within its own package), and the core never imports a product.

  commands   liverl/{cli,admin,up,supervisor,stack}.py, liverl/bench/, liverl/demo/   (anything below)
  processes  serving/  ingest/  learner/  deploy/gate.py      (the core + deploy's library; never each other)
  library    deploy/ (codec, container, blobstore, registry, migrations)              (the core only)
  core       liverl/core/                                       (itself only; torch-free)

The demo's product (liverl/demo/) is a customer: nothing in ingest/, learner/, serving/ or deploy/ imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROCESS = ("serving", "ingest", "learner")
DEPLOY_PROCESS = {"deploy.gate"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("liverl", "ingest", "learner", "serving", "deploy"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def floor(mod: str) -> str:
    top = mod.split(".")[0]
    if mod.startswith("liverl.core"):
        return "core"
    if top == "deploy":
        return "process" if mod in DEPLOY_PROCESS else "library"
    if top in PROCESS:
        return "process"
    return "command"


def allowed(src: str, dst: str) -> bool:
    f_src, f_dst = floor(src), floor(dst)
    if f_src == "command":
        return True
    if f_src == "core":
        return f_dst == "core"
    if f_src == "library":
        return f_dst in ("core", "library")
    # a process: the core, deploy's library, and its own package
    return f_dst in ("core", "library") or dst.split(".")[0] == src.split(".")[0]


def project(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an imported name refers to (the longest known prefix), or None for a library."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def test_no_import_runs_the_wrong_way():
    mods = modules()
    wrong = []
    for src, path in sorted(mods.items()):
        for name in imports_of(path):
            dst = project(name, mods)
            if dst is not None and dst != src and not allowed(src, dst):
                wrong.append(f"{src} ({floor(src)}) imports {dst} ({floor(dst)})")
    assert not wrong, "imports that run the wrong way:\n" + "\n".join(sorted(set(wrong)))


def test_no_process_or_library_imports_the_demo_product():
    mods = modules()
    offenders = [
        f"{src} imports {name}"
        for src, path in mods.items()
        if floor(src) != "command"
        for name in imports_of(path)
        if name.startswith("liverl.demo")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module",
    [
        "liverl.core.config",
        "liverl.core.schemas",
        "liverl.core.bus",
        "liverl.core.services",
        "liverl.core.keys",
        "liverl.core.product",
        "liverl.cli",
    ],
)
def test_core_and_cli_are_torch_free(module):
    code = (
        f"import sys, {module}; bad = [m for m in ('torch', 'vllm', 'transformers', 'faust') if m in sys.modules]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"importing {module} pulls in {r.stdout.strip()} {r.stderr[-500:]}"


def test_the_checker_catches_a_wrong_way_arrow():
    assert not allowed("deploy.registry", "learner.model")
    assert not allowed("serving.agent", "ingest.sdk")
    assert not allowed("liverl.core.config", "deploy.registry")
    assert allowed("serving.agent", "deploy.registry") and allowed("liverl.cli", "learner.trainer")


def test_the_cli_names_the_same_chaos_kinds_as_the_chaos_command():
    from liverl.chaos import KINDS
    from liverl.cli import KILL_KINDS

    assert KILL_KINDS == KINDS


def test_no_import_circles():
    """No module reaches itself through imports, top of file or inside a function (a lazy import hides a circle from
    Python, not from a reader following the code)."""
    mods = modules()
    graph = {m: {d for d in imports_of(p) if d in mods and d != m} for m, p in mods.items()}
    graph = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in graph.items()}  # a package's own __init__
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)
