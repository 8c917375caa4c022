"""docs/configuration.md is what scripts/config_reference.py writes from the settings classes, every field has a
description, and every environment variable it names is one the loader accepts."""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr

from core.config import LiverlConfig, load_config

ROOT = Path(__file__).parents[2]


def reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leaves(model: type[BaseModel], path: tuple[str, ...] = ()):
    """(path, field) of every key, tables included, of ``model`` and the models nested in it."""
    for name, field in model.model_fields.items():
        yield (*path, name), field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaves(field.annotation, (*path, name))


def test_the_committed_reference_is_up_to_date():
    ref = reference()
    committed = ref.OUTPUT.read_text() if ref.OUTPUT.is_file() else ""
    fresh = ref.render()
    if committed != fresh:
        diff = difflib.unified_diff(
            committed.splitlines(), fresh.splitlines(), "committed", "generated", n=0, lineterm=""
        )
        first = "\n".join(list(diff)[:8])
        pytest.fail(f"docs/configuration.md is stale: run `{ref.COMMAND}` and commit the result\n{first}")


def test_every_field_has_a_description():
    missing = [".".join(path) for path, field in leaves(LiverlConfig) if not (field.description or "").strip()]
    assert not missing, f"fields without a description (add description= where they are declared): {missing}"


def test_every_documented_environment_variable_is_one_the_loader_reads():
    """Each key's variable, set to its default, loads the defaults; a name the loader did not route would be refused
    as an unknown key."""
    ref, defaults = reference(), LiverlConfig()
    env = {}
    for path, field in leaves(LiverlConfig):
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        value = defaults
        for name in path:
            value = getattr(value, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        env[ref.env_name(path)] = value if isinstance(value, str) else json.dumps(value)
        assert f"`{ref.env_name(path)}`" in ref.render()
    assert load_config(env=env) == defaults
    env["LIVERL__LEARNER__LR"] = "0.5"
    assert load_config(env=env).learner.lr == 0.5
