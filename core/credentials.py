"""The front door's shared secrets: files, never Redis.

- **Assignment key** (``security.assignment_key``, default ``<state_dir>/keys/assignment.key``): the router's secret
  for a user's bucket in a rollout (``fleet.bucket``). Every router of a fleet reads the same file; nothing else
  needs it, so no caller can compute which arm a user key lands on.
- **Product key** (``security.feedback_key``, default ``<state_dir>/keys/feedback.key``): what ``POST /v1/feedback``
  requires in its ``X-Liverl-Product-Key`` header. One key a line, so a new key can be added before the old one is
  removed. Feedback published to Kafka does not use it (the broker's own authentication covers producers).

``liverl up`` makes both (``ensure_secrets``: 32 random bytes, URL-safe base64, mode 0600) unless configured.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from core.config import LiverlConfig

PRODUCT_KEY_HEADER = "X-Liverl-Product-Key"
ASSIGNMENT_NAME, FEEDBACK_NAME = "assignment.key", "feedback.key"
MIN_SECRET_LEN = 16


def _path(cfg: LiverlConfig, configured: str | None, name: str) -> Path | None:
    if configured:
        return Path(configured)
    default = cfg.state_path / "keys" / name
    return default if default.exists() else None


def assignment_key_path(cfg: LiverlConfig) -> Path | None:
    """``security.assignment_key``, else ``<state_dir>/keys/assignment.key`` if present."""
    return _path(cfg, cfg.security.assignment_key, ASSIGNMENT_NAME)


def feedback_key_path(cfg: LiverlConfig) -> Path | None:
    """``security.feedback_key``, else ``<state_dir>/keys/feedback.key`` if present."""
    return _path(cfg, cfg.security.feedback_key, FEEDBACK_NAME)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} at {path}: {e}") from e


def load_assignment_key(cfg: LiverlConfig) -> bytes:
    """The router's assignment secret. Raises ValueError, saying how to make one, when there is none or it is short."""
    path = assignment_key_path(cfg)
    if path is None:
        raise ValueError(
            "the router needs an assignment key to split users between a rollout's arms: set security.assignment_key "
            f"to a file of at least {MIN_SECRET_LEN} random bytes, the same file for every router (for example "
            "`umask 077; head -c 32 /dev/urandom | base64 > /etc/liverl/assignment.key`); `liverl up` makes "
            f"{cfg.state_path / 'keys' / ASSIGNMENT_NAME}"
        )
    key = _read(path, "assignment key (security.assignment_key)").strip()
    if len(key) < MIN_SECRET_LEN:
        raise ValueError(
            f"the assignment key at {path} has {len(key)} bytes; it needs at least {MIN_SECRET_LEN} random ones"
        )
    return key


def load_feedback_keys(cfg: LiverlConfig) -> list[bytes] | None:
    """The product keys ``POST /v1/feedback`` accepts (one a line), or None when none is configured or made. Raises
    ValueError for a configured file that is missing or holds a short key."""
    path = feedback_key_path(cfg)
    if path is None:
        return None
    found = [line.strip() for line in _read(path, "product key file (security.feedback_key)").splitlines()]
    found = [k for k in found if k]
    if not found:
        raise ValueError(f"the product key file {path} (security.feedback_key) holds no key")
    if short := [i for i, k in enumerate(found, 1) if len(k) < MIN_SECRET_LEN]:
        raise ValueError(
            f"the product key file {path} has keys shorter than {MIN_SECRET_LEN} characters (key "
            f"{', '.join(map(str, short))}); use random ones, e.g. `openssl rand -base64 32`"
        )
    return found


def write_secret(path: Path) -> Path:
    """A new random secret at ``path`` (mode 0600, written under a temporary name and renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.replace(tmp, path)
    return path


def ensure_secrets(cfg: LiverlConfig) -> None:
    """``liverl up``: make the assignment key and the product key under ``<state_dir>/keys`` once, unless configured."""
    for configured, name in (
        (cfg.security.assignment_key, ASSIGNMENT_NAME),
        (cfg.security.feedback_key, FEEDBACK_NAME),
    ):
        path = cfg.state_path / "keys" / name
        if not configured and not path.exists():
            write_secret(path)
