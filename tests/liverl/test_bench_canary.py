"""``liverl bench canary`` through the real CLI, on a few small canaries: its tables, its bar and its command."""

from __future__ import annotations

import json

import pytest

from liverl.bench.rates import binomial_upper
from liverl.bench.rates import split_list as _split_populations


def test_the_canary_bench_prints_both_tables_with_the_bar_and_the_command(tmp_path, capsys):
    from liverl.cli import main

    out = tmp_path / "canary.json"
    assert (
        main(
            [
                "bench",
                "canary",
                "--runs",
                "6",
                "--users",
                "48",
                "--populations",
                "segments,beta(2,2)",
                "--deadline-s",
                "300",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| population | users | user unit | user unit + CUPED | per event, sticky users (wrong) |" in printed
    assert "| population | users | +3 points: user | user + CUPED | per request |" in printed
    assert "user-unit A/A false decisions (bar: at most alpha 5% in every row)" in printed
    assert (
        "reproduce: `liverl bench canary --runs 6 --users 48 --populations 'segments,beta(2,2)' --deadline-s 300.0`"
    ) in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["population"], r["users"], r["runs"]) for r in rows] == [("segments", 48, 6), ("beta(2,2)", 48, 6)]
    assert set(rows[0]["effects"]) == {"0.0", "0.03", "-0.03"}


def test_the_binomial_bound_and_the_population_list():
    assert binomial_upper(0, 1000) == pytest.approx(1 - 0.05 ** (1 / 1000), rel=1e-6)
    assert 0.05 < binomial_upper(50, 1000) < 0.07 and binomial_upper(10, 10) == 1.0
    assert _split_populations("segments, beta(2,2),beta(0.5,1.5)") == ["segments", "beta(2,2)", "beta(0.5,1.5)"]


def test_the_decisions_bench_prints_each_scenario_the_bars_and_the_command(tmp_path, capsys):
    from liverl.cli import main

    out = tmp_path / "decisions.json"
    args = ["bench", "canary", "--decisions", "--runs", "3", "--users", "300", "--profiles", "demo"]
    assert main([*args, "--activity", "lognormal", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| candidate | promoted | aborted: shown worse (on) | futile |" in printed
    assert "demo gate (share 0.5, deadline 480 s, revert horizon 75 s, budget 6,000 canary events" in printed
    assert "| A/A |" in printed and "| +3 points |" in printed and "| bait |" in printed
    assert "| demo | lognormal(1) | 300 | 3 |" in printed
    assert (
        "reproduce: `liverl bench canary --decisions --runs 3 --users 300 --profiles demo --activity lognormal`"
    ) in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["profile"], r["users"], r["runs"]) for r in rows] == [("demo", 300, 3)]
    assert set(rows[0]["bars"]) == {"A/A", "+3 points", "bait"}
    assert sum(rows[0]["candidates"]["bait"]["ends"].values()) == 3


def test_the_decisions_bench_takes_gate_settings_over_its_profiles():
    from liverl.bench.canary_decisions import gate_for, parse_overrides

    over = parse_overrides(["canary_max_events=8000", "gate.latency_guardrail=harm", "canary_futility_z=null"])
    assert over == {"canary_max_events": 8000, "latency_guardrail": "harm", "canary_futility_z": None}
    demo = gate_for("demo", over)
    assert (demo.canary_max_events, demo.canary_margin, demo.latency_guardrail) == (8000, 0.03, "harm")
    assert gate_for("defaults").canary_max_events is None
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_overrides(["canary_budget=8000"])
    with pytest.raises(ValueError, match="unknown gate profile"):
        gate_for("prod")


def test_the_decisions_bench_plays_the_demos_world_and_its_smallest_exploit(capsys):
    from liverl.cli import main

    args = ["bench", "canary", "--decisions", "--runs", "2", "--users", "300", "--profiles", "demo"]
    args += ["--activity", "lognormal", "--world", "demo", "--candidates", "+3 points,exploit"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "demo world, segments3 users" in printed
    assert "| exploit |" in printed and "| A/A |" not in printed
    assert "exploit shown worse (≥ 80%), promoted (none)" in printed
    assert "--world demo --candidates '+3 points,exploit'" in printed
