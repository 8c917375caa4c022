"""The record of a prefix's releases, read by ``liverl up``: the release that freed a prefix goes into the audit log
of the deployment that takes it (``liverl release-prefix``, ``liverl.ops.release``, makes the records)."""

from __future__ import annotations

import json

import sqlalchemy as sa

from core import keys
from core.config import LiverlConfig
from liverl.stack.deployment import Deployment

ACTION = "release-prefix"
"""The audit log's action for a release."""


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def audit_reason(rec: dict) -> str:
    """The audit log's text of a release record."""
    d = rec.get("released")
    what = (
        f"deployment {d['id']} (state dir {d['state_dir']}" + (f" on {d['host']})" if d.get("host") else ")")
        if d
        else "keys no deployment claimed"
    )
    by = "" if rec["authenticated"] else f"; unauthenticated: {rec['os_user']} on {rec['host']}"
    by = (f"; for deployment {rec['for']}" if rec.get("for") else "") + by
    return f"released the Redis prefix {rec['prefix']!r} from {what}: {rec['reason']} (release {rec['id']}{by})"


def log_release(cfg: LiverlConfig, redis, me: Deployment) -> dict | None:
    """Copy the newest release of ``topics.prefix`` into the audit log of the configured registry, unless it is there
    already or was made for another deployment than ``me`` (its ``for``: the id in the state dir it was run with):
    what ``liverl up`` calls once it has recorded its deployment, so the release that freed the prefix is in the
    history of the deployment that took it. Returns the record it logged, or None."""
    raw = redis.lindex(keys.releases(cfg.topics.prefix), -1)
    if raw is None:
        return None
    rec = json.loads(_text(raw))
    if rec.get("for") not in (None, me.id):
        return None
    from deploy.registry.registry import open_registry  # noqa: PLC0415 torch: only when there is a release to log
    from deploy.registry.tables import AuditEntry  # noqa: PLC0415 (as above)

    reg = open_registry(cfg)
    try:
        with reg.db.session() as sess:
            logged = sess.execute(
                sa.select(AuditEntry.id).where(
                    AuditEntry.action == ACTION, AuditEntry.reason.contains(f"(release {rec['id']}")
                )
            ).first()
        if logged is not None:
            return None
        reg.log_action(rec["by"], ACTION, audit_reason(rec))
    finally:
        reg.close()
    return rec
