"""Where a config's values come from: the TOML file, then the environment, then keyword overrides."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource

from core.config.root import LiverlConfig

ENV_PREFIX = "LIVERL__"
"""Every environment variable that overrides a config value starts with this."""


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _nulls(tree: dict[str, Any]) -> dict[str, Any]:
    """``null`` from the environment means None (pydantic-settings leaves nested ones as the string)."""
    return {k: _nulls(v) if isinstance(v, dict) else (None if v == "null" else v) for k, v in tree.items()}


def load_config(
    path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> LiverlConfig:
    """The root config: the TOML file (``path``, else ``$LIVERL_CONFIG``), then ``LIVERL__A__B`` environment
    variables (``env``, default ``os.environ``), then keyword ``overrides`` (``learner__lr=1e-4``).

    Parsing is pydantic-settings': TOML through ``TomlConfigSettingsSource``, the environment through
    ``EnvSettingsSource`` (nested by ``__``, case-insensitive, JSON for sections and lists, ``null`` for None).
    """
    env = os.environ if env is None else env
    path = path or env.get("LIVERL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        try:
            data = TomlConfigSettingsSource(LiverlConfig, toml_file=p)()
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {p} is not valid TOML: {e}") from None
    source = EnvSettingsSource(LiverlConfig, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
    source.env_vars = {k.lower(): v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}
    data = _merge(data, _nulls(source()))
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return LiverlConfig(**_merge(data, tree))
