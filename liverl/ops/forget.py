"""``liverl forget``: erase one user, as a restart-safe state machine, and report which versions trained on them.

An erasure (``core.erasures``: its row, its states) runs these steps, each idempotent, each one's result saved with
the state it reaches, in one transaction, by compare-and-set (two runners never both advance it):

1. ``key_destroyed``: the user's data key is destroyed (``core.shred.UserKeys.destroy``): what was sealed under it
   (samples, join-table entries, blobs) can no longer be opened by anyone.
2. ``sums_deleted``: the user's per-user sums in Redis are deleted: the fields ``<unit>|<f>`` (``keys.UNIT_FIELDS``)
   of every ``<p>:units:{<v>}:<bucket>`` hash, found by a SCAN that matches only those keys (``forget.scan_count``
   a batch) and deleted by pipelined ``HDEL`` of exactly those fields. The buckets' aggregates (``*|<f>``) keep the
   user's counts without naming them.
3. ``lineage_read``: the learner's ledger (each trained sample's unit, ``learner.ledger``) says which learner steps
   trained on the user; ``liverl.ops.lineage.Lineages`` says which versions hold those steps. Where the ledger is not
   readable (it lives beside the learner's checkpoint), the erasure waits in ``sums_deleted`` with the reason in its
   report until a runner that can read it (``liverl forget --resume`` where the learner runs) takes it on.
4. ``offered``: the offer is the newest version that was stable once and did not train on them; ``forget.policy``
   says what is done with it: ``report`` (nothing), ``rollback`` (the registry's audited rollback to the offer, when
   the stable version trained on them; a canary holding them is aborted and such pending candidates rejected: the
   gate then signs and announces the result, nothing here writes the announcements) or ``retrain`` (marked, for an
   operator).
5. ``done``: the audit log records the erasure's outcome.

A runner killed at any point (``kill -9``) leaves the row in the state of the last step saved; the next run repeats
the step in hand, which finds its work done or does it again (``destroy`` of a destroyed key, ``HDEL`` of absent
fields, a rollback already made). ``run_unfinished`` finishes every such erasure: ``liverl forget --resume``, every
``liverl forget`` before its own, and the gate's loop (``forget.run_in_gate``) for those the product filed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from core import erasures, keys
from core.config import LiverlConfig
from core.erasures import Erasure
from liverl.ops.lineage import Lineages, RegistryView, read_ledger

log = logging.getLogger("liverl.forget")

ONCE_STABLE = ("stable", "retired", "rolled_back")
"""Statuses of versions that were stable once: a rollback may return to them."""

AUDIT_REQUEST, AUDIT_DONE, AUDIT_NOTHING = "forget", "forget_done", "forget_nothing"


# -- what Redis holds of a user --------------------------------------------------------------------------------------


@dataclass
class SumsPass:
    """One pass over the per-user sums' keys: what it read and wrote."""

    keys_scanned: int = 0  # keys the SCAN returned (only <p>:units:* keys)
    keys_changed: int = 0  # keys that held the user's fields
    fields: int = 0  # the user's fields found (or deleted)
    commands: int = 0  # HDEL / HMGET commands sent
    bytes_sent: int = 0  # the HDEL / HMGET commands' arguments (keys and field names): nothing else is sent
    bytes_read: int = 0  # the values HMGET read back (HDEL: none)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _unit_fields(unit: str) -> list[str]:
    return [f"{unit}|{f}" for f in keys.UNIT_FIELDS]


def _batches(it: Iterable, n: int) -> Iterable[list]:
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def user_sums(redis, prefix: str, unit: str, count: int = 1000, delete: bool = False) -> SumsPass:
    """Find (``delete``: delete) the user's fields in every per-user sums hash of ``prefix``. The SCAN matches
    ``<p>:units:*`` only, ``count`` keys a round trip; each batch is one pipeline of ``HDEL`` (or ``HMGET``) of exactly
    the unit's fields (``keys.UNIT_FIELDS``), so nothing else is read or written. Redis Cluster: the pipeline is not a
    transaction (its keys sit in different slots)."""
    fields = _unit_fields(unit)
    out = SumsPass()
    for batch in _batches(redis.scan_iter(match=keys.units_pattern(prefix), count=count), count):
        out.keys_scanned += len(batch)
        pipe = redis.pipeline(transaction=False)
        for key in batch:
            if delete:
                pipe.hdel(key, *fields)
            else:
                pipe.hmget(key, fields)
        for key, got in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            out.commands += 1
            if isinstance(got, Exception):
                if not keys.wrong_type(got):
                    raise got
                continue  # not a hash: ingest replaces it at its next write, and it holds no user's field
            n = int(got) if delete else sum(1 for x in got if x is not None)
            k = key.encode() if isinstance(key, str) else key
            out.bytes_sent += len(k) + sum(len(f) for f in fields)
            if not delete:
                out.bytes_read += sum(len(x) for x in got if x is not None)
            if n:
                out.keys_changed += 1
                out.fields += n
    return out


# -- which versions trained on a user --------------------------------------------------------------------------------


def lineage(unit: str, ledger_file: Path, registry) -> dict[str, Any]:
    """Which versions trained on ``unit``'s samples (``read_ledger(unit=)``, ``Lineages``): the versions with their
    status and learner step, the steps and samples, versions the ledger cannot speak for (``unknown``: their learner
    step is not in it, e.g. rolled over), and whether the learner's current weights hold them (``learner_holds``: its
    newest segment trained on them). ``FileNotFoundError`` when there is no ledger at ``ledger_file``."""
    ledger_file = Path(ledger_file)
    if not ledger_file.exists() and not ledger_file.with_name(ledger_file.name + ".1").exists():
        raise FileNotFoundError(f"no learner ledger at {ledger_file}")
    led = read_ledger(ledger_file, unit=unit)
    reg = RegistryView.load(registry)
    lin = Lineages(led, reg)
    holding: set[int] = set()
    for fb in led.of_unit:
        holding.update(lin.holding(fb))
    unknown = sorted(
        v
        for v, row in reg.versions.items()
        if v != 0 and v not in lin.segment_of and v not in holding and row.learner_step is not None
    )
    newest = len(led.segments) - 1
    samples_of: dict[int, int] = {}
    for fb in led.of_unit:
        for v in lin.holding(fb):
            samples_of[v] = samples_of.get(v, 0) + 1
    return {
        "ledger": str(ledger_file),
        "samples": len(led.of_unit),
        "steps": sorted({fb.step for fb in led.of_unit}),
        "versions": [
            {
                "version": v,
                "status": reg.versions[v].status,
                "learner_step": reg.versions[v].learner_step,
                "samples": samples_of.get(v, 0),
                "created_at": reg.versions[v].created_at,
            }
            for v in sorted(holding)
        ],
        "unknown": unknown,
        "lines_without_units": led.without_units,
        # the learner's weights now: its newest segment's steps, on top of the version that segment started from
        "learner_holds": any(fb.segment == newest for fb in led.of_unit) or led.segments[newest].base in holding,
    }


def offer(registry, holding: Iterable[int], unknown: Iterable[int] = ()) -> dict[str, Any]:
    """The stable version, whether it trained on the user, and the offer: the newest version that was stable once
    (``ONCE_STABLE``) and neither trained on them nor is one the ledger cannot speak for (the base, v0, at worst)."""
    bad = set(holding) | set(unknown)
    stable = int(registry.stable().version)
    candidates = [
        int(v.version)
        for v in registry.list()
        if v.status in ONCE_STABLE and (v.promoted_at is not None or v.version == 0) and int(v.version) not in bad
    ]
    best = max(candidates, default=None)
    return {"stable": stable, "stable_trained_on_them": stable in bad, "offer": stable if stable not in bad else best}


# -- the runner ------------------------------------------------------------------------------------------------------


def _conn(s):
    return s.connection()


class Runner:
    """Runs erasures for one deployment: ``registry`` (a ``Registry``), ``redis`` (sync, either decoding), ``user_keys``
    (a ``core.shred.UserKeys``), ``actor`` (who runs: an operator's name, or ``gate``), ``ledger_file`` (the
    learner's ledger; ``learner.ledger.ledger_path`` by default)."""

    def __init__(self, cfg: LiverlConfig, registry, redis, user_keys, actor: str, ledger_file: Path | None = None):
        from learner.ledger import checkpoint_path_for, ledger_path  # noqa: PLC0415 torch-free; beside the verb

        self.cfg, self.registry, self.redis, self.user_keys, self.actor = cfg, registry, redis, user_keys, actor
        self.prefix = cfg.topics.prefix
        self.ledger_file = Path(ledger_file) if ledger_file else ledger_path(checkpoint_path_for(cfg))

    # what is held -------------------------------------------------------------------------------------------------

    def held(self, unit: str) -> dict[str, Any]:
        """What the deployment holds of ``unit``, read only: a data key, trained samples in the ledger, per-user
        sums."""
        out: dict[str, Any] = {"key": bool(self.user_keys.known(unit))}
        try:
            out["samples"] = len(read_ledger(self.ledger_file, unit=unit).of_unit) if self.ledger_file.exists() else 0
        except OSError:
            out["samples"] = 0
        out["sums"] = user_sums(self.redis, self.prefix, unit, self.cfg.forget.scan_count).fields
        return out

    # the rows -----------------------------------------------------------------------------------------------------

    def get(self, erasure_id: str) -> Erasure | None:
        with self.registry.engine.connect() as c:
            return erasures.get(c, erasure_id)

    def of_unit(self, unit: str) -> list[Erasure]:
        with self.registry.engine.connect() as c:
            return erasures.of_unit(c, unit)

    def request(self, unit: str, requested_by: str, reason: str, source: str = "cli") -> Erasure:
        """A new erasure of ``unit``, recorded with its audit entry in one transaction."""
        with self.registry.db.tx() as s:
            e = erasures.insert(_conn(s), unit, requested_by, reason, source)
            self.registry.db.append_audit(s, requested_by, AUDIT_REQUEST, None, _request_line(e))
        return e

    def nothing(self, unit: str, actor: str, reason: str, why: str) -> None:
        """Audit a forget that found nothing to erase (an unknown user, or one already forgotten)."""
        self.registry.log_action(actor, AUDIT_NOTHING, f"user unit {unit}: {why}; reason: {reason}")

    # running ------------------------------------------------------------------------------------------------------

    def run_unfinished(self, limit: int = 100) -> list[Erasure]:
        """Run every erasure not done (oldest first); those waiting for the ledger stay as they are."""
        with self.registry.engine.connect() as c:
            todo = erasures.unfinished(c, limit)
        return [self.run(e) for e in todo]

    def run(self, e: Erasure) -> Erasure:
        """Drive ``e`` to ``done``, or as far as this runner can (a ledger it cannot read). Returns it as it ends."""
        steps = {
            "pending": self._destroy_key,
            "key_destroyed": self._delete_sums,
            "sums_deleted": self._read_lineage,
            "lineage_read": self._offer,
            "offered": self._finish,
        }
        while not e.done:
            report = json.loads(json.dumps(e.report))  # a copy: a step that stops leaves e as saved
            got = steps[e.state](e, report)
            if got is None:  # waiting: the reason is saved in the report, the state stays
                e.report = report
                return e
            state, audit = got
            with self.registry.db.tx() as s:
                moved = erasures.advance(_conn(s), e, state, report)
                if moved and audit:
                    self.registry.db.append_audit(s, self.actor, audit[0], audit[1], audit[2])
            if not moved:  # another runner advanced it: go on from where it is
                fresh = self.get(e.id)
                assert fresh is not None, f"erasure {e.id} vanished"
                e = fresh
        return e

    def _destroy_key(self, e: Erasure, report: dict):
        existed = bool(self.user_keys.destroy(e.unit))
        report["key"] = {"destroyed": existed or bool(report.get("key", {}).get("destroyed")), "at": time.time()}
        report["runner"] = self.actor
        audit = None
        if e.source == "api":  # the product's request, audited when a runner with an audit key takes it
            audit = (AUDIT_REQUEST, None, _request_line(e))
        return "key_destroyed", audit

    def _delete_sums(self, e: Erasure, report: dict):
        t0 = time.perf_counter()
        got = user_sums(self.redis, self.prefix, e.unit, self.cfg.forget.scan_count, delete=True).as_dict()
        before = report.get("sums", {})
        got["fields"] += int(before.get("fields", 0))  # a pass before a crash deleted some already
        got["seconds"] = round(time.perf_counter() - t0, 4)
        report["sums"] = got
        return "sums_deleted", None

    def _read_lineage(self, e: Erasure, report: dict):
        try:
            report["lineage"] = lineage(e.unit, self.ledger_file, self.registry)
        except FileNotFoundError as err:
            report["waiting"] = (
                f"{err} on this runner ({self.actor}): the learner's ledger says which versions trained on the user; "
                "run `liverl forget --resume` where the learner runs (its state dir), or pass --ledger"
            )
            with self.registry.engine.begin() as c:  # the reason, for `liverl forget --status`; the state stays
                c.execute(
                    sa.update(erasures.TABLE)
                    .where(erasures.TABLE.c.id == e.id, erasures.TABLE.c.state == e.state)
                    .values(report=json.dumps(report, sort_keys=True))
                )
            return None
        report.pop("waiting", None)
        return "lineage_read", None

    def _offer(self, e: Erasure, report: dict):
        lin = report["lineage"]
        holding = [v["version"] for v in lin["versions"]]
        policy = self.cfg.forget.policy
        got = offer(self.registry, holding, lin["unknown"])
        got["policy"] = policy
        got["actions"] = []
        if policy == "rollback":
            got["actions"] = self._rollback(e, got, set(holding) | set(lin["unknown"]))
        elif policy == "retrain":
            got["retrain"] = {
                "requested": True,
                "from_version": got["offer"],
                "why": "versions trained on an erased user",
                "versions": holding,
            }
        report["offer"] = got
        return "offered", None

    def _rollback(self, e: Erasure, got: dict, bad: set[int]) -> list[str]:
        """Policy ``rollback``: the registry's own audited changes, each skipped when already made (a rerun)."""
        from deploy.registry.registry import RegistryConflict, RegistryError  # noqa: PLC0415 (torch, with the verb)

        why = f"erasure {e.id}: the version trained on an erased user"
        done: list[str] = []
        ro = self.registry.active_rollout()
        if ro is not None and int(ro.version) in bad:
            try:
                self.registry.finish_rollout_abort(ro.id, actor=self.actor, reason=why, verdict="operator")
                self.registry.record_gate(ro.version, "canary", None, None, False, why)
                done.append(f"aborted the canary v{ro.version}")
            except RegistryConflict as err:
                done.append(f"canary v{ro.version} not aborted: {err}")
        for c in self.registry.candidates():
            if int(c.version) in bad:
                try:
                    self.registry.set_status(c.version, "rejected", actor=self.actor, reason=why, expect="candidate")
                    done.append(f"rejected candidate v{c.version}")
                except RegistryConflict:
                    pass  # the gate judged it meanwhile
        stable = int(self.registry.stable().version)
        if stable in bad and got["offer"] is not None:
            try:
                self.registry.rollback(actor=self.actor, reason=why, to=got["offer"])
                done.append(f"rolled back from v{stable} to v{got['offer']}")
            except RegistryError as err:
                done.append(f"not rolled back to v{got['offer']}: {err}")
        elif any(a.action == "rollback" and (a.reason or "").startswith(why) for a in self.registry.audit(limit=500)):
            done.append(f"rolled back to v{stable} (by an earlier run of this erasure)")
        return done

    def _finish(self, e: Erasure, report: dict):
        o, lin = report.get("offer", {}), report.get("lineage", {})
        key = "destroyed" if report.get("key", {}).get("destroyed") else "none"
        trained = ", ".join(f"v{v['version']}" for v in lin.get("versions", [])[:20])
        line = (
            f"erasure {e.id} of user unit {e.unit}: key {key}, {report.get('sums', {}).get('fields', 0)} per-user "
            f"sum fields deleted, {len(lin.get('versions', []))} versions trained on them"
            + (f" ({trained})" if trained else "")
            + f"; policy {o.get('policy')}, offer v{o.get('offer')}"
            + (f": {'; '.join(o['actions'])}" if o.get("actions") else "")
        )
        return "done", (AUDIT_DONE, None, line)


def _request_line(e: Erasure) -> str:
    return f"erasure {e.id} of user unit {e.unit} ({e.source}, by {e.requested_by}): {e.reason}"


def user_keys(cfg: LiverlConfig, registry):
    """The deployment's per-user data keys (``core.shred.UserKeys``), in the registry's database. An erasure only asks
    whether a key exists and deletes it, neither of which unwraps one: without a key-encryption key (nothing was ever
    sealed, so no row can exist) a zero key stands in."""
    from core.shred import KEY_BYTES, UserKeys, load_kek  # noqa: PLC0415 (the shredding module)

    kek = load_kek(cfg)
    return UserKeys(registry.db, kek if kek is not None else bytes(KEY_BYTES))


def gate_chore(gate) -> None:
    """``liverl gate``'s loop (``forget.run_in_gate``): run the erasures not done yet with the gate's registry and
    Redis, as ``gate``. Those the product filed are audited by it; one that needs the learner's ledger where the gate
    has none waits (its report says so) for ``liverl forget --resume`` where the learner runs."""
    cfg, reg = gate.cfg, gate.registry
    with reg.engine.connect() as c:
        if not erasures.unfinished(c, limit=1):
            return
    for e in Runner(cfg, reg, gate.redis, user_keys(cfg, reg), "gate").run_unfinished():
        if e.done:
            log.info("gate: erasure %s of user unit %s done", e.id, e.unit)
