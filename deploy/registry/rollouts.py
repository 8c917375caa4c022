"""The registry's rollouts (canaries): begun with their version's status change, ended with its outcome.

A version becomes ``canary`` only together with its ``Rollout`` row (``begin_rollout``, one transaction), and leaves
it only by ending that rollout (``finish_rollout_promote`` / ``finish_rollout_abort``, or an operator's direct
``promote``/``set_status``, which end it as ``ended`` through ``end_rollouts_of``). Every rollout write bumps its
``revision``: the gate saves its evidence by compare-and-set on it (``save_rollout_evidence``) and promotes only a
rollout that is still ``running``, so an operator's ``pause`` or ``abort`` between the gate's read and its write is
never overwritten. ``reap_orphan_canaries`` rejects a ``canary`` version no active rollout runs (a gate stopped
between the status change and the rollout row, or a row edited by hand).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session

from deploy.registry.regdb import RegistryConflict, RegistryDB, RegistryError, lock, version_row
from deploy.registry.tables import ACTIVE_ROLLOUT_STATES, MAX_LOOKS, ROLLOUT_UNITS, Rollout, Version


def rollout_row(s: Session, rollout_id: int, for_update: bool = True) -> Rollout:
    q = select(Rollout).where(Rollout.id == rollout_id).execution_options(populate_existing=True)
    ro = s.execute(q.with_for_update() if for_update else q).scalars().first()
    if ro is None:
        raise RegistryError(f"unknown rollout {rollout_id}")
    return ro


def active_rows(s: Session, for_update: bool = False) -> list[Rollout]:
    q = select(Rollout).where(Rollout.state.in_(ACTIVE_ROLLOUT_STATES)).order_by(Rollout.id)
    return list(s.execute(q.with_for_update() if for_update else q).scalars())


def close_rollout(ro: Rollout, state: str, reason: str | None, verdict: str | None = None) -> None:
    ro.state, ro.ended_at, ro.revision = state, time.time(), ro.revision + 1
    if reason is not None:
        ro.reason = reason
    if verdict is not None:
        ro.verdict = verdict


def end_rollouts_of(s: Session, row: Version, why: str) -> str:
    """End (state ``ended``) the active rollouts of ``row``'s version, inside the caller's transaction; the text
    the caller's audit entry carries about it."""
    ended = [ro for ro in active_rows(s, for_update=True) if ro.version == row.version]
    for ro in ended:
        close_rollout(ro, "ended", why)
    return "".join(f"; rollout {ro.id} ended" for ro in ended)


def finite_json(value, what: str):
    """``value`` if it is JSON without NaN or infinities (PostgreSQL's JSON has neither); ValueError otherwise."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"a rollout's {what} must be JSON with finite numbers only (leave out a -inf running maximum, "
            f"it is the default): {e}"
        ) from e
    return value


def _checked_nodes(share: float, nodes: Sequence[str], unit: str, deadline_at: float) -> list[str]:
    """The canary nodes as a list, once a rollout's terms are checked; ``RegistryError`` for bad ones."""
    if not (isinstance(share, int | float) and 0.0 < share <= 1.0):
        raise RegistryError(f"a rollout's share is in (0, 1], got {share!r}")
    nodes = list(nodes)
    if not nodes or not all(isinstance(n, str) and n for n in nodes):
        raise RegistryError(f"a rollout needs its canary nodes, by name; got {nodes!r}")
    if unit not in ROLLOUT_UNITS:
        raise RegistryError(f"a rollout's unit is one of {ROLLOUT_UNITS}, got {unit!r}")
    if not math.isfinite(deadline_at):
        raise RegistryError(f"a rollout's deadline_at is a time (seconds since the epoch), got {deadline_at!r}")
    return nodes


def _orphans(s: Session, for_update: bool) -> tuple[list[Version], list[Rollout]]:
    """``canary`` versions no active rollout runs, and active rollouts whose version is not ``canary``."""
    active = active_rows(s, for_update=for_update)
    canaries = s.execute(select(Version).where(Version.status == "canary")).scalars().all()
    running = {ro.version for ro in active}
    status = (
        {v.version: v.status for v in s.execute(select(Version).where(Version.version.in_(running))).scalars()}
        if running
        else {}
    )
    return (
        [v for v in canaries if v.version not in running],
        [ro for ro in active if status.get(ro.version) != "canary"],
    )


class Rollouts:
    """Begin, read, record evidence on, pause, promote, abort and end the rollouts in ``db``."""

    def __init__(self, db: RegistryDB):
        self.db = db

    def begin_rollout(
        self,
        version: int,
        stable_version: int,
        share: float,
        nodes: Sequence[str],
        unit: str,
        deadline_at: float,
        settings: Mapping | None,
        actor: str,
        reason: str,
    ) -> Rollout:
        """Start the canary of ``version`` against ``stable_version``: in one transaction the version goes from
        ``candidate`` to ``canary`` and its ``Rollout`` (state ``running``, revision 1) is inserted. ``settings`` (JSON,
        finite) is written once here: what must stay fixed for the rollout's life (e.g. the guardrails' nulls).

        ``RegistryConflict`` if another rollout is active, ``version`` is not a candidate, or the stable version is not
        ``stable_version`` any more; ``RegistryError`` for bad terms.
        """
        nodes = _checked_nodes(share, nodes, unit, deadline_at)
        settings = finite_json(dict(settings or {}), "settings")
        with self.db.tx() as s:
            lock(s)
            row = version_row(s, version)
            if row.status != "candidate":
                raise RegistryConflict(f"version {version} is {row.status}, not a candidate: no rollout begun")
            stable = s.execute(select(Version.version).where(Version.status == "stable")).scalars().all()
            if stable != [stable_version]:
                raise RegistryConflict(
                    f"the stable version is {','.join(map(str, stable)) or 'none'}, not "
                    f"{stable_version}: no rollout of v{version} begun"
                )
            if active := active_rows(s, for_update=True):
                raise RegistryConflict(
                    f"rollout {active[0].id} (canary v{active[0].version}) is {active[0].state}: "
                    f"one rollout at a time, v{version} not begun"
                )
            ro = Rollout(
                version=version,
                checksum=row.checksum,
                stable_version=stable_version,
                share=float(share),
                nodes=nodes,
                unit=unit,
                state="running",
                started_at=time.time(),
                deadline_at=float(deadline_at),
                settings=settings,
                test_state={},
                looks=[],
                verdict=None,
                reason=reason,
                revision=1,
                ended_at=None,
            )
            s.add(ro)
            row.status, row.status_reason = "canary", reason
            s.flush()  # the rollout's id
            self.db.append_audit(
                s,
                actor,
                "canary_start",
                version,
                f"rollout {ro.id}: {share:.0%} of {unit}s on "
                f"{', '.join(nodes)}, against stable v{stable_version}; {reason}",
            )
        return ro

    def active_rollout(self) -> Rollout | None:
        """The rollout in progress (``running`` or ``paused``), or None."""
        with self.db.session() as s:
            rows = active_rows(s)
        return rows[-1] if rows else None

    def rollout(self, rollout_id: int) -> Rollout:
        with self.db.session() as s:
            return rollout_row(s, rollout_id, for_update=False)

    def rollouts(self, limit: int | None = 20) -> list[Rollout]:
        """Rollouts, newest first."""
        q = select(Rollout).order_by(Rollout.id.desc())
        with self.db.session() as s:
            return list(s.execute(q if limit is None else q.limit(limit)).scalars())

    def save_rollout_evidence(
        self,
        rollout_id: int,
        expect_revision: int,
        test_state: Mapping,
        looks: Sequence[Mapping],
        verdict: str | None,
        reason: str | None,
    ) -> Rollout:
        """The gate's evidence after a look, by compare-and-set: written only if the rollout is still at
        ``expect_revision`` and active; ``RegistryConflict`` otherwise (re-read it and look again). Never changes the
        state. ``looks``: the whole list, of which the last ``MAX_LOOKS`` are kept. Returns the rollout as written."""
        test_state = finite_json(dict(test_state), "test_state")
        looks = finite_json(list(looks)[-MAX_LOOKS:], "looks")
        with self.db.tx() as s:
            done = cast(
                "sa.CursorResult[Any]",
                s.execute(
                    sa.update(Rollout)
                    .where(
                        Rollout.id == rollout_id,
                        Rollout.revision == expect_revision,
                        Rollout.state.in_(ACTIVE_ROLLOUT_STATES),
                    )
                    .values(
                        test_state=test_state,
                        looks=looks,
                        verdict=verdict,
                        reason=reason,
                        revision=Rollout.revision + 1,
                    )
                    .execution_options(synchronize_session=False)
                ),
            )  # an UPDATE's result is a CursorResult (rowcount), which Session.execute's annotation does not say
            ro = rollout_row(s, rollout_id, for_update=False)
            if done.rowcount != 1:
                raise RegistryConflict(
                    f"rollout {rollout_id} is at revision {ro.revision} ({ro.state}), not "
                    f"{expect_revision}: evidence not saved; re-read the rollout"
                )
        return ro

    def set_rollout_state(self, rollout_id: int, state: str, actor: str, reason: str) -> Rollout:
        """An operator pauses (``paused``: evidence is still gathered and an abort still happens, but no promotion) or
        resumes (``running``) a rollout; audited, and the revision moves, so a gate step that read it before fails
        its compare-and-set."""
        if state not in ACTIVE_ROLLOUT_STATES:
            raise RegistryError(
                f"a rollout is set to one of {ACTIVE_ROLLOUT_STATES}, not {state!r} (ending it: "
                "finish_rollout_promote / finish_rollout_abort)"
            )
        if not reason:
            raise RegistryError("pausing or resuming a canary needs a reason for the audit log")
        with self.db.tx() as s:
            lock(s)
            ro = rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state}: it is over")
            if ro.state == state:
                raise RegistryError(f"the canary of v{ro.version} is already {state}")
            ro.state, ro.revision = state, ro.revision + 1
            self.db.append_audit(s, actor, "canary_pause" if state == "paused" else "canary_resume", ro.version, reason)
        return ro

    def finish_rollout_promote(
        self, rollout_id: int, expected_stable: int, actor: str, reason: str, expect_revision: int | None = None
    ) -> Rollout:
        """Promote the rollout's canary, in one transaction, only if the rollout is still ``running`` (not paused, not
        over), at ``expect_revision`` when given, its version still ``canary`` and the stable version still
        ``expected_stable``: rollout ``promoted``, the version ``stable``, the old stable ``retired`` (as ``promote``).
        ``RegistryConflict`` otherwise, with nothing changed: a decision taken on a stale read never lands."""
        with self.db.tx() as s:
            lock(s)
            ro = rollout_row(s, rollout_id)
            if ro.state != "running":
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state}: not promoted")
            if expect_revision is not None and ro.revision != expect_revision:
                raise RegistryConflict(
                    f"rollout {rollout_id} is at revision {ro.revision}, not {expect_revision}: "
                    "not promoted; re-read it"
                )
            row = version_row(s, ro.version)
            if row.status != "canary":
                raise RegistryConflict(f"version {ro.version} is {row.status}, not canary: not promoted")
            old = s.execute(select(Version).where(Version.status == "stable")).scalars().all()
            if [o.version for o in old] != [expected_stable]:
                raise RegistryConflict(
                    f"the stable version is {','.join(str(o.version) for o in old) or 'none'}, not "
                    f"{expected_stable}: v{ro.version} not promoted"
                )
            for o in old:
                o.status, o.status_reason = "retired", f"replaced by {ro.version}"
            row.status, row.status_reason, row.promoted_at = "stable", reason, time.time()
            close_rollout(ro, "promoted", reason, verdict="promote")
            self.db.append_audit(
                s, actor, "promote", ro.version, f"{reason} (was {expected_stable}; rollout {rollout_id})"
            )
        return ro

    def finish_rollout_abort(self, rollout_id: int, actor: str, reason: str, verdict: str | None = None) -> Rollout:
        """Abort a rollout that is not over (running or paused), in one transaction: rollout ``aborted`` (with
        ``verdict`` when given, e.g. ``srm``), its version ``rejected`` if it is still ``canary``. Audited.
        ``RegistryConflict`` if the rollout is over already."""
        if not reason:
            raise RegistryError("aborting a canary needs a reason for the audit log")
        with self.db.tx() as s:
            lock(s)
            ro = rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state} already")
            row = version_row(s, ro.version)
            if row.status == "canary":
                row.status, row.status_reason = "rejected", reason
            close_rollout(ro, "aborted", reason, verdict=verdict)
            self.db.append_audit(
                s, actor, "canary_abort", ro.version, f"{reason} (rollout {rollout_id}; v{ro.version} {row.status})"
            )
        return ro

    def end_rollout(self, rollout_id: int, actor: str, reason: str) -> Rollout:
        """End a rollout that is not over as ``ended`` (its version is not canary any more, e.g. an operator promoted
        or rejected it directly) without touching the version. ``RegistryConflict`` if it is over already."""
        with self.db.tx() as s:
            lock(s)
            ro = rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state} already")
            close_rollout(ro, "ended", reason)
            self.db.append_audit(s, actor, "canary_end", ro.version, f"{reason} (rollout {rollout_id})")
        return ro

    def reap_orphan_canaries(self, actor: str = "gate") -> list[int]:
        """Reject every ``canary`` version that no active rollout runs (a gate stopped between its status change and
        its rollout row, a registry edited by hand), and end every active rollout whose version is not ``canary`` any
        more. Audited; returns the rejected versions. The gate calls it every step: it writes only when there is
        something to reap."""
        with self.db.session() as s:
            if not any(_orphans(s, for_update=False)):
                return []
        with self.db.tx() as s:
            lock(s)
            versions, rollouts = _orphans(s, for_update=True)
            for v in versions:
                why = (
                    "orphan canary: no rollout in the registry runs it (a gate stopped between starting it and "
                    "recording its rollout, or the row was edited)"
                )
                v.status, v.status_reason = "rejected", why
                self.db.append_audit(s, actor, "rejected", v.version, why)
            for ro in rollouts:
                close_rollout(ro, "ended", f"v{ro.version} is not canary any more")
                self.db.append_audit(
                    s, actor, "canary_end", ro.version, f"rollout {ro.id} ended: v{ro.version} is not canary any more"
                )
        return [v.version for v in versions]
