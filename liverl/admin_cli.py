"""The `liverl` operator subcommands: status, diff, oncall, versions, history, the audited changes (promote,
rollback, hold, operator, abort/pause/resume, gc, release-prefix), audit and lineage.

Each command imports liverl.ops.admin (and with it the registry and torch) when it runs, so building the parser
stays light.
"""

from __future__ import annotations

import argparse
import json

from core.services import kafka_bootstrap, setup_redis
from liverl.cliargs import add_token_arg, cfg_from_args, operator_token

ADMIN_EPILOG = (
    "The admin verbs read the registry (registry.url) and Redis (redis.url) named by the config. Verbs "
    "that change anything need an operator token ($LIVERL_TOKEN or --token-file; `liverl operator`) and "
    "a --reason; both land in the audit log, chained by HMAC with security.audit_key (`liverl history --verify`)."
)

AUDIT_HELP = """\
Reconcile a deployment's accounts: the feedback, generations, samples and dead-letter topics, the learner's
ledger (every sample it trained on or refused, beside its checkpoint), the live counters in Redis, the registry
and the serving nodes' heartbeats. Every acknowledged feedback event must end in exactly one place: trained
once, refused by the learner with a reason, dead-lettered with a reason, or dropped as not trainable; events
still queued or in flight are shown as such. Exit code 1 when anything is lost, trained twice, counted wrong,
or when the registry or the fleet disagree about the stable version.

Run it where the learner runs (it reads <state_dir>/learner), with the deployment's config:
  liverl audit --state-dir .liverl          # after `liverl up` / `liverl demo`
  liverl audit --json > audit.json
"""


def cmd_hold(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_hold as run

    return run(cfg_from_args(args), hold=not args.release, reason=args.reason, token=operator_token(args))


def cmd_status(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_status as run

    return run(cfg_from_args(args))


def cmd_diff(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_diff as run

    return run(cfg_from_args(args), args.a, args.b, top=args.top)


def cmd_oncall(args: argparse.Namespace) -> int:
    from liverl.ops.oncall import serve

    cfg = cfg_from_args(args)
    return serve(cfg, args.host or cfg.serving.host, args.port, refresh_s=args.refresh)


def cmd_versions(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_versions as run

    return run(cfg_from_args(args), limit=args.limit)


def cmd_history(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_history as run

    return run(
        cfg_from_args(args), verify=args.verify, seal=args.seal, token=operator_token(args) if args.seal else None
    )


def cmd_operator(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_operator as run

    return run(cfg_from_args(args), args.action, args.name, args.role, args.reason, operator_token(args))


def cmd_promote(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_promote as run

    return run(
        cfg_from_args(args), version=args.version, reason=args.reason, token=operator_token(args), force=args.force
    )


def cmd_rollback(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_rollback as run

    return run(cfg_from_args(args), reason=args.reason, token=operator_token(args), to=args.to)


def cmd_rollout(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_rollout as run

    return run(cfg_from_args(args), args.action, reason=args.reason, token=operator_token(args))


def cmd_gc(args: argparse.Namespace) -> int:
    from liverl.ops.admin import gc_command

    return gc_command(
        cfg_from_args(args),
        dry_run=args.dry_run,
        grace_s=args.grace,
        token=operator_token(args),
        prune_rejected_s=args.prune_rejected,
    )


def cmd_release_prefix(args: argparse.Namespace) -> int:
    from liverl.ops.release import cmd_release_prefix as run

    return run(
        cfg_from_args(args),
        args.prefix,
        args.reason,
        deployment=args.deployment,
        as_name=args.as_name,
        token=operator_token(args),
        state_dir_gone=args.state_dir_gone,
        dry_run=args.dry_run,
    )


def cmd_forget(args: argparse.Namespace) -> int:
    from liverl.ops import forget_cmd

    cfg = cfg_from_args(args)
    if args.status:
        return forget_cmd.cmd_status(
            cfg, args.status, follow=not args.no_follow, timeout_s=args.timeout, as_json=args.json
        )
    if args.report:
        if not args.user:
            raise ValueError("--report needs the USER whose versions to list")
        return forget_cmd.cmd_report(cfg, args.user, is_unit=args.unit, ledger=args.ledger, as_json=args.json)
    return forget_cmd.cmd_forget(
        cfg, args.user, args.reason, operator_token(args), is_unit=args.unit, resume=args.resume, ledger=args.ledger
    )


def cmd_audit(args: argparse.Namespace) -> int:
    from deploy.registry.registry import open_registry
    from liverl.ops.audit import print_report, run_audit

    cfg = cfg_from_args(args)
    r, registry = setup_redis(cfg), open_registry(cfg)
    try:
        rep = run_audit(cfg, kafka_bootstrap(cfg), r, registry)
    finally:
        r.close()
        registry.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print_report(rep)
    return 0 if not rep.problems() else 1


def cmd_lineage(args: argparse.Namespace) -> int:
    from deploy.registry.registry import open_registry
    from learner.ledger import checkpoint_path_for, ledger_path
    from liverl.ops.lineage import print_trace, trace

    cfg = cfg_from_args(args)
    registry = open_registry(cfg)
    try:
        tr = trace(args.feedback_id, args.ledger or ledger_path(checkpoint_path_for(cfg)), registry)
    finally:
        registry.close()
    if args.json:
        print(json.dumps(tr, indent=2))
    else:
        print_trace(tr)
    return 0


def register_reads(sub) -> None:
    """Add status and diff to the `liverl` subcommands."""
    s = sub.add_parser(
        "status", help="served version per node, pending candidates, live acceptance", epilog=ADMIN_EPILOG
    )
    s.set_defaults(fn=cmd_status)
    s = sub.add_parser(
        "diff",
        help="what changed between two versions: tensors, and the gate's evidence side by side",
        epilog=ADMIN_EPILOG,
        description="Rebuild versions A and B from the registry (checksum-verified) "
        "and list the tensors that differ (share of elements changed, largest change, relative L2 "
        "change), then each version's gate checks and live acceptance side by side.",
    )
    s.add_argument("a", type=int, help="version A (e.g. the stable version)")
    s.add_argument("b", type=int, help="version B (e.g. a candidate)")
    s.add_argument("--top", type=int, default=20, help="how many tensors to list, largest relative change first")
    s.set_defaults(fn=cmd_diff)


def register(sub) -> None:
    """Add oncall, versions, history, the audited changes, gc, audit and lineage to the `liverl` subcommands."""
    _add_views(sub)
    _add_changes(sub)
    _add_rollout(sub)
    _add_gc(sub)
    _add_release(sub)
    _add_forget(sub)
    _add_accounts(sub)


def _add_views(sub) -> None:
    s = sub.add_parser(
        "oncall",
        help="serve the on-call page: release, fleet, live acceptance, gate checks, audit",
        epilog=ADMIN_EPILOG,
        description="Serve a page for on-call, refreshed live: the stable version "
        "and whether every node serves it, versions and lineage, live acceptance by version (a chart), "
        "every gate check with its value, threshold and reason, and the audit log. Read-only (no token). "
        "GET /api/state has the same data as JSON.",
    )
    s.add_argument("--port", type=int, default=6068, help="port (default 6068; 0: any free port)")
    s.add_argument("--host", default=None, help="address to bind (default serving.host, loopback)")
    s.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS", help="page refresh interval (default 2)")
    s.set_defaults(fn=cmd_oncall)
    s = sub.add_parser("versions", help="list versions: lineage, status, delta size, gate scores", epilog=ADMIN_EPILOG)
    s.add_argument("--limit", type=int, default=20, help="most recent N versions (default 20)")
    s.set_defaults(fn=cmd_versions)
    s = sub.add_parser("history", help="the audit log: who promoted or rolled back what, and why", epilog=ADMIN_EPILOG)
    s.add_argument(
        "--verify",
        action="store_true",
        help="first check the log's chain (HMAC with security.audit_key) "
        "and its head anchored in Redis: exit 1 if an entry was rewritten, removed or added, or the tail cut",
    )
    s.add_argument(
        "--seal",
        metavar="REASON",
        help="(admin) key a log written before security.audit_key existed from here on: the seal vouches for "
        "every unkeyed entry before it, so read them first (a log whose MACs were stripped looks the same)",
    )
    add_token_arg(s)
    s.set_defaults(fn=cmd_history)


def _add_changes(sub) -> None:
    s = sub.add_parser(
        "promote", help="make VERSION the served version (the agents hot-swap to it)", epilog=ADMIN_EPILOG
    )
    s.add_argument("version", type=int)
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    add_token_arg(s)
    s.add_argument("--force", action="store_true", help="promote even a version the gate rejected or has not judged")
    s.set_defaults(fn=cmd_promote)
    s = sub.add_parser(
        "rollback", help="serve the previous stable version again (or --to VERSION)", epilog=ADMIN_EPILOG
    )
    s.add_argument("--to", type=int, help="version to return to (default: the one before the current stable)")
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    add_token_arg(s)
    s.set_defaults(fn=cmd_rollback)

    s = sub.add_parser(
        "hold",
        help="stop (or --release: resume) the learner emitting candidates; it keeps training",
        epilog=ADMIN_EPILOG,
    )
    s.add_argument("--release", action="store_true", help="let the learner emit candidates again")
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    add_token_arg(s)
    s.set_defaults(fn=cmd_hold)

    s = sub.add_parser(
        "operator",
        help="operator identities: add NAME --role R, disable NAME, list",
        epilog=ADMIN_EPILOG,
        description="Who may change the registry. Each operator has a role (viewer < operator < admin) "
        "and a token, shown once when added; only its hash is stored. The first operator of a registry "
        "is added without a token; after that, adding or disabling needs an admin token.",
    )
    s.add_argument("action", choices=["add", "disable", "list"])
    s.add_argument("name", nargs="?")
    s.add_argument("--role", default="operator", choices=["viewer", "operator", "admin"])
    s.add_argument("--reason", help="why (recorded in the audit log)")
    add_token_arg(s)
    s.set_defaults(fn=cmd_operator)


def _add_rollout(sub) -> None:
    for action, text in (
        ("abort", "abort the canary in progress: reject it, its nodes return to stable"),
        ("pause", "pause the canary: it keeps its share of users but is not promoted"),
        ("resume", "resume a paused canary"),
    ):
        s = sub.add_parser(
            action,
            help=text,
            description=text + ". Needs an operator token and a reason (audited).",
            epilog=ADMIN_EPILOG,
        )
        s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
        add_token_arg(s)
        s.set_defaults(fn=cmd_rollout, action=action)


def _add_gc(sub) -> None:
    s = sub.add_parser(
        "gc",
        help="delete snapshot/delta blobs that no version references",
        epilog=ADMIN_EPILOG,
        description="Delete blobs in the blob store that no registry version references (left by "
        "crashed writers or removed versions). Blobs younger than --grace are kept: a "
        "writer may be about to commit the version that references them. Use --dry-run "
        "first to see what would go.",
    )
    s.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    s.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="keep unreferenced blobs younger than this (default 3600)",
    )
    s.add_argument(
        "--prune-rejected",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also delete the deltas of rejected versions older than this whose descendants are all "
        "rejected (the rows, gate results and audit entries stay; such a version can no longer be "
        "rebuilt). A rejected version that a live version descends from is always kept",
    )
    add_token_arg(s)
    s.set_defaults(fn=cmd_gc)


RELEASE_HELP = """\
Release a Redis prefix whose deployment is gone, so that a new deployment can claim it. A deployment claims its
prefix (<prefix>:deployment) for as long as the prefix exists; when its state dir is deleted, the claim outlives it
and `liverl up` refuses the prefix, naming the deployment that claims it and this command.

It refuses while that deployment shows a sign of life: a serving node's heartbeat or the learner's lease in Redis,
the learner's state or ingest's counters written in the last minute, its state dir still on this machine holding
it, or the configured registry still recording it (it prints what it found). Ingest and the gate keep no heartbeat:
stop them first. Released, the claim and every key under the prefix are removed, and a record (who, why, which
deployment, what was found) is appended to <prefix>:releases and to the audit log (`liverl history`) of the
configured registry; when that registry does not exist yet, the next `liverl up` on the prefix writes it there.

Who: when the configured registry has operators, an admin token ($LIVERL_TOKEN or --token-file) names you; without
operators (the usual case: the registry went with the state dir) you are --as NAME (default: your OS user), recorded
as unauthenticated with this host and OS user beside it.

  liverl up --fresh --state-dir /srv/liverl      # refused: the prefix belongs to deployment 0c61...
  liverl release-prefix --prefix liverl --deployment 0c61... --state-dir /srv/liverl --reason "state dir deleted"
  liverl up --fresh --state-dir /srv/liverl      # claims the prefix; `liverl history` shows the release
"""


def _add_release(sub) -> None:
    s = sub.add_parser(
        "release-prefix",
        help="release a Redis prefix whose deployment is gone (audited), so a new deployment may claim it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=RELEASE_HELP,
        epilog=ADMIN_EPILOG,
    )
    s.add_argument("--prefix", required=True, help="the Redis prefix (topics.prefix) to release")
    s.add_argument(
        "--deployment",
        metavar="ID",
        help="release it only from this deployment (the id the refusal named); refused if another claims it",
    )
    s.add_argument("--reason", required=True, help="why (recorded with the release, and who you are)")
    s.add_argument(
        "--as",
        dest="as_name",
        metavar="NAME",
        help="who releases, when the registry has no operators (default: your OS user; with operators the token says)",
    )
    s.add_argument(
        "--state-dir",
        help="the state dir of the deployment that will use the prefix: its registry gets the audit entry "
        "(default: state_dir = .liverl)",
    )
    s.add_argument(
        "--state-dir-gone",
        action="store_true",
        help="the claimant's state dir is on another machine (or its claim names none) and you know it is gone "
        "there: release without checking it (recorded with the release)",
    )
    s.add_argument("--dry-run", action="store_true", help="only print what was found and whether it would release")
    add_token_arg(s)
    s.set_defaults(fn=cmd_release_prefix)


FORGET_HELP = """\
Forget a user: destroy their data key (what was sealed under it, their samples included, can no longer be opened),
delete their per-user sums in Redis, find which versions trained on their samples (the learner's ledger), and offer
the newest version that was stable once and did not. What is done with the offer is the product's policy,
forget.policy: report (default: nothing changes what is served; the report names the versions and the rollback that
would serve one without them), rollback (the registry's audited rollback to it, signed and announced by the gate), or
retrain (marked for an operator). Each step is saved as it ends: an erasure killed at any point is finished by
`liverl forget --resume`, by the next `liverl forget`, or by the gate's loop.

USER is the user key the product sends (X-Liverl-User, or the OpenAI `user` field); liverl keeps only its unit id
(core.fleet.unit_id; --unit takes that id instead). A user of whom nothing is held (no key, no trained sample, no
sums), or one already forgotten, changes nothing; the attempt is audited all the same. Forgetting needs an operator
token and a --reason. Run it where the learner runs (its ledger is in the state dir), or pass --ledger.

  liverl forget alice@example.com --reason "GDPR request #812"
  liverl forget --status er-3f9a0c1d2e4b5a69        # follows it to done (the product's erasures too)
  liverl forget --report alice@example.com --json    # which versions trained on alice, now
  liverl forget --resume                             # finish erasures a crash left unfinished
The product files erasures itself with POST /v1/erasures on ingest (the product key), or liverl_sdk.ErasureClient.
"""


def _add_forget(sub) -> None:
    s = sub.add_parser(
        "forget",
        help="forget a user (audited): destroy their key and sums, report the versions that trained on them",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=FORGET_HELP,
        epilog=ADMIN_EPILOG,
    )
    s.add_argument("user", nargs="?", metavar="USER", help="the user key the product sends (or a unit id with --unit)")
    s.add_argument("--reason", help="why (recorded in the audit log with who you are); needed to forget")
    s.add_argument("--unit", action="store_true", help="USER is a unit id (16 hex digits), not a user key")
    s.add_argument("--resume", action="store_true", help="only finish the erasures not done yet")
    s.add_argument("--status", metavar="ID", help="follow erasure ID (er-...) until it is done")
    s.add_argument("--no-follow", action="store_true", help="with --status: print its state once, do not wait")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="with --status: wait at most this")
    s.add_argument("--report", action="store_true", help="list the versions that trained on USER (changes nothing)")
    s.add_argument("--json", action="store_true", help="with --status or --report: print JSON")
    s.add_argument("--ledger", help="the learner's ledger file (default: beside its checkpoint in the state folder)")
    s.add_argument("--state-dir", help="state folder of the deployment (default: state_dir = .liverl)")
    add_token_arg(s)
    s.set_defaults(fn=cmd_forget)


def _add_accounts(sub) -> None:
    s = sub.add_parser(
        "audit",
        help="where every feedback event went: trained once, refused or dead-lettered with a reason, or lost",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=AUDIT_HELP,
    )
    s.add_argument("--state-dir", help="state folder of the deployment (default: state_dir = .liverl)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_audit)

    s = sub.add_parser(
        "lineage",
        help="one feedback event's path: sample, learner step, candidate, gate verdicts, promotion, first "
        "served, each with its time",
        description="The path of one feedback event to a served model, read from the "
        "learner's ledger and the registry (liverl.ops.lineage says where each fact lives). Run it where the learner "
        "runs.",
    )
    s.add_argument("feedback_id", help="the FeedbackEvent.feedback_id the product sent")
    s.add_argument("--state-dir", help="state folder of the deployment (default: state_dir = .liverl)")
    s.add_argument("--ledger", help="the learner's ledger file (default: beside its checkpoint in the state folder)")
    s.add_argument("--json", action="store_true", help="print the path as JSON")
    s.set_defaults(fn=cmd_lineage)
