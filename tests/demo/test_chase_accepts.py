"""`liverl demo --chase-accepts` reaches the process that acts on it: the flag sets ``ingest.train_reverts`` in the
config the demo resolves, and the ingest worker reads that config from the environment its supervisor gives it
(``liverl.stack.supervisor.child_env``). What the setting does to the reward path is tested on the join itself,
with real Redis (``tests/ingest/test_heldout_reverts.py``)."""

from __future__ import annotations

import os

import pytest

from core.config import load_config
from liverl.cli import build_parser
from liverl.demo.run import apply_demo_profile
from liverl.stack.stack import Stack
from liverl.stack.supervisor import child_env
from liverl.up_cli import demo_config


def _ingest_config_of_the_demo(argv: list[str], tmp_path, monkeypatch, env: dict[str, str] | None = None):
    """The ingest section the demo's ingest worker starts with, for ``liverl demo <argv>`` under ``env``."""
    monkeypatch.delenv("LIVERL_CONFIG", raising=False)
    for k in [k for k in os.environ if k.upper().startswith("LIVERL__")]:
        monkeypatch.delenv(k)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["demo", *argv, "--state-dir", str(tmp_path / "state")])
    cfg = demo_config(args)
    apply_demo_profile(cfg)  # what run_demo does before it starts the pipeline
    stack = Stack(  # the addresses a started stack reports (no process is started here)
        bootstrap="127.0.0.1:19999",
        redis_url="redis://127.0.0.1:6379/0",
        registry_url=f"sqlite:///{tmp_path / 'registry.db'}",
        blob_dir=str(tmp_path / "blobs"),
    )
    return load_config(env=child_env(cfg, stack, tmp_path / "model")).ingest


@pytest.mark.parametrize(("flag", "trains"), [(["--chase-accepts", "on"], False), (["--chase-accepts", "off"], True)])
def test_the_chase_accepts_flag_reaches_the_ingest_worker(flag, trains, tmp_path, monkeypatch):
    ingest = _ingest_config_of_the_demo(flag, tmp_path, monkeypatch)
    assert ingest.train_reverts is trains
    assert ingest.rewards.revert == -1.0  # the reward is not the lever: the gate's held-out records carry it


def test_without_the_flag_the_environment_decides(tmp_path, monkeypatch):
    """The config file or the environment wins over the demo's profile, as for every other demo setting."""
    env = {"LIVERL__INGEST__TRAIN_REVERTS": "true"}
    assert _ingest_config_of_the_demo([], tmp_path, monkeypatch, env).train_reverts is True
    env = {"LIVERL__INGEST__TRAIN_REVERTS": "false"}
    assert _ingest_config_of_the_demo([], tmp_path, monkeypatch, env).train_reverts is False
