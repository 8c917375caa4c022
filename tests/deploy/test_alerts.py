"""The Prometheus alert rules (deploy/alerts/liverl.rules.yml): valid for promtool, unit-tested with promtool on
series that should and should not page, written on metrics liverl really exports, each with its runbook
(docs/operations.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]
ALERTS = REPO / "deploy" / "alerts"
RULES = ALERTS / "liverl.rules.yml"


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip(
            "promtool is not installed (Debian: apt-get install prometheus; scripts/services.sh does it as root)"
        )
    return tool


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules():
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout


def test_promtool_unit_tests_each_alert_firing_and_quiet():
    out = subprocess.run(
        [_promtool(), "test", "rules", "liverl.rules.test.yml"], cwd=ALERTS, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (ALERTS / "liverl.rules.test.yml").read_text()))
    assert tested == {r["alert"] for r in _rules()}, "every alert has a promtool unit test"


def test_the_issue_s_alerts_are_there():
    names = {r["alert"] for r in _rules()}
    assert {
        "LiverlRolloutRolledBack",
        "LiverlCandidatesRefusedInARow",
        "LiverlVersionSkew",
        "LiverlIngestLag",
        "LiverlDeadLetterRate",
        "LiverlNoPromotion",
    } <= names


def test_rules_use_metrics_liverl_exports():
    source = "\n".join(
        p.read_text() for pkg in ("ingest", "learner", "deploy", "serving") for p in (REPO / pkg).rglob("*.py")
    )
    for rule in _rules():
        for metric in set(re.findall(r"liverl_[a-z_]+", rule["expr"])):
            base = re.sub(r"_(total|bucket|count|sum)$", "", metric)
            assert f'"{base}"' in source, f"{rule['alert']}: {metric} is not a metric liverl exports"


def test_every_alert_has_its_runbook_section():
    page = "docs/operations.md"
    text = (REPO / page).read_text()
    for rule in _rules():
        where, anchor = rule["annotations"]["runbook"].split("#", 1)
        heading = f"### Runbook: {rule['alert']}"
        assert where == page, f"{rule['alert']}: its runbook is in {page}"
        assert heading in text, f"{page} lacks '{heading}'"
        assert anchor == "runbook-" + rule["alert"].lower()
