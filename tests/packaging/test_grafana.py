"""The on-call dashboard (packaging/grafana/liverl.json): valid Grafana JSON whose every query names a metric liverl
exports, with the labels that metric has, and whose panels do not overlap."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).parents[2]
DASHBOARD = REPO / "packaging" / "grafana" / "liverl.json"
PACKAGES = ("ingest", "learner", "deploy", "serving")


def _exported() -> dict[str, set[str]]:
    """Every metric the code declares (``"liverl_..."`` as a string), with the label names declared beside it."""
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            text = path.read_text()
            for m in re.finditer(r'"(liverl_[a-z_]+)"', text):
                near = text[m.end() : m.end() + 400]
                labels = re.search(r"\[([^\]]*)\]", near.split("registry")[0].split(")\n")[0])
                names = set(re.findall(r'"(\w+)"', labels.group(1))) if labels else set()
                out.setdefault(m.group(1), set()).update(names)
    return out


def _queries(dash: dict) -> list[tuple[str, str]]:
    qs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    return qs + [(a["name"], a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]


def test_every_query_names_a_metric_liverl_exports_with_its_labels():
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queries = _queries(dash)
    assert len(queries) >= 30
    for title, expr in queries:
        metrics = set(re.findall(r"liverl_[a-z_]+", expr))
        assert metrics, f"{title}: {expr} names no liverl metric"
        for metric in metrics:
            base = re.sub(r"_(total|bucket|count|sum)$", "", metric)
            assert base in exported, f"{title}: {metric} is not a metric liverl exports"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                if label in ("le", "instance", "job"):
                    continue  # the histogram's buckets; Prometheus' own target labels
                assert any(label in exported[re.sub(r"_(total|bucket|count|sum)$", "", m)] for m in metrics), (
                    f"{title}: no metric of {expr} has a label {label!r}"
                )


def test_panels_have_their_own_place_and_a_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    taken: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        cells = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        assert g["x"] + g["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_the_alerts_a_panel_names_are_liverl_s():
    rules = (REPO / "deploy" / "alerts" / "liverl.rules.yml").read_text()
    alerts = set(re.findall(r"alert: (\w+)", rules))
    named = set(re.findall(r"Liverl[A-Z]\w+", DASHBOARD.read_text()))
    assert named and named <= alerts, named - alerts
