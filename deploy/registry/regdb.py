"""The registry's database, shared by its parts: engine, sessions, the write lock, and the audit append.

Concurrency: several processes (learner, gate, CLI) share the registry. Version numbers come from a counter
row locked for update (PostgreSQL ``SELECT … FOR UPDATE``; SQLite: every write transaction is ``BEGIN IMMEDIATE``
on a WAL database with a busy timeout), so concurrent writers never get the same number; a crash between
allocation and insert leaves a gap, as a sequence would. Status changes take the same lock (``lock``), so two
concurrent promotions cannot leave two stable versions. Heavy work (encoding, blob writes) happens outside
transactions; each transaction is short.

Schema: Alembic migrations in ``deploy.registry.migrations``; opening a registry upgrades its database to head (under a
lock, so several processes may open one database at once) and stamps a database that has the tables but no
migration record.

Audit log: every entry is chained by plain hash and, with an audit key (``security.audit_key``, never stored in the
database), by HMAC; the chain's head is anchored in Redis (``deploy.registry.auditchain`` says exactly what that
detects). Without a key a registry whose log is not keyed yet writes unkeyed entries (and says so in the log once); a
registry whose log is keyed refuses writes from a process without the key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import sqlalchemy as sa
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deploy.registry.auditchain import AuditHead, audit_mac
from deploy.registry.migrations import upgrade_connection
from deploy.registry.tables import AuditEntry, Counter, Version, audit_hash, make_engine

log = logging.getLogger("liverl.registry")


INSUFFICIENT_PRIVILEGE = "42501"
"""PostgreSQL's SQLSTATE for a statement the role has no privilege for (or a row-level security policy refuses)."""


class RegistryError(ValueError):
    """A registry operation that cannot be done as asked (unknown version, wrong status, ...)."""


class AuthError(RegistryError):
    """No operator with that token, a disabled one, or a role that may not do what was asked."""


class RegistryConflict(RegistryError):
    """The registry changed under a compare-and-set (another gate or an operator got there first)."""


def lock(s: Session) -> Counter:
    """Take the registry's write lock (the version counter row, for update) inside ``s``'s transaction."""
    return s.execute(select(Counter).where(Counter.name == "version").with_for_update()).scalar_one()


def version_row(s: Session, version: int) -> Version:
    """The row of ``version``; ``RegistryError`` if there is none."""
    row = s.get(Version, version)
    if row is None:
        raise RegistryError(f"unknown version {version}; `liverl versions` lists the known ones")
    return row


class RegistryDB:
    """The database at ``url``, migrated to head on opening: read sessions, write transactions, the audit append.

    ``audit_key``: the key of the audit log's HMAC chain (``deploy.registry.auditchain``; None: unkeyed, see the
    module doc).
    ``audit_head``: where the chain's head is anchored after every append (Redis; needs ``audit_key``).
    """

    def __init__(self, url: str, audit_key: bytes | None = None, audit_head: AuditHead | None = None):
        if audit_head is not None and audit_key is None:
            raise ValueError("an audit head anchor needs the audit key (security.audit_key) it is tagged with")
        # for messages and logs: a role's password (registry.password_file) stays out
        self.url = sa.engine.make_url(url).render_as_string(hide_password=True)
        self.audit_key, self.audit_head = audit_key, audit_head
        self.anchor_failures = 0  # appends whose head could not be anchored (Redis down): verify reports a lag
        self._warned_unkeyed = False
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)  # reads
        writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        self._write_sessions = sessionmaker(writer, expire_on_commit=False)
        try:
            with writer.begin() as conn:  # one locked transaction: migrate (or stamp) and seed the counter
                upgrade_connection(conn)
                if conn.execute(select(Counter.value).where(Counter.name == "version")).first() is None:
                    conn.execute(sa.insert(Counter).values(name="version", value=1))  # 0 is the base's
        except sa.exc.ProgrammingError as e:
            if getattr(e.orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
                raise
            self.engine.dispose()
            why = str(e.orig).splitlines()[0]
            raise RegistryError(
                f"the registry at {self.url} is not at this release's schema (or not made yet) and this process's "
                f"database role may not migrate it ({why}): migrate it once as its owner, e.g. `liverl db roles "
                "--url OWNER_URL --keys DIR --apply` (DIR: the folder `liverl keys` made the passwords in), which "
                "migrates before it grants"
            ) from e

    def close(self) -> None:
        self.engine.dispose()
        if self.audit_head is not None:
            self.audit_head.close()

    def session(self) -> Session:
        """A read session (a context manager)."""
        return self._sessions()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """A write transaction (SQLite: BEGIN IMMEDIATE, so it waits for the lock instead of failing later). Once it
        has committed, the audit head it appended (if any) is anchored."""
        with self._write_sessions() as s:
            with s.begin():
                yield s
            head = s.info.pop("audit_head", None)
        if head is not None:
            self._anchor(*head)

    def get(self, version: int) -> Version:
        """The row of ``version``; ``RegistryError`` if there is none."""
        with self._sessions() as s:
            return version_row(s, version)

    def _anchor(self, seq: int, mac: str) -> None:
        if self.audit_head is None:
            return
        assert self.audit_key is not None  # __init__ refuses an anchor without the key
        try:
            self.audit_head.advance(self.audit_key, seq, mac)
        except redis.RedisError as e:  # the entry is committed; the anchor lags until the next append, and says so
            self.anchor_failures += 1
            log.warning(
                "audit entry %d committed but its head not anchored in Redis (%s): `liverl history --verify` "
                "reports the anchor lagging until the next audited change",
                seq,
                e,
            )

    def append_audit(
        self, s: Session, actor: str, action: str, version: int | None, reason: str | None, seal: bool = False
    ) -> None:
        """Append one audit entry inside ``s``'s transaction, chained to the previous one (under the registry lock, so
        the chain is linear): by plain hash, and by HMAC with the audit key (``deploy.registry.auditchain``).

        With the key, the entry after an unkeyed one would vouch for every entry before it; it is written only as an
        admin's explicit seal (``seal``, ``Operators.seal_audit``), never by an ordinary write: a log whose MACs were
        stripped looks exactly like one written before the key existed."""
        lock(s)
        last = s.execute(
            select(AuditEntry.seq, AuditEntry.mac, AuditEntry.entry_hash).order_by(AuditEntry.id.desc()).limit(1)
        ).first()
        if last is None:
            seq, prev, link = 1, "", ""
        else:
            seq = (
                last.seq + 1
                if last.seq is not None
                else s.execute(select(func.count()).select_from(AuditEntry)).scalar_one() + 1
            )
            prev, link = last.entry_hash or "", last.mac or last.entry_hash or ""
        at, mac = time.time(), None
        if self.audit_key is not None and last is not None and last.mac is None and not seal:
            raise RegistryError(
                "the registry's audit log has no keyed entry at its end: it was written before the audit key "
                "existed, or someone stripped its MACs. A keyed write would vouch for it, so none is made: check "
                "`liverl history`, then an admin seals it with `liverl history --seal REASON`"
            )
        if self.audit_key is not None:
            mac = audit_mac(self.audit_key, link, seq, actor, action, version, reason, at)
            s.info["audit_head"] = (seq, mac)  # anchored once the transaction commits (``tx``)
        elif last is not None and last.mac is not None:
            raise RegistryError(
                "the registry's audit log is keyed and this process has no audit key, so it may not "
                "change the registry: set security.audit_key to the key file its other writers use "
                "(`liverl up` makes <state_dir>/keys/audit.key)"
            )
        elif not self._warned_unkeyed:
            self._warned_unkeyed = True
            log.warning(
                "the audit log is not keyed (no security.audit_key): `liverl history --verify` cannot detect an "
                "entry rewritten with the chain recomputed, or a cut tail"
            )
        s.add(
            AuditEntry(
                actor=actor,
                action=action,
                version=version,
                reason=reason,
                at=at,
                prev_hash=prev,
                entry_hash=audit_hash(prev, actor, action, version, reason, at),
                seq=seq,
                mac=mac,
            )
        )
