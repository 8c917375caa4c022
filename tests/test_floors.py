"""One floor per folder, enforced: every import in the source (top of file or inside a function) points down, or
stays in its own folder; folders on the same floor never import each other; and the core never imports a product.

  floor  folders                                   what they are
  9      liverl (cli.py, *_cli.py, cliargs.py)     the command line: the root parser, each area's verbs
  8      liverl/bench                              benchmarks (they drive the demo and the stack)
  7      liverl/demo                               the demo product, a customer, and its runner
  6      liverl/ops                                operator verbs: admin, audit, on-call, lineage, chaos
  5      liverl/stack  liverl/testing              the embedded stack and its supervisor; test models
  4      serving/agent                             the serving process: launches a vLLM node and drives it
  3      ingest  learner  deploy/gate              the processes of the pipeline
         serving/node  serving/router              (serving/node: what vLLM's API server and workers load)
  2      deploy/registry                           the registry library: codec, container, blob store, registry
  1      core                                      config, wire schemas, Kafka bus, Redis keys (torch-free)
  0      liverl_sdk (sdk/)                         the product's feedback client and the feedback wire contract

A folder is the longest one in the table that holds the file (serving/node/worker belongs to serving/node).
The demo's product (liverl/demo/) is a customer: nothing below it imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "liverl_sdk": 0,
    "core": 1,
    "deploy/registry": 2,
    "ingest": 3,
    "learner": 3,
    "deploy/gate": 3,
    "serving/node": 3,
    "serving/router": 3,
    "serving/agent": 4,
    "liverl/stack": 5,
    "liverl/testing": 5,
    "liverl/ops": 6,
    "liverl/demo": 7,
    "liverl/bench": 8,
    "liverl": 9,
}
TOPS = ("liverl_sdk", "core", "deploy", "ingest", "learner", "serving", "liverl")
SOURCE = {"liverl_sdk": ROOT / "sdk" / "liverl_sdk"}  # its own distribution, in sdk/


def source(top: str) -> Path:
    return SOURCE.get(top, ROOT / top)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in TOPS:
        base = source(pkg)
        for path in base.rglob("*.py"):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue  # an empty package file holds nothing to place on a floor
            rel = path.relative_to(base.parent).with_suffix("")
            out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def folder(mod: str) -> str:
    """The folder of the table that holds a module (the longest match)."""
    parts = mod.split(".")
    if not source(parts[0]).joinpath(*parts[1:]).is_dir():  # a module file: its folder; a package: itself
        parts = parts[:-1]
    path = "/".join(parts)
    matches = [f for f in FLOORS if path == f or path.startswith(f + "/")]
    assert matches, f"{mod} lies in no folder of the floor table: add its folder to FLOORS"
    return max(matches, key=len)


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def allowed(src: str, dst: str) -> bool:
    """Down, or within the same folder."""
    f_src, f_dst = folder(src), folder(dst)
    return f_src == f_dst or FLOORS[f_dst] < FLOORS[f_src]


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
                wrong.append(f"{src} ({folder(src)}) imports {dst} ({folder(dst)})")
    assert not wrong, "imports that run the wrong way:\n" + "\n".join(sorted(set(wrong)))


def test_no_process_or_library_imports_the_demo_product():
    mods = modules()
    offenders = [
        f"{src} imports {name}"
        for src, path in mods.items()
        if FLOORS[folder(src)] < FLOORS["liverl/demo"]
        for name in imports_of(path)
        if name.startswith("liverl.demo")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module",
    [
        "core.config",
        "core.schemas",
        "core.bus",
        "core.services",
        "core.keys",
        "core.product",
        "liverl_sdk",
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
    assert not allowed("deploy.registry.registry", "learner.model")
    assert not allowed("serving.node.gateway", "ingest.app")
    assert not allowed("liverl_sdk.client", "core.bus")
    assert not allowed("core.config", "deploy.registry.registry")
    assert not allowed("serving.node.gateway", "serving.agent.launch")
    assert not allowed("deploy.gate.gate", "learner.evaluate")
    assert not allowed("liverl.ops.chaos", "liverl.demo.run")
    assert allowed("serving.agent.agent", "deploy.registry.registry") and allowed("liverl.cli", "learner.trainer")
    assert allowed("serving.agent.agent", "serving.node.client") and allowed(
        "serving.node.worker.extension", "serving.node.worker.layout"
    )


def test_every_module_lies_on_a_floor():
    for mod in modules():
        if ".migrations" not in mod:
            folder(mod)


def test_the_cli_names_the_same_chaos_kinds_as_the_chaos_command():
    from liverl.ops.chaos import KINDS
    from liverl.up_cli import KILL_KINDS

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
