"""The `liverl keys`, `liverl db roles` and `liverl redis acl` verbs: a role per credential for a deployment.

`keys` makes every key file once (``liverl.ops.keyfiles``); `db roles` makes each process's PostgreSQL role and its
grants (``deploy.registry.roles``); `redis acl` each process's Redis ACL user (``core.roles``), on a server or as an
ACL file the server loads at start (``--aclfile``: the compose file's Redis). Each imports what it needs when it
runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse
import shlex
import textwrap
from pathlib import Path

from core.config import redact_url
from core.roles import Role, default_role_prefix, mounts, roles
from core.services import redis_url
from liverl.cliargs import cfg_from_args

KEYS_HELP = """\
Make every key file a deployment needs into DIR, once, each mode 0600: the announcement signing pair, the audit key,
the product key, the routers' assignment key, the users' key-encryption key (shred.key), and a database and a Redis
password for every process (one per serving node: --nodes, default the names in serving.fleet). A file that exists
is never overwritten: a second run refuses, --missing makes only what is not there yet (a new node), --rotate NAME
replaces one key. Prints which process mounts which file and the setting that points at it. Then `liverl db roles
--keys DIR --apply` and `liverl redis acl --keys DIR --apply` make the roles and users these passwords belong to.
"""

LABELS = {
    "node": "liverl serve",
    "router": "liverl route",
    "ingest": "liverl ingest",
    "learner": "liverl learn",
    "gate": "liverl gate",
    "admin": "operators' verbs (promote, rollback, hold, abort, pause, resume, gc, operator)",
    "viewer": "read-only views (status, versions, history --verify, oncall, audit, lineage)",
}

ROTATE_NEXT = {
    "announce": "give every node and router the new announce.pub and the gate and operators the new announce.key, "
    "then restart them: a node verifies with one key, so it stays on what it serves until it has the new one",
    "feedback": "the old key is kept on the file's second line: move the product to the new (first) line, then delete "
    "the old one",
    "assignment": "every router must read the same key (restart them together); users' arms of a running rollout "
    "change, so rotate between rollouts",
}


def _nodes(args: argparse.Namespace, cfg) -> list[str]:
    if args.nodes is not None:
        return [n.strip() for n in args.nodes.split(",") if n.strip()]
    return list(cfg.serving.fleet)


def _label(role: Role) -> str:
    return f"{LABELS['node']} (serving.node_name = {role.node})" if role.node is not None else LABELS[role.process]


def cmd_keys(args: argparse.Namespace) -> int:
    from liverl.ops.keyfiles import make_keys, rotate_key

    cfg = cfg_from_args(args)
    folder = Path(args.dir).resolve()
    every = roles(_nodes(args, cfg))
    if args.rotate:
        kf = rotate_key(folder, args.rotate, every)
        print(f"replaced {', '.join(kf.files)} in {folder} (mode 0600)")
        kind = kf.name.split("-", 1)[0]
        if kind in ("db", "redis"):
            verb = "liverl db roles" if kind == "db" else "liverl redis acl"
            print(f"next: `{verb} --keys {shlex.quote(str(folder))} --apply`, then restart the process that mounts it")
        elif kf.name in ROTATE_NEXT:
            print(f"next: {ROTATE_NEXT[kf.name]}")
        return 0
    done = make_keys(folder, every, missing=args.missing)
    print(f"{folder} (every file mode 0600):")
    for state in ("made", "kept"):
        files = [f for kf, s in done if s == state for f in kf.files]
        if files:
            print(textwrap.fill(", ".join(files), 116, initial_indent=f"  {state}  ", subsequent_indent=" " * 8))
    if not any(r.node for r in every):
        print("  (no serving nodes: pass --nodes a,b or set serving.fleet to make their passwords)")
    print("\nEach process mounts (point the setting at the file):")
    for role in every:
        print(f"  {_label(role)}")
        for name, setting in mounts(role):
            print(f"    {setting:<26} = {folder / name}")
    print(f"  your product's backend\n    {'X-Liverl-Product-Key':<26} = {folder / 'feedback.key'} (a line of it)")
    q = shlex.quote(str(folder))
    print(
        f"\nNext, as the registry database's owner and a Redis admin: `liverl db roles --keys {q} --apply` and "
        f"`liverl redis acl --keys {q} --apply`"
    )
    return 0


def _role_args(args: argparse.Namespace):
    if not args.drop and not args.keys:
        raise ValueError("--keys DIR: the folder `liverl keys` made the passwords in")
    cfg = cfg_from_args(args)
    prefix = args.role_prefix or default_role_prefix(cfg.topics.prefix)
    return cfg, prefix, roles(_nodes(args, cfg), prefix)


def cmd_db_roles(args: argparse.Namespace) -> int:
    from deploy.registry.roles import apply_roles, drop_roles, role_sql, role_url
    from liverl.ops.keyfiles import read_passwords

    cfg, prefix, every = _role_args(args)
    url = args.url or cfg.registry_url
    if args.drop:
        gone = drop_roles(url, prefix)
        print(f"dropped {', '.join(gone) or 'no roles'}; row-level security is off again")
        return 0
    passwords = read_passwords(args.keys, every, "db")
    if not args.apply:
        import sqlalchemy as sa

        for statement in role_sql(sa.engine.make_url(url).database or "", prefix, passwords):
            print(statement + ";")
        return 0
    apply_roles(url, prefix, passwords)
    folder = Path(args.keys).resolve()
    print(f"roles made on {redact_url(url)}; each process's config:")
    for role in every:
        print(f"  {_label(role)}")
        print(f'    registry.url           = "{role_url(url, role, prefix)}"')
        print(f'    registry.password_file = "{folder / role.password_file("db")}"')
    return 0


def cmd_redis_acl(args: argparse.Namespace) -> int:
    from core.roles import acl_file, acl_users, apply_acl, drop_acl
    from core.services import redis_from_url
    from liverl.ops.keyfiles import read_passwords, write_public

    cfg, prefix, every = _role_args(args)
    url = args.url or redis_url(cfg)
    if args.drop:
        r = redis_from_url(url)
        try:
            gone = drop_acl(r, prefix)
        finally:
            r.close()
        print(f"deleted the Redis users {', '.join(gone) or '(none)'}")
        return 0
    users = acl_users(cfg.topics.prefix, prefix, read_passwords(args.keys, every, "redis"))
    if args.aclfile:
        path = Path(args.aclfile)
        write_public(path, acl_file(users).encode())
        print(f"wrote {path.resolve()}: start Redis with `--aclfile {path}` (the default user is off in it)")
    elif not args.apply:
        for name, rules in users:
            print(shlex.join(["ACL", "SETUSER", name, *rules]))
        return 0
    else:
        r = redis_from_url(url)
        try:
            saved = apply_acl(r, users)
        finally:
            r.close()
        print(f"users made on {redact_url(url)} ({'saved to its ACL file' if saved else 'NOT saved: no ACL file'})")
        if not saved:
            print("  the server has no aclfile: add these users to its configuration, or they are gone at its restart")
    folder = Path(args.keys).resolve()
    base = url.split("://", 1)
    host = base[1].rpartition("@")[2] if len(base) == 2 else url
    for role in every:
        print(f"  {_label(role)}")
        print(f'    redis.url           = "{base[0]}://{role.name(prefix)}@{host}"')
        print(f'    redis.password_file = "{folder / role.password_file("redis")}"')
    return 0


def _add_role_args(s: argparse.ArgumentParser, what: str) -> argparse._MutuallyExclusiveGroup:
    s.add_argument("--keys", metavar="DIR", help="the folder `liverl keys` made the passwords in (not for --drop)")
    s.add_argument("--url", help=f"{what} (default: the config's)")
    s.add_argument("--nodes", help="the serving nodes' names, comma-separated (default: the names in serving.fleet)")
    s.add_argument("--role-prefix", help="prefix of every role's name (default: topics.prefix and _, e.g. liverl_)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--apply", action="store_true", help="make them now (default: print what would be run)")
    g.add_argument("--drop", action="store_true", help="remove every role of the prefix instead")
    return g


def register(sub) -> None:
    """Add keys, db roles and redis acl to the `liverl` subcommands."""
    s = sub.add_parser(
        "keys",
        help="make every key file a deployment mounts (once, mode 0600), or --rotate one",
        description=KEYS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("dir", metavar="DIR", help="where the files go (made 0700 if absent)")
    s.add_argument("--nodes", help="the serving nodes' names, comma-separated (default: the names in serving.fleet)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--missing", action="store_true", help="make only the files not there yet; keep the others")
    g.add_argument(
        "--rotate",
        metavar="NAME",
        help="replace one key: announce, feedback, assignment, db-<role>, redis-<role> (role: gate, learner, admin, "
        "viewer, ingest, router, node-<name>); the audit key and shred.key are never rotated",
    )
    s.set_defaults(fn=cmd_keys)

    db = sub.add_parser("db", help="the registry database: per-process roles (`liverl db roles`)")
    dsub = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    s = dsub.add_parser(
        "roles",
        help="make a PostgreSQL role per process, granted only what it does (prints the SQL unless --apply)",
        description="Make (or bring up to date) each process's PostgreSQL role on the registry database, with the "
        "passwords in --keys: a serving node reads versions and writes only its own fleet row, only the learner adds "
        "candidates, only the gate and the admin role change a status (deploy.registry.roles says why each grant). "
        "Migrates the database first; run it as its owner, and again after an upgrade adds a table.",
    )
    _add_role_args(s, "the registry database as its owner, a role that may create roles")
    s.set_defaults(fn=cmd_db_roles)

    rd = sub.add_parser("redis", help="Redis: per-process ACL users (`liverl redis acl`)")
    rsub = rd.add_subparsers(dest="redis_command", metavar="COMMAND", required=True)
    s = rsub.add_parser(
        "acl",
        help="make a Redis ACL user per process, allowed only its keys and commands (prints the rules unless --apply)",
        description="Make each process's Redis ACL user with the passwords in --keys (stored as SHA-256), allowed "
        "only the keys under topics.prefix it reads or writes and the commands it sends (core.roles lists them). "
        "The default user is left as it is: turn it off (ACL SETUSER default off) once every process has its own. "
        "--aclfile writes them as an ACL file instead, the default user off in it, for a Redis that loads it at start.",
    )
    g = _add_role_args(s, "a Redis URL whose user may run ACL SETUSER")
    g.add_argument(
        "--aclfile",
        metavar="FILE",
        help="write the users into FILE, an ACL file for Redis to load at start (redis-server --aclfile FILE), with "
        "the default user off, instead of sending them to a server (mode 0644: it holds SHA-256 digests only)",
    )
    s.set_defaults(fn=cmd_redis_acl)
