"""``liverl bench canary --stats`` through the real CLI, on a few small canaries: its four tables, its bar and its
command."""

from __future__ import annotations

import json


def test_the_stats_bench_prints_its_tables_with_the_bar_and_the_command(tmp_path, capsys):
    from liverl.cli import main

    out = tmp_path / "stats.json"
    argv = ["bench", "canary", "--stats", "--runs", "4", "--users", "200", "--populations", "segments"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| population | users | readout share | false promotions (sequential + readout) |" in printed
    assert "| population | users | readout share | +1 points | +1.5 points | +2 points | +3 points |" in printed
    assert "| 0.3 (configured) |" in printed  # gate.canary_readout_share's default, marked
    assert "| population | users | truth | promoted | mean raw | mean corrected |" in printed
    assert (
        "| node load correlation | canary share | candidate | true change of mean / p90 | p90 test: worse |" in printed
    )
    assert "A/A false promotions, false aborts and latency false harms (bar: at most alpha 5%): largest " in printed
    assert "reproduce: `liverl bench canary --stats --runs 4 --users 200 --populations 'segments'`" in printed
    summary = json.loads(out.read_text())
    [readout] = summary["readout"]
    assert (readout["population"], readout["users"], readout["runs"], readout["tests"]) == ("segments", 200, 4, 3)
    assert {row["readout_share"] for row in readout["rows"]} == {0.0, 0.1, 0.2, 0.3, 0.5}
    assert [w["load_corr_s"] for w in summary["latency"]] == [5.0, 30.0, 5.0]
