"""The documentation names real things: every file path and every module, class or function it quotes in backticks
exists in the tree. (`mkdocs build --strict` in scripts/lint.sh checks the links between pages; this checks what the
pages say about the code.) CHANGELOG.md is left out: its migration table names the old paths on purpose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
TOPS = ("core", "deploy", "serving", "ingest", "learner", "liverl", "liverl_sdk", "tests", "scripts", "configs")
SOURCE = {"liverl_sdk": ROOT / "sdk" / "liverl_sdk"}
PATH = re.compile(r"^(?:sdk|core|deploy|serving|ingest|learner|liverl|tests|scripts|configs|docs)/[\w./-]*$")
DOTTED = re.compile(r"^(?:core|deploy|serving|ingest|learner|liverl|liverl_sdk)(?:\.\w+)+$")


def quoted(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands and diagrams
    return [t.strip() for t in re.findall(r"`([^`\n]+)`", text)]


def module_file(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The longest prefix of ``parts`` that is a module or package in the tree, and the names after it."""
    base = SOURCE.get(parts[0], ROOT / parts[0])
    for i in range(len(parts), 0, -1):
        p = base.joinpath(*parts[1:i])
        if p.with_suffix(".py").is_file():
            return p.with_suffix(".py"), parts[i:]
        if (p / "__init__.py").is_file():
            return p / "__init__.py", parts[i:]
    return None, parts


def defines(source: str, name: str) -> bool:
    return (
        re.search(rf"(?m)^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b", source)
        is not None
    )


def config_keys() -> set[str]:
    """Every key the configuration reference documents, as ``table.key`` (``ingest.rewards.accept``)."""
    keys, table = set(), ""
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if m := re.match(r"^## `\[([\w.]+)\]`", line):
            table = m.group(1)
        elif line.startswith("## "):
            table = ""
        elif m := re.match(r"^\| `(\w+)` \|", line):
            keys.add(f"{table}.{m.group(1)}" if table else m.group(1))
            if table:
                keys.add(table)
    return keys


def problems(page: Path, keys: set[str]) -> list[str]:
    out = []
    for token in quoted(page):
        token = token.split("::")[0].rstrip("/.,:;)")
        if token.endswith(".json"):
            continue  # a file liverl writes (``learner.json``), not a module
        if PATH.match(token):
            if not (ROOT / token).exists() and not (ROOT / token).with_suffix(".py").exists():
                out.append(f"{page.name}: `{token}` is not in the tree")
        elif DOTTED.match(token) and token not in keys:
            path, rest = module_file(token.split("."))
            if path is None:
                out.append(f"{page.name}: `{token}` names no module")
            elif rest and not defines(path.read_text(), rest[0]):
                out.append(f"{page.name}: `{token}`: {path.relative_to(ROOT)} defines no {rest[0]}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_name_a_page_quotes_exists(page):
    bad = problems(page, config_keys())
    assert not bad, "\n".join(bad)
