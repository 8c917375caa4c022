"""``liverl bench learn`` through the real CLI, tiny: the table's columns, the command, and that both sides agree.

Real parts: the demo policy and a generated Qwen3-MoE, the learner's own ``PolicyTrainer`` and a plain transformers
loop, on CPU. Speeds are printed, never asserted (the box is shared).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from liverl.bench.learn import COLUMNS, PlainLoop, check_agreement

TINY = ["--rounds", "1", "--steps", "1", "--warmup", "1", "--batch", "3"]


def model_cache() -> Path:  # the test models' cache, as tests/learner uses it: the demo policy is built once
    return Path(os.environ.get("LIVERL_TEST_MODEL_CACHE") or Path(tempfile.gettempdir()) / "liverl-test-models")


def test_bench_learn_prints_the_table_the_command_and_equal_losses(tmp_path, capsys):
    from liverl.cli import main

    out = tmp_path / "learn.json"
    # lr 1e-2: the second (checked) update starts far enough from the reference for the KL term to count
    assert (
        main(
            [
                "bench",
                "learn",
                "--models",
                "demo",
                "tiny",
                *TINY,
                "--lr",
                "0.01",
                "--cache",
                str(model_cache()),
                "--work",
                str(tmp_path / "models"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| " + " | ".join(COLUMNS) + " |" in printed
    assert "command: liverl bench learn --models demo tiny --rounds 1 --steps 1 --batch 3 --lr 0.01" in printed
    rows = json.loads(out.read_text())
    assert [(r["model"], r["side"]) for r in rows] == [
        ("demo", "learner"),
        ("demo", "plain"),
        ("tiny", "learner"),
        ("tiny", "plain"),
    ]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 and r["timed_steps"] == 1
    for r in rows[::2]:
        assert r["loss_learner"] == pytest.approx(r["loss_plain"], rel=1e-4, abs=1e-6)
        assert r["gnorm_learner"] == pytest.approx(r["gnorm_plain"], rel=1e-4)
        # one round: the paired ratio is the plain side's time over the learner's, i.e. the tokens/s ratio
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / rows[rows.index(r) + 1]["tokens_per_s"])
        assert f"| {r['model']} | " in printed and f"{r['ratio']:.2f}x" in printed
    assert rows[2]["params_M"] == pytest.approx(0.19, abs=0.05)


def test_a_plain_loop_without_the_kl_term_is_caught(tmp_path, monkeypatch):
    """The agreement check can fail: a plain side that leaves out the KL penalty differs on the second update."""
    from liverl.cli import main

    init = PlainLoop.__init__

    def without_kl(self, model_dir, lcfg, device):
        init(self, model_dir, lcfg.model_copy(update={"kl_coef": 0.0}), device)

    monkeypatch.setattr(PlainLoop, "__init__", without_kl)
    with pytest.raises(AssertionError, match=r"tiny, update 2: .* disagree on (loss|grad_norm|kl)"):
        main(["bench", "learn", "--models", "tiny", *TINY, "--lr", "0.01", "--work", str(tmp_path / "models")])


def test_the_agreement_check_and_bad_flags(capsys):
    same = {"loss": 0.5, "grad_norm": 2.0, "kl": 0.0}
    check_agreement("m", {"learner": same, "plain": dict(same, loss=0.5 + 1e-7)}, 1e-4)
    with pytest.raises(AssertionError, match="grad_norm"):
        check_agreement("m", {"learner": same, "plain": dict(same, grad_norm=2.1)}, 1e-4)
    with pytest.raises(AssertionError, match="loss"):
        check_agreement("m", {"learner": same, "plain": dict(same, loss=float("nan"))}, 1e-4)
    from liverl.cli import main

    assert main(["bench", "learn", "--models", "tiny", "--prompt-len", "8"]) == 2
    assert "--prompt-len must be MIN-MAX" in capsys.readouterr().err
    assert main(["bench", "learn", "--models", "tiny", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
    assert main(["bench", "learn", "--models", "no-such-model"]) == 2
    assert "neither 'demo', a size" in capsys.readouterr().err
