"""What ``liverl up`` and ``liverl demo`` hand their children: the whole config, keys included."""

from __future__ import annotations

import pytest

from deploy.signing import generate_keypair
from liverl.core.config import load_config
from liverl.stack import Stack
from liverl.supervisor import SECTIONS, child_env, ensure_keys


def _stack(tmp_path) -> Stack:  # the addresses a started stack reports (no process is started here)
    return Stack(bootstrap="127.0.0.1:19999", redis_url="redis://127.0.0.1:6379/0",
                 registry_url=f"sqlite:///{tmp_path / 'registry.db'}", blob_dir=str(tmp_path / "blobs"))


def test_a_child_keeps_the_configured_keys_and_every_section(tmp_path):
    """Finding N4: child_env dropped ``security``, so configured keys became "no signing, no verification"."""
    private, public = generate_keypair(tmp_path / "etc-liverl")
    cfg = load_config(env={}, state_dir=str(tmp_path / "state"), security__signing_key=str(private),
                      security__verify_key=str(public), security__announce_ttl_s=120.0)
    env = child_env(cfg, _stack(tmp_path), tmp_path / "model")
    child = load_config(env=env)
    assert child.security == cfg.security
    assert (child.security.signing_key, child.security.verify_key) == (str(private), str(public))
    assert "security" in SECTIONS
    for section in SECTIONS:  # nothing else is dropped either (the stack's addresses are the child's own)
        if section not in ("broker", "redis", "registry", "model"):
            assert getattr(child, section) == getattr(cfg, section), section


def test_ensure_keys_makes_a_pair_once_and_refuses_a_configured_key_that_is_not_there(tmp_path):
    cfg = load_config(env={}, state_dir=str(tmp_path / "state"))
    ensure_keys(cfg)
    pair = [cfg.state_path / "keys" / name for name in ("announce.key", "announce.pub")]
    made = [p.read_bytes() for p in pair]
    ensure_keys(cfg)  # a restart keeps the pair
    assert [p.read_bytes() for p in pair] == made
    missing = load_config(env={}, state_dir=str(tmp_path / "other"), security__verify_key=str(tmp_path / "no.pub"))
    with pytest.raises(ValueError, match="security.verify_key .* is not a file"):
        ensure_keys(missing)
