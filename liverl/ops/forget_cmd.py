"""The verbs behind ``liverl forget``: forget a user (audited, under the operator's identity), resume unfinished
erasures, follow one to ``done``, and report which versions trained on a user. The steps are ``liverl.ops.forget``'s.
"""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.table import Table

from core import erasures, fleet
from core.config import LiverlConfig
from liverl.ops import cells
from liverl.ops.admin import open_redis, open_registry
from liverl.ops.forget import Runner, lineage, offer, user_keys


def unit_of(user: str, is_unit: bool) -> str:
    """The unit id of a user key (``core.fleet.unit_id``), or ``user`` itself with ``--unit``."""
    if is_unit:
        if len(user) != 2 * fleet.UNIT_ID_BYTES or any(c not in "0123456789abcdef" for c in user):
            raise ValueError(f"--unit takes a unit id (16 lowercase hex digits, core.fleet.unit_id), not {user!r}")
        return user
    if not user:
        raise ValueError("USER is the user key the product sends (X-Liverl-User or the OpenAI `user` field)")
    unit = fleet.unit_id(user)
    assert unit is not None
    return unit


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _print_erasure(e: erasures.Erasure) -> None:
    r = e.report
    print(f"erasure {e.id}: {e.state}" + (f" at {cells.age(e.finished_at)} ago" if e.finished_at else ""))
    print(f"  user unit {e.unit}, requested by {e.requested_by} ({e.source}): {e.reason}")
    if "key" in r:
        print(f"  data key: {'destroyed' if r['key'].get('destroyed') else 'none held'}")
    if "sums" in r:
        s = r["sums"]
        print(
            f"  per-user sums: {s['fields']} fields deleted from {s['keys_changed']} of {s['keys_scanned']} keys "
            f"scanned ({s.get('bytes_sent', 0)} bytes of commands sent)"
        )
    if "lineage" in r:
        lin = r["lineage"]
        vs = ", ".join(f"v{v['version']} ({v['status']})" for v in lin["versions"]) or "none"
        print(f"  trained on them: {lin['samples']} samples at {len(lin['steps'])} learner steps; versions: {vs}")
        if lin["unknown"]:
            print(f"  the ledger cannot speak for: {', '.join(f'v{v}' for v in lin['unknown'])}")
        if lin["learner_holds"]:
            print("  the learner's current weights hold them: its next candidates will too, until it rebases")
    if "offer" in r:
        o = r["offer"]
        trained = "trained on them" if o["stable_trained_on_them"] else "did not train on them"
        print(f"  stable v{o['stable']} {trained}; offer: v{o['offer']}; policy {o['policy']}")
        for a in o.get("actions", []):
            print(f"    {a}")
        if o.get("retrain"):
            print(f"    retrain requested from v{o['retrain']['from_version']}")
        if o["policy"] == "report" and o["stable_trained_on_them"]:
            print(f'    to serve a version without them: liverl rollback --to {o["offer"]} --reason "erasure {e.id}"')
    if r.get("waiting"):
        print(f"  waiting: {r['waiting']}")


def cmd_forget(
    cfg: LiverlConfig,
    user: str | None,
    reason: str | None,
    token: str | None,
    is_unit: bool = False,
    resume: bool = False,
    ledger: str | None = None,
) -> int:
    """Forget ``user`` (or with ``resume`` only finish unfinished erasures). Unfinished erasures are finished first."""
    if user is None and not resume:
        return _err("name a USER to forget, or --resume (or --status ID, --report USER)")
    if user is not None and not (reason or "").strip():
        return _err("--reason must say why (it is recorded in the audit log with who you are)")
    unit = unit_of(user, is_unit) if user is not None else None
    reg = open_registry(cfg)
    r = open_redis(cfg)
    try:
        from deploy.registry.registry import RegistryError  # noqa: PLC0415

        try:
            actor = reg.authenticate(token, need="operator").name
        except RegistryError as e:
            return _err(str(e))
        run = Runner(cfg, reg, r, user_keys(cfg, reg), actor, ledger_file=ledger)
        for e in run.run_unfinished():
            print(f"resumed erasure {e.id} (user unit {e.unit}): {e.state}")
            if not e.done:
                _print_erasure(e)
        if unit is None:
            return 0
        prior = run.of_unit(unit)
        held = run.held(unit)
        done = [e for e in prior if e.done]
        if not held["key"] and not held["sums"] and (done or not held["samples"]):
            why = (
                f"already forgotten by erasure {done[-1].id} ({cells.age(done[-1].finished_at or 0)} ago): no data "
                "key and no per-user sums since"
                if done
                else "unknown user: no data key, no trained samples in the ledger, no per-user sums"
            )
            run.nothing(unit, actor, reason or "", why)
            print(f"user unit {unit}: {why}. Nothing changed; the attempt is in the audit log (liverl history)")
            return 0
        e = run.request(unit, actor, (reason or "").strip(), source="cli")
        print(
            f"erasure {e.id} of user unit {unit} (data key: {'yes' if held['key'] else 'no'}, trained samples: "
            f"{held['samples']}, per-user sum fields: {held['sums']})"
        )
        e = run.run(e)
        _print_erasure(e)
        return 0 if e.done else 2
    finally:
        r.close()
        reg.close()


def cmd_status(cfg: LiverlConfig, erasure_id: str, follow: bool = True, timeout_s: float = 600.0, as_json=False) -> int:
    """Print erasure ``erasure_id``; with ``follow``, wait for it to reach ``done`` (each state as it comes)."""
    if not erasures.valid_id(erasure_id):
        return _err(f"{erasure_id!r} is not an erasure id (er- and 16 hex digits)")
    reg = open_registry(cfg)
    try:
        deadline, seen = time.monotonic() + timeout_s, None
        while True:
            with reg.engine.connect() as c:
                e = erasures.get(c, erasure_id)
            if e is None:
                return _err(f"no erasure {erasure_id} in {reg.url}")
            if e.state != seen and not as_json:
                print(f"{time.strftime('%H:%M:%S')} {erasure_id}: {e.state}")
                seen = e.state
            if e.done or not follow or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    finally:
        reg.close()
    if as_json:
        print(json.dumps(e.as_dict(), indent=2))
    else:
        _print_erasure(e)
    if follow and not e.done:
        return _err(f"erasure {erasure_id} is still {e.state} after {timeout_s:g} s")
    return 0


def cmd_report(
    cfg: LiverlConfig, user: str, is_unit: bool = False, ledger: str | None = None, as_json: bool = False
) -> int:
    """Which versions trained on ``user``: from the learner's ledger and the registry, as they are now."""
    from learner.ledger import checkpoint_path_for, ledger_path  # noqa: PLC0415

    unit = unit_of(user, is_unit)
    reg = open_registry(cfg)
    try:
        path = ledger or ledger_path(checkpoint_path_for(cfg))
        try:
            lin = lineage(unit, path, reg)
        except FileNotFoundError as e:
            return _err(f"{e}: run this where the learner runs (its state dir), or pass --ledger")
        got = offer(reg, [v["version"] for v in lin["versions"]], lin["unknown"])
        with reg.engine.connect() as c:
            past = [x.as_dict() for x in erasures.of_unit(c, unit)]
    finally:
        reg.close()
    out = {"unit": unit, **lin, **got, "erasures": [{k: x[k] for k in ("id", "state", "requested_at")} for x in past]}
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    t = Table(title=f"versions trained on user unit {unit} ({lin['samples']} samples, ledger {lin['ledger']})")
    for col in ("version", "status", "learner step", "samples", "created"):
        t.add_column(col, justify="left" if col == "status" else "right")
    for v in lin["versions"]:
        t.add_row(
            f"v{v['version']}",
            v["status"],
            str(v["learner_step"]),
            str(v["samples"]),
            cells.age(v["created_at"]) + " ago",
        )
    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(t)
    con.print(
        f"stable v{got['stable']} {'trained' if got['stable_trained_on_them'] else 'did not train'} on them; the "
        f"newest once-stable version that did not: v{got['offer']}"
    )
    if lin["unknown"]:
        con.print(f"the ledger cannot speak for {', '.join(f'v{v}' for v in lin['unknown'])} (left out of the offer)")
    if lin["lines_without_units"]:
        con.print(f"{lin['lines_without_units']} ledger lines do not record units (written before units were)")
    for x in out["erasures"]:
        con.print(f"erasure {x['id']}: {x['state']}")
    return 0
