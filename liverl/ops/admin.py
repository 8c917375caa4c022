"""The operator verbs behind ``liverl status | versions | history | promote | rollback``.

Each returns a process exit code and prints rich tables. They read the registry (``cfg.registry_url``, blobs in
``cfg.blob_location``) and Redis (live acceptance ``<prefix>:live:<version>``, heartbeats ``<prefix>:served:<node>``);
promote/rollback change the registry (audited) and then write ``<prefix>:desired`` so the serving agents swap.
abort/pause/resume (and promoting the canary) change the rollout in the registry (audited), where the gate reads it.
The CLI imports this module only when one of these verbs runs (``liverl --help`` stays light), and every verb opens
the registry (torch), so the imports sit at the top.
"""

from __future__ import annotations

import getpass
import sys
import time
from typing import TYPE_CHECKING, Any

import redis
import torch
from rich.console import Console
from rich.table import Table

from core import fleet, keys
from core.config import LiverlConfig, redact_url
from core.services import setup_redis, signing_key_path
from deploy.registry.registry import RegistryError
from deploy.registry.registry import open_registry as _open_registry
from deploy.registry.signing import Signer, announce, withdraw
from liverl.ops import cells
from liverl.ops.mismatch_table import mismatch_table
from liverl.stack.deployment import check_operator

if TYPE_CHECKING:
    from deploy.registry.registry import Registry


def open_redis(cfg: LiverlConfig) -> redis.Redis:
    r = setup_redis(cfg, decode_responses=True)
    check_operator(cfg, r)  # the registry and the Redis prefix are one deployment's, or the command refuses
    return r


def open_registry(cfg: LiverlConfig) -> Registry:
    return _open_registry(cfg)


def _console():
    # no rich markup: reasons, actors, blob keys and prompts are shown as written ("[a]12+34=" stays whole)
    return Console(width=None if sys.stdout.isatty() else 160, markup=False)


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _live(r: redis.Redis, prefix: str, versions: list[int]) -> dict[int, dict[str, int]]:
    """The versions' live counters (none for a key of another type: ingest replaces it at its next write)."""
    pipe = r.pipeline(transaction=False)  # the versions' hashes live in different Cluster slots
    for v in versions:
        pipe.hgetall(keys.live(prefix, v))
    got = dict(zip(versions, pipe.execute(raise_on_error=False), strict=True))
    if bad := [h for h in got.values() if isinstance(h, Exception) and not keys.wrong_type(h)]:
        raise bad[0]
    return {v: keys.live_totals({k: int(x) for k, x in h.items()}) for v, h in got.items() if isinstance(h, dict) and h}


def _served(r: redis.Redis, prefix: str) -> dict[str, dict[str, Any]]:
    return {name: beat.model_dump() for name, beat in sorted(fleet.read_heartbeats(r, prefix).items())}


def _redis_or_none(cfg: LiverlConfig):
    try:
        r = open_redis(cfg)
        r.ping()
    except redis.RedisError as e:
        print(f"warning: Redis unreachable ({e}); live acceptance and served versions are not shown", file=sys.stderr)
        return None
    return r


def _versions_table(reg: Registry, r, prefix: str, limit: int | None, title: str):
    rows = reg.list(limit=limit)
    scores: dict[int, dict[str, float]] = {}
    for g in reg.gate_results():
        scores.setdefault(g.version, {})[g.check] = g.value
    live = _live(r, prefix, [v.version for v in rows]) if r is not None else {}
    served_by: dict[int, list[str]] = {}
    for node, s in (_served(r, prefix) if r is not None else {}).items():
        served_by.setdefault(s.get("version"), []).append(node)
    t = Table(title=title)
    for col in (
        "version",
        "status",
        "parent",
        "age",
        "delta",
        "ratio",
        "changed",
        "KL",
        "entropy",
        "suite",
        "live acceptance",
        "served by",
    ):
        t.add_column(col, justify="left" if col in ("status", "served by") else "right")
    for v in rows:
        sc = scores.get(v.version, {})
        t.add_row(
            f"v{v.version}",
            v.status + (f" ({v.status_reason})" if v.status == "rejected" and v.status_reason else ""),
            "-" if v.parent is None else f"v{v.parent}",
            cells.age(v.created_at),
            cells.size(v.delta_bytes if v.blob_kind == "delta" else v.snapshot_bytes)
            + (" snap" if v.blob_kind == "snapshot" else ""),
            "-" if v.ratio is None else f"{v.ratio:.1f}x",
            "-" if v.changed_fraction is None else f"{v.changed_fraction:.1%}",
            "-" if sc.get("drift") is None else f"{sc['drift']:.3f}",
            "-" if sc.get("collapse") is None else f"{sc['collapse']:.2f}",
            "-" if sc.get("suite") is None else f"{sc['suite']:.3f}",
            cells.acceptance(live.get(v.version)),
            ",".join(served_by.get(v.version, [])) or "-",
        )
    return t


def cmd_status(cfg: LiverlConfig) -> int:
    """Stable and desired version, what each node serves, pending candidates, recent versions."""
    prefix = cfg.topics.prefix
    reg = open_registry(cfg)
    try:
        r = _redis_or_none(cfg)
        con = _console()
        try:
            stable = reg.stable()
        except RegistryError as e:
            return _err(f"{e} (registry {redact_url(cfg.registry_url)})")
        view = fleet.fleet_view(reg, r, prefix, cfg.serving.fleet) if r is not None else None
        desired = view.desired if view is not None else None
        pending = reg.candidates()
        con.print(
            f"stable: v{stable.version} (checksum {stable.checksum[:12]}…, "
            f"promoted {cells.age(stable.promoted_at)} ago)"
        )
        con.print("desired: " + (f"v{desired.version} ({desired.reason})" if desired else "not announced"))
        con.print(f"pending candidates: {', '.join(f'v{c.version}' for c in pending) or 'none'}")
        ro = reg.active_rollout()
        if ro is None:
            con.print(
                "rollout: none (a candidate that passes the gate goes on canary when the configured fleet has 2+ nodes)"
            )
        else:
            con.print(
                f"rollout {ro.id}: canary v{ro.version} on {', '.join(ro.nodes)} for {ro.share:.0%} of "
                f"{ro.unit}s, {ro.state}, started {cells.age(ro.started_at)} ago, deadline in "
                f"{max(0.0, ro.deadline_at - time.time()):.0f} s"
            )
            if ro.looks:
                lk = ro.looks[-1]
                users = (
                    "" if lk.get("canary_users") is None else f" ({lk['canary_users']} vs {lk['stable_users']} users)"
                )
                con.print(
                    f"  evidence: kept acceptance canary {cells.pct(lk.get('canary_acceptance'))} on "
                    f"{lk.get('canary_events')} vs stable {cells.pct(lk.get('stable_acceptance'))} on "
                    f"{lk.get('stable_events')}{users}; always-valid p better {lk.get('p_better', 1):.3g}, "
                    f"p worse {lk.get('p_worse', 1):.3g}"
                    + (
                        ""
                        if lk.get("effect") is None
                        else f"; effect {lk['effect']:+.4f} (bias-corrected {lk['effect_corrected']:+.4f})"
                    )
                    + f"; {ro.reason}"
                )
        if r is not None:
            con.print(learner_line(r.hgetall(keys.learner(prefix))))
        table = Table(title="fleet")
        for col in ("node", "version", "checksum", "heartbeat", "serves", "in sync"):
            table.add_column(col)
        for name, n in (view.nodes if view is not None else {}).items():
            table.add_row(
                name,
                f"v{n.beat.version}",
                str(n.beat.checksum or "")[:12] + "…",
                cells.age(n.beat.ts) + " ago",
                ("canary" if n.canary else "stable") if n.known else "UNKNOWN node (not in serving.fleet)",
                "yes" if n.converged else "NO",
            )
        fleet_table = table
        con.print(fleet_table)
        con.print(_versions_table(reg, r, prefix, 5, "recent versions"))
        return 0
    finally:
        reg.close()


def learner_line(live: dict) -> str:
    """One line on the learner from its live state in Redis (``learner.trainer.Learner.publish``): its step, what it
    trained, and its backlog (judged feedback not trained yet, in samples and in seconds of the oldest)."""
    h = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in (live or {}).items()
    }
    if not h:
        return "learner: no live state (not running, or not yet published)"
    text = (
        f"learner: {h.get('state', '?')}, step {h.get('step', '?')}, {h.get('samples_trained', '?')} samples "
        f"trained, last candidate v{h.get('last_candidate', '?')}, published {cells.age(float(h.get('ts', 0)))} ago"
    )
    samples, seconds = int(float(h.get("backlog_samples", -1))), float(h.get("backlog_s", -1))
    if samples < 0:
        return text + "; backlog unknown"
    text += f"; backlog {samples} samples, oldest {seconds:.0f} s"
    if "hop_ingest_s" in h:  # where the last batch's oldest sample waited (Admission.hops)
        text += (
            f" (last batch's oldest: ingest {float(h['hop_ingest_s']):.0f} s, fetch {float(h['hop_fetch_s']):.0f} s, "
            f"learner queue {float(h['hop_queue_s']):.0f} s)"
        )
    return text


def cmd_versions(cfg: LiverlConfig, limit: int | None = 20) -> int:
    """Versions, newest first: lineage, status, delta size and ratio, gate scores, live acceptance, served by."""
    reg = open_registry(cfg)
    try:
        r = _redis_or_none(cfg)
        title = f"versions ({redact_url(cfg.registry_url)})"
        con = _console()
        con.print(_versions_table(reg, r, cfg.topics.prefix, limit, title))
        mismatch = mismatch_table(reg, [v.version for v in reg.list(limit=limit)])
        if mismatch is not None:
            con.print(mismatch)
        return 0
    finally:
        reg.close()


def cmd_diff(cfg: LiverlConfig, a: int, b: int, top: int = 20) -> int:
    """What changed from version ``a`` to ``b``: both rebuilt from the registry (checksum-verified), per tensor
    the share of elements whose bits differ, the largest and the relative change; then the gate's evidence for
    each side by side, and their live acceptance."""
    reg = open_registry(cfg)
    try:
        try:
            ra, rb = reg.get(a), reg.get(b)
            wa, wb = reg.materialize(a), reg.materialize(b)
        except RegistryError as e:
            return _err(str(e))
        checks = {v: {g.check: g for g in reg.gate_results(v)} for v in (a, b)}
        r = _redis_or_none(cfg)
        live = _live(r, cfg.topics.prefix, [a, b]) if r is not None else {}
    finally:
        reg.close()
    con = _console()
    rows, total, changed = [], 0, 0
    for name in sorted(set(wa) | set(wb)):
        ta, tb = wa.get(name), wb.get(name)
        if ta is None or tb is None or ta.shape != tb.shape or ta.dtype != tb.dtype:
            rows.append((name, 1.0, float("nan"), float("nan"), "only in one" if ta is None or tb is None else "shape"))
            continue
        n = ta.numel()
        diff = ta.contiguous().view(-1).view(torch.uint8).view(n, -1) != tb.contiguous().view(-1).view(
            torch.uint8
        ).view(n, -1)
        k = int(diff.any(dim=1).sum())
        total, changed = total + n, changed + k
        if k:
            d = tb.float() - ta.float()
            rows.append((name, k / n, float(d.abs().max()), float(d.norm() / ta.float().norm().clamp_min(1e-12)), ""))
    rows.sort(key=lambda x: -x[3] if x[3] == x[3] else float("-inf"))
    t = Table(
        title=f"v{a} -> v{b}: {len(rows)} of {len(set(wa) | set(wb))} tensors changed, "
        f"{changed / max(total, 1):.2%} of elements"
    )
    for col in ("tensor", "elements changed", "max |change|", "relative change (L2)", "note"):
        t.add_column(col, justify="left" if col in ("tensor", "note") else "right")
    for name, frac, mx, rel, note in rows[:top]:
        t.add_row(name, f"{frac:.2%}", f"{mx:.3g}", f"{rel:.3g}", note)
    if len(rows) > top:
        t.caption = f"the {top} largest relative changes of {len(rows)} (--top N shows more)"
    con.print(t)
    e = Table(title="gate evidence, side by side")
    e.add_column("")
    for row in (ra, rb):
        e.add_column(f"v{row.version}", justify="right")
    e.add_row(
        "status", *(f"{row.status}" + (f" ({row.status_reason})" if row.status_reason else "") for row in (ra, rb))
    )
    e.add_row("parent", *("-" if row.parent is None else f"v{row.parent}" for row in (ra, rb)))
    e.add_row("live acceptance", *(cells.acceptance(live.get(v)) for v in (a, b)))
    for check in sorted(set(checks[a]) | set(checks[b])):
        row = []
        for v in (a, b):
            g = checks[v].get(check)
            row.append(
                "-"
                if g is None
                else f"{'pass' if g.passed else 'FAIL'} {g.value if g.value is None else format(g.value, '.4g')}"
                f" (vs {g.threshold if g.threshold is None else format(g.threshold, '.4g')})"
            )
        e.add_row(check, *row)
    con.print(e)
    return 0


def cmd_history(
    cfg: LiverlConfig, limit: int | None = 50, verify: bool = False, seal: str | None = None, token: str | None = None
) -> int:
    """The audit log: who did what to which version, and why. ``verify``: first check the chain (HMAC with the audit
    key for keyed entries, plain hash for older ones) and its end against the head anchored in Redis; exit 1 when an
    entry was rewritten, removed or added, the tail was cut, or the check could not be made. ``seal`` (a reason; an
    admin's token): key a log that ends unkeyed from here (``Registry.seal_audit``)."""
    reg = open_registry(cfg)
    try:
        if seal is not None:
            try:
                n = reg.seal_audit(reg.authenticate(token, need="admin").name, seal)
            except RegistryError as e:
                return _err(str(e))
            print(f"audit log sealed: the {n} unkeyed entries before it are vouched for by your seal")
        if verify:
            check = reg.verify_audit()
            if check.kind == "tampered":
                return _err(f"the audit log was tampered with: {check.problem}")
            if check.kind == "truncated":
                return _err(f"the audit log's tail was cut: {check.problem}")
            if not check.ok:
                return _err(f"the audit log could not be verified: {check.problem}")
            for w in check.warnings or []:
                print(f"warning: {w}", file=sys.stderr)
            how = (
                f"{check.keyed} keyed (HMAC-SHA256 with the audit key)"
                + (f", {check.unkeyed} older ones chained by hash only" if check.unkeyed else "")
                if check.keyed
                else "chained by hash only (unkeyed)"
            )
            head = f"; head anchored in Redis at entry {check.head_seq}" if check.head_seq is not None else ""
            _console().print(f"audit log intact: {check.entries} entries, {how}{head}")
        t = Table(title="history (audit log)")
        for col in ("when", "actor", "action", "version", "reason"):
            t.add_column(col)
        for a in reg.audit(limit=limit):
            t.add_row(
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.at)),
                a.actor,
                a.action,
                "-" if a.version is None else f"v{a.version}",
                a.reason or "",
            )
        _console().print(t)
        return 0
    finally:
        reg.close()


def _change(cfg: LiverlConfig, verb: str, token: str | None, do) -> int:
    """Authenticate, run a registry change as that operator, then announce the new stable. Redis is checked first;
    should the announcement still fail, the gate reconciles it with the registry on its next step."""
    r = open_redis(cfg)
    try:
        r.ping()
    except redis.RedisError as e:
        return _err(f"Redis unreachable ({e}); nothing changed. The agents follow Redis, so {verb} needs it.")
    reg = open_registry(cfg)
    try:
        who = reg.authenticate(token, need="operator")
        row = do(reg, who.name)
        seq = reg.audit_seq()  # the change's own entry included: it outranks what the gate signed before it
    except RegistryError as e:
        return _err(str(e))
    finally:
        reg.close()
    key = signing_key_path(cfg)
    if key is None and not cfg.security.allow_unsigned:  # the agents would refuse it: write nothing over the gate's
        r.close()
        print(
            f"warning: {verb}: v{row.version} is now stable in the registry (audited), but NOT announced: this host "
            "has no announcement signing key (security.signing_key), and the agents refuse unsigned announcements. "
            f"The fleet moves only when the gate signs and announces the registry's stable version, at its next step "
            f"(gate.poll_s {cfg.gate.poll_s:g} s) while it runs: check with `liverl status`.",
            file=sys.stderr,
        )
        return 0
    with r:
        announce(
            r,
            cfg.topics.prefix,
            row.version,
            row.checksum,
            f"{verb}: {row.status_reason or ''}".strip(),
            Signer(key) if key else None,
            ttl_s=cfg.security.announce_ttl_s,
            seq=seq,
        )
    print(f"{verb}: v{row.version} is now stable (checksum {row.checksum[:12]}…); announced to the fleet")
    return 0


def cmd_promote(cfg: LiverlConfig, version: int, reason: str, token: str | None, force: bool = False) -> int:
    """Make ``version`` stable and announce it. A version the gate rejected, or a candidate it has not judged
    yet, needs ``force``."""

    def promote(reg, actor):
        row = reg.get(version)
        if row.status == "candidate" and not force:
            raise RegistryError(
                f"version {version} is a candidate the gate has not judged yet; wait for the gate "
                "(liverl versions), or pass --force to promote it unjudged"
            )
        return reg.promote(version, actor=actor, reason=reason, force=force)

    return _change(cfg, "promote", token, promote)


def cmd_rollback(cfg: LiverlConfig, reason: str, token: str | None, to: int | None = None) -> int:
    """Serve the previous stable version (or ``to``) again and announce it."""
    return _change(cfg, "rollback", token, lambda reg, actor: reg.rollback(actor=actor, reason=reason, to=to))


def cmd_hold(cfg: LiverlConfig, hold: bool, reason: str, token: str | None) -> int:
    """Hold the learner's candidates (it keeps training) or release them; audited."""
    r = open_redis(cfg)
    reg = open_registry(cfg)
    try:
        try:
            actor = reg.authenticate(token, need="operator").name
        except RegistryError as e:
            return _err(str(e))
        reg.log_action(actor, "hold" if hold else "release", reason)
        if hold:
            r.set(keys.learner_hold(cfg.topics.prefix), "1")
        else:
            r.delete(keys.learner_hold(cfg.topics.prefix))
    finally:
        reg.close()
        r.close()
    _console().print(("holding" if hold else "released") + f" the learner's candidates ({actor}: {reason})")
    return 0


ROLLOUT_ACTIONS = ("abort", "pause", "resume", "promote")


def cmd_rollout(cfg: LiverlConfig, action: str, reason: str, token: str | None) -> int:
    """``abort``, ``pause`` or ``resume`` the canary in progress, or ``promote`` it to the whole fleet now (Argo
    Rollouts' verbs); each needs an operator token and a reason, and is audited.

    They change the rollout in the registry, where the gate reads it at every step (not the Redis plan, which is only
    a display): ``pause`` keeps the canary's share but the gate will not promote it (it still aborts it if a metric is
    shown worse); a gate step that had read the rollout before the pause cannot promote it (its write is a
    compare-and-set). ``abort`` rejects the canary at once and deletes its announcement, so the canary nodes return to
    stable even while the gate is down. ``promote`` makes the canary stable and announces it to the whole fleet (the
    rollout ends).
    """
    if action not in ROLLOUT_ACTIONS:
        raise ValueError(f"unknown rollout action {action!r}; one of {ROLLOUT_ACTIONS}")
    if action == "promote":

        def promote(reg, actor):
            ro = reg.active_rollout()
            if ro is None:
                raise RegistryError("no canary is in progress (`liverl status` shows the rollout)")
            return reg.promote(
                ro.version,
                actor=actor,
                reason=f"canary promoted by {actor}: {reason}",
                expected_stable=ro.stable_version,
            )

        return _change(cfg, "promote", token, promote)
    reg = open_registry(cfg)
    try:
        try:
            actor = reg.authenticate(token, need="operator").name
            ro = reg.active_rollout()
            if ro is None:
                return _err("no canary is in progress (`liverl status` shows the rollout)")
            if action == "abort":
                why = f"aborted by {actor}: {reason}"
                ro = reg.finish_rollout_abort(ro.id, actor=actor, reason=why, verdict="operator")
                reg.record_gate(ro.version, "canary", None, None, False, why)
                try:  # its nodes return to stable whether or not the gate runs
                    with open_redis(cfg) as r:
                        withdraw(r, cfg.topics.prefix, "canary")
                    gone = "its announcement withdrawn"
                except redis.RedisError as e:
                    gone = f"its announcement not withdrawn ({e}; the gate withdraws it at its next step)"
                msg = f"canary v{ro.version} aborted and rejected; {gone}: its nodes ({', '.join(ro.nodes)}) return "
                msg += f"to stable v{ro.stable_version}"
            else:
                want = "paused" if action == "pause" else "running"
                ro = reg.set_rollout_state(ro.id, want, actor=actor, reason=reason)
                msg = (
                    f"canary v{ro.version} paused: it keeps its share and is not promoted (still aborted if a metric "
                    "is shown worse)"
                    if want == "paused"
                    else f"canary v{ro.version} resumed"
                )
        except RegistryError as e:
            return _err(str(e))
    finally:
        reg.close()
    _console().print(f"{msg} ({actor}: {reason})")
    return 0


def gc_command(
    cfg: LiverlConfig,
    dry_run: bool,
    grace_s: float = 3600.0,
    token: str | None = None,
    prune_rejected_s: float | None = None,
) -> int:
    """Delete blobs no version references (older than ``grace_s``), or with ``dry_run`` only list them. Deleting
    needs an admin token. ``prune_rejected_s``: also drop the deltas of rejected versions older than this that no
    surviving version descends from."""
    reg = open_registry(cfg)
    try:
        actor = "dry-run"
        if not dry_run:
            try:
                actor = reg.authenticate(token, need="admin").name
            except RegistryError as e:
                return _err(str(e))
        res = reg.gc(dry_run=dry_run, grace_s=grace_s, actor=actor, prune_rejected_s=prune_rejected_s)
        store = cfg.blob_location
    finally:
        reg.close()
    con = _console()
    verb = "would remove" if dry_run else "removed"
    # a line of its own, never wrapped: a table's title wraps at the table's width, and a long store path split
    # "dry run" over two lines
    con.print(
        f"garbage collection of {store}" + (" (dry run: nothing deleted)" if dry_run else ""),
        soft_wrap=True,
        highlight=False,
    )
    t = Table()
    for col in ("blob", "size", "age", "action"):
        t.add_column(col, justify="right" if col in ("size", "age") else "left")
    for b in res.removed:
        t.add_row(b.key, cells.size(b.size), cells.age(b.modified_at), verb)
    for b in res.recent:
        t.add_row(b.key, cells.size(b.size), cells.age(b.modified_at), f"kept: younger than {grace_s:.0f} s")
    con.print(t)
    if prune_rejected_s is not None:
        con.print(
            f"{'would prune' if dry_run else 'pruned'} the deltas of {len(res.pruned)} rejected versions "
            f"older than {prune_rejected_s:.0f} s with no surviving descendant"
            + (f": {', '.join(map(str, res.pruned[:30]))}" if res.pruned else "")
        )
    con.print(
        f"{verb} {len(res.removed)} unreferenced blobs ({cells.size(res.removed_bytes)}); "
        f"{len(res.recent)} recent unreferenced kept; {res.referenced} referenced kept"
    )
    if res.missing:
        return _err(
            f"{len(res.missing)} blobs referenced by the registry are missing from {store}: "
            + ", ".join(k[:12] + "…" for k in res.missing[:10])
        )
    return 0


def cmd_operator(
    cfg: LiverlConfig, action: str, name: str | None, role: str, reason: str | None, token: str | None
) -> int:
    """Manage operator identities. The very first operator of a registry can be added without a token (whoever
    can write the registry database already controls it); every later change needs an admin token."""
    reg = open_registry(cfg)
    try:
        if action == "list":
            t = Table(title="operators")
            for col in ("name", "role", "created", "by", "state"):
                t.add_column(col)
            for o in reg.operators():
                t.add_row(o.name, o.role, cells.age(o.created_at), o.created_by, "disabled" if o.disabled else "active")
            _console().print(t)
            return 0
        if not name or not reason:
            return _err(f"operator {action} needs a NAME and --reason")
        try:
            if action == "add" and not reg.operators():
                by = f"bootstrap:{getpass.getuser()}"
            else:
                by = reg.authenticate(token, need="admin").name
            if action == "add":
                new = reg.add_operator(name, role, by=by, reason=reason)
                print(
                    f"operator {name} ({role}) added by {by}. Their token, shown only now:\n{new}\n"
                    "Keep it in a secret store; use it as LIVERL_TOKEN or with --token-file."
                )
            else:
                reg.disable_operator(name, by=by, reason=reason)
                print(f"operator {name} disabled by {by}")
        except RegistryError as e:
            return _err(str(e))
        return 0
    finally:
        reg.close()
