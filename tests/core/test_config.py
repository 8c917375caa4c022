"""Config: every example TOML in configs/ loads, environment overrides win, bad values are refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.config import LiverlConfig, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_there_are_example_configs():
    assert {p.name for p in CONFIGS} >= {"demo.toml", "production.example.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    cfg = load_config(path, env={})
    assert isinstance(cfg, LiverlConfig)


def test_demo_toml_is_the_demo_defaults():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "demo.toml", env={})
    from liverl.demo.run import DEMO_PROFILE

    defaults = LiverlConfig()  # the learning rate is the demo's own (the built-in default is a real LLM's)
    assert cfg.learner == defaults.learner.model_copy(update={"lr": DEMO_PROFILE["learner"]["lr"]})
    assert cfg.gate == defaults.gate and cfg.demo == defaults.demo
    assert cfg.product == "liverl.demo.product:PRODUCT"


def test_environment_overrides_file_and_keywords_override_both(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[learner]\nlr = 0.1\nbatch_size = 8\n[topics]\nprefix = "file"\n')
    env = {
        "LIVERL__LEARNER__LR": "0.2",
        "LIVERL__TOPICS__PREFIX": "env",
        "LIVERL__BROKER__BOOTSTRAP": "k:9092",
        "LIVERL__INGEST__REWARDS": '{"accept": 1.0}',
        "LIVERL__PRODUCT": "null",
        "UNRELATED": "x",
    }
    cfg = load_config(f, env=env, learner__batch_size=16)
    assert (cfg.learner.lr, cfg.learner.batch_size, cfg.topics.prefix) == (0.2, 16, "env")
    assert cfg.broker.bootstrap == "k:9092" and cfg.ingest.rewards.accept == 1.0 and cfg.product is None


def test_a_whole_section_as_json_is_what_the_supervisor_passes():
    c = LiverlConfig()
    c.learner.lr = 1e-5
    cfg = load_config(env={"LIVERL__LEARNER": c.learner.model_dump_json()})
    assert cfg.learner == c.learner


@pytest.mark.parametrize(
    "env, where",
    [
        ({"LIVERL__LEARNER__BATCH_SIZE": "0"}, "batch_size"),
        ({"LIVERL__LEARNER__KL_ESTIMATOR": "k9"}, "kl_estimator"),
        ({"LIVERL__LEARNER__NOPE": "1"}, "nope"),
    ],
)
def test_bad_values_are_refused_naming_the_field(env, where):
    with pytest.raises(ValidationError, match=where):
        load_config(env=env)


def test_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad, env={})


def test_several_nodes_get_their_own_names_and_ports_and_a_router_in_front():
    from liverl.stack.supervisor import ROLES, node_serving, roles_for
    from liverl.stack.up import Pipeline

    cfg = load_config(env={}, serving__nodes=2, serving__gateway_port=9000, serving__vllm_port=9100)
    assert roles_for(cfg) == ("serve@0", "serve@1", "route", "ingest", "learn", "gate")
    assert roles_for(load_config(env={})) == ROLES
    s1 = node_serving(cfg.serving.model_dump(mode="json"), 1)
    assert (s1["node_name"], s1["gateway_port"], s1["vllm_port"]) == ("node-1", 9001, 9101)
    node1 = load_config(env={"LIVERL__SERVING": json.dumps(s1)})  # what the child reads back
    assert node1.serving.node_name == "node-1" and node1.serving.gateway_port == 9001
    assert Pipeline(cfg, "/m").gateway_url == f"http://127.0.0.1:{cfg.serving.router_port}"
    assert Pipeline(load_config(env={}), "/m").gateway_url == "http://127.0.0.1:8000"


def test_the_learners_entropy_floor_must_be_above_the_gates_collapse_floor():
    """learner.entropy_floor at or under gate.min_entropy would let the lineage fall into the gate's collapse refusals
    before the floor acts: refused, naming both; 0 turns the floor off and is accepted."""
    with pytest.raises(ValueError, match=r"learner.entropy_floor \(0.05\) must be above gate.min_entropy \(0.05\)"):
        load_config(env={}, learner__entropy_floor=0.05)
    with pytest.raises(ValueError, match=r"learner.entropy_floor \(0.1\) must be above gate.min_entropy \(0.2\)"):
        load_config(env={}, gate__min_entropy=0.2)
    assert load_config(env={}, learner__entropy_floor=0.0, gate__min_entropy=0.2).learner.entropy_floor == 0.0
    assert load_config(env={}).learner.entropy_floor > load_config(env={}).gate.min_entropy
