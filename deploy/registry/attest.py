"""What the audit log vouches for: the stable version and the running canary, as audited actions made them.

The gate signs the announcements the fleet follows, and it keeps them fresh from the registry at every step. The
registry's ``versions`` and ``rollouts`` rows can be written by anyone who holds the database's credentials; the audit
log's entries cannot be forged without the audit key, which the database never holds (``deploy.registry.auditchain``).
So the gate signs only what the audit log says: the version of the newest verified ``init``, ``promote`` or
``rollback`` entry (each written in the same transaction as the status change, by the gate's own decision or by an
operator's audited action), and the canary of the newest verified ``canary_start`` not ended since. One SQL
``UPDATE versions SET status = 'stable'`` on a rejected candidate then changes nothing the fleet serves: the gate
refuses to sign it, says so in its log and in ``liverl_gate_unattested_total``, and the agents, which check that the
registry confirms the announced status, stay on what they serve.

``Attestor`` follows the log forward. Its first read starts at the newest entry that set a stable version or started
a canary (with the entry before it, for its link); every later read verifies only the entries appended since. Each
entry is checked as ``check_chain`` checks it: its MAC over the previous link under the audit key, or, for entries
written without a key, the plain hash chain. The anchored head in Redis must not be past the log's end (a cut tail).
A verification failure is sticky: the attestor vouches for nothing more until the process restarts, because every
later entry hangs on the broken link (``liverl history --verify`` finds the entry).

Without an audit key (``security.audit_key`` unset) the plain hash chain is all there is, and whoever can write the
database can recompute it: attestation then holds against a careless edit, not against an attacker. ``liverl up``
makes the key. With the key, a log that ends without a MAC vouches for nothing: it is one written before the key
(sealed once by an admin, ``Registry.seal_audit``) or one whose MACs were stripped and its plain chain recomputed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from sqlalchemy import select

from deploy.registry.auditchain import audit_mac, head_tag
from deploy.registry.regdb import RegistryDB
from deploy.registry.tables import AuditEntry, audit_hash

STABLE_ACTIONS = frozenset({"init", "promote", "rollback", "set_stable"})
"""Audit actions written in the same transaction as a version becoming stable."""
CANARY_ENDS = frozenset({"canary_end", "canary_abort", "promote", "rejected", "rollback"})
"""Audit actions after which a version that was a canary is not one any more (as is any ``set_<status>``)."""


@dataclass(frozen=True)
class Attested:
    """What the verified audit log says is stable and on canary; ``problem``: why it vouches for nothing."""

    stable: int | None
    canary: int | None
    problem: str | None = None


class Attestor:
    """Reads the audit log forward from where it last verified it (one per gate process)."""

    def __init__(self, db: RegistryDB):
        self.db = db
        self._last_id: int | None = None
        self._link = ""
        self._prev_hash = ""
        self._seq: int | None = None
        self._keyed = False
        self._stable: int | None = None
        self._canary: int | None = None
        self._problem: str | None = None

    def refresh(self) -> Attested:
        """Verify the entries appended since the last call and return what the log vouches for now."""
        if self._problem is None:
            try:
                self._read()
                self._check_head()
            except _Broken as e:
                if not e.sticky:
                    return Attested(None, None, str(e))
                self._problem = str(e)
        if self._problem is not None:
            return Attested(None, None, self._problem)
        if self.db.audit_key is not None and not self._keyed:  # all of it recomputable without the key
            return Attested(
                None,
                None,
                "the audit log ends without a MAC: written before the audit key existed, or stripped of its MACs; "
                "an admin reads it and seals it (`liverl history --seal`)",
            )
        return Attested(self._stable, self._canary)

    def _read(self) -> None:
        with self.db.session() as s:
            if self._last_id is None:
                start = s.execute(
                    select(AuditEntry.id)
                    .where(AuditEntry.action.in_(STABLE_ACTIONS))
                    .order_by(AuditEntry.id.desc())
                    .limit(1)
                ).scalar()
                if start is None:
                    raise _Broken("no audit entry records a stable version yet (is the registry initialised?)", False)
                canary = s.execute(
                    select(AuditEntry.id)
                    .where(AuditEntry.action == "canary_start")
                    .order_by(AuditEntry.id.desc())
                    .limit(1)
                ).scalar()
                if canary is not None:
                    start = min(start, canary)
                before = s.execute(
                    select(AuditEntry).where(AuditEntry.id < start).order_by(AuditEntry.id.desc()).limit(1)
                ).scalar()
                if before is not None:
                    self._link = before.mac or before.entry_hash or ""
                    self._prev_hash = before.entry_hash or ""
                    self._seq = before.seq
                    self._keyed = before.mac is not None
                entries = s.execute(select(AuditEntry).where(AuditEntry.id >= start).order_by(AuditEntry.id)).scalars()
            else:
                entries = s.execute(
                    select(AuditEntry).where(AuditEntry.id > self._last_id).order_by(AuditEntry.id)
                ).scalars()
            for e in entries:
                self._verify(e)
                self._apply(e)
                self._last_id = e.id

    def _verify(self, e: AuditEntry) -> None:
        if self._seq is not None and e.seq is not None and e.seq != self._seq + 1:
            raise _Broken(f"audit entry {e.id} is number {e.seq} of the chain after number {self._seq}")
        if e.mac is not None:
            key = self.db.audit_key
            if key is None:
                raise _Broken("the audit log is keyed and this process has no audit key (security.audit_key)")
            if e.seq is None or not hmac.compare_digest(
                e.mac, audit_mac(key, self._link, e.seq, e.actor, e.action, e.version, e.reason, e.at)
            ):
                raise _Broken(f"audit entry {e.id}'s MAC does not verify: it, or an entry before it, was rewritten")
            self._keyed, self._link = True, e.mac
        else:
            if self._keyed:
                raise _Broken(f"audit entry {e.id} has no MAC but follows keyed entries")
            if e.prev_hash != self._prev_hash or e.entry_hash != audit_hash(
                self._prev_hash, e.actor, e.action, e.version, e.reason, e.at
            ):
                raise _Broken(f"audit entry {e.id} does not match the hash chain")
            self._link = e.entry_hash or ""
        self._prev_hash = e.entry_hash or ""
        if e.seq is not None:
            self._seq = e.seq

    def _apply(self, e: AuditEntry) -> None:
        if e.action in STABLE_ACTIONS:
            self._stable = e.version
        if e.action == "canary_start":
            self._canary = e.version
        elif e.version == self._canary and (e.action in CANARY_ENDS or e.action.startswith("set_")):
            self._canary = None

    def _check_head(self) -> None:
        head, key = self.db.audit_head, self.db.audit_key
        if head is None or key is None:
            return
        try:
            anchor = head.read()
        except Exception:  # noqa: BLE001 - Redis down: the tail is checked at the next read, nothing is vouched less
            return
        if anchor is None:
            return
        if not hmac.compare_digest(anchor.tag, head_tag(key, head.prefix, anchor.seq, anchor.mac)):
            raise _Broken(f"the audit head in Redis ({head.key}) does not verify with the audit key", False)
        if self._seq is not None and anchor.seq > self._seq:
            self._read()  # appended and anchored after the entries were read: the log must reach the anchor now
        if self._seq is not None and anchor.seq > self._seq:
            raise _Broken(
                f"the audit head anchored in Redis is entry number {anchor.seq}, the log ends at number {self._seq}: "
                "its tail was cut"
            )


class _Broken(Exception):
    def __init__(self, why: str, sticky: bool = True):
        super().__init__(why)
        self.sticky = sticky
