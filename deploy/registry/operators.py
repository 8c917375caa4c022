"""The registry's operators and its audit log: who may change the registry, and what each change was.

An operator authenticates with a token shown once at creation; the registry stores only its sha256. Roles are
ordered (``deploy.registry.tables.ROLES``): a role may do what every role below it may. Every change to the registry
appends an audit entry (``RegistryDB.append_audit``); ``verify_audit`` walks the chain (``deploy.registry.auditchain``).
"""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import func, select

from deploy.registry.auditchain import AuditCheck, check_chain
from deploy.registry.regdb import AuthError, RegistryDB, RegistryError, lock
from deploy.registry.tables import ROLES, AuditEntry, Operator


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Operators:
    """Create, disable and authenticate the operators in ``db``; append to, read and verify its audit log."""

    def __init__(self, db: RegistryDB):
        self.db = db

    def add_operator(self, name: str, role: str, by: str, reason: str) -> str:
        """Create an operator and return their token (shown once; only its sha256 is stored)."""
        if role not in ROLES:
            raise RegistryError(f"unknown role {role!r}; one of {ROLES}")
        if not name or len(name) > 64:
            raise RegistryError("an operator name is 1 to 64 characters")
        token = "lvr_" + secrets.token_urlsafe(32)
        with self.db.tx() as s:
            lock(s)
            if s.get(Operator, name) is not None:
                raise RegistryError(f"operator {name!r} exists already (disable it first to re-issue a token)")
            s.add(
                Operator(
                    name=name,
                    role=role,
                    token_hash=hash_token(token),
                    created_at=time.time(),
                    created_by=by,
                    disabled=False,
                )
            )
            self.db.append_audit(s, by, "add_operator", None, f"{name} as {role}: {reason}")
        return token

    def disable_operator(self, name: str, by: str, reason: str) -> None:
        with self.db.tx() as s:
            op = s.get(Operator, name)
            if op is None:
                raise RegistryError(f"no operator {name!r}")
            op.disabled = True
            op.token_hash = f"disabled:{op.token_hash}"[:64]
            self.db.append_audit(s, by, "disable_operator", None, f"{name}: {reason}")

    def operators(self) -> list[Operator]:
        with self.db.session() as s:
            return list(s.execute(select(Operator).order_by(Operator.name)).scalars())

    def authenticate(self, token: str | None, need: str = "operator") -> Operator:
        """The operator whose token this is, if their role is at least ``need``; ``AuthError`` otherwise."""
        if not token:
            raise AuthError(
                f"this command changes the registry and needs an operator token (the {need} role or higher): set "
                f"LIVERL_TOKEN or pass --token-file (an admin creates one with `liverl operator add NAME --role {need} "
                f'--reason "..."`)'
            )
        with self.db.session() as s:
            op = s.execute(select(Operator).where(Operator.token_hash == hash_token(token.strip()))).scalar()
        if op is None or op.disabled:
            raise AuthError("the operator token is unknown or disabled")
        if ROLES.index(op.role) < ROLES.index(need):
            raise AuthError(f"operator {op.name} is a {op.role}; this needs the {need} role")
        return op

    def verify_audit(self) -> AuditCheck:
        """Walk the audit chain (plain hash for unkeyed entries, HMAC for keyed ones) and compare its end with the
        head anchored in Redis: ``deploy.registry.auditchain.check_chain``; ``.ok``, ``.problem``, ``.bad_id``,
        ``.warnings``."""
        q = select(AuditEntry).order_by(AuditEntry.id).execution_options(yield_per=1000)
        with self.db.session() as s:  # streamed a thousand rows at a time: the log grows with every candidate
            return check_chain(s.scalars(q), self.db.audit_key, self.db.audit_head)

    def seal_audit(self, actor: str, reason: str) -> int:
        """Make the audit log keyed from here: an ``audit_seal`` entry, keyed, vouching for the unkeyed entries before
        it (a log written before the audit key existed). Only this call extends an unkeyed log with a key, so an admin
        decides it, having read the log: a log whose MACs were stripped looks exactly the same. Returns how many
        unkeyed entries it sealed; ``RegistryError`` without the key, or when the log does not end unkeyed."""
        if not reason:
            raise RegistryError("sealing the audit log needs a reason for the audit log")
        if self.db.audit_key is None:
            raise RegistryError("sealing the audit log needs the audit key (security.audit_key)")
        with self.db.tx() as s:
            lock(s)
            last = s.execute(select(AuditEntry.mac).order_by(AuditEntry.id.desc()).limit(1)).first()
            if last is None or last.mac is not None:
                raise RegistryError("the audit log does not end with an unkeyed entry: there is nothing to seal")
            n = s.execute(select(func.count()).select_from(AuditEntry).where(AuditEntry.mac.is_(None))).scalar_one()
            self.db.append_audit(s, actor, "audit_seal", None, f"{n} unkeyed entries sealed: {reason}", seal=True)
        return int(n)

    def held(self) -> AuditEntry | None:
        """The operator's hold on the learner's candidates (``liverl hold``), when the newest ``hold`` or ``release``
        entry of the audit log is a hold: that entry; None otherwise. The learner reads it beside the Redis flag, so
        a Redis writer who deletes the flag does not lift it: only an audited release does."""
        q = select(AuditEntry).where(AuditEntry.action.in_(("hold", "release"))).order_by(AuditEntry.id.desc()).limit(1)
        with self.db.session() as s:
            last = s.execute(q).scalar()
        return last if last is not None and last.action == "hold" else None

    def log_action(self, actor: str, action: str, reason: str, version: int | None = None) -> None:
        """Record an operator action that changes no version row (e.g. holding the learner) in the audit log."""
        if not reason:
            raise RegistryError(f"{action} needs a reason for the audit log")
        with self.db.tx() as s:
            self.db.append_audit(s, actor, action, version, reason)

    def audit_seq(self) -> int:
        """The id of the newest audit entry (0: none): the registry's one sequence, shared by every writer. A signed
        announcement carries it (``VersionAnnouncement.seq``), read before the state it announces, so readers order
        announcements by the decisions behind them, not by the signers' clocks."""
        with self.db.session() as s:
            return int(s.execute(select(func.max(AuditEntry.id))).scalar_one() or 0)

    def audit(self, version: int | None = None, limit: int | None = None) -> list[AuditEntry]:
        """Audit entries, oldest first (the last ``limit`` when given)."""
        q = select(AuditEntry).order_by(AuditEntry.id.desc())
        if version is not None:
            q = q.where(AuditEntry.version == version)
        if limit is not None:
            q = q.limit(limit)
        with self.db.session() as s:
            return list(s.execute(q).scalars())[::-1]
