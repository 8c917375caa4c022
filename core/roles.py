"""A role per credential: each liverl process's database role, Redis ACL user and key files, by name.

One machine (``liverl up``, ``liverl demo``) runs every process with the same credentials: the SQLite file or the
database URL given, Redis's default user, ``<state_dir>/keys``. A deployment gives each process its own:

- a PostgreSQL role granted only what the process does (``deploy.registry.roles`` writes the grants);
- a Redis ACL user allowed only the keys and commands the process uses (``redis_rules`` here, derived from
  ``core.keys``);
- the key files it needs and nothing more (``liverl keys`` makes them, ``MOUNTS`` says who mounts which).

The processes (``PROCESSES``), each a ``Role``:

| role          | process                                | writes                                              |
|---------------|----------------------------------------|-----------------------------------------------------|
| ``node_<n>``  | ``liverl serve`` with node_name ``n``  | its own fleet and served rows; its heartbeat, swaps |
| ``router``    | ``liverl route``                       | nothing                                             |
| ``ingest``    | ``liverl ingest``                      | the live counters, per-user sums and their guards   |
| ``learner``   | ``liverl learn``                       | candidates (and the base, into an empty registry)   |
| ``gate``      | ``liverl gate``                        | statuses, rollouts, gate results; the announcements |
| ``admin``     | the operators' verbs (``liverl promote``...) | what the gate writes, operators, gc; the hold |
| ``viewer``    | ``liverl status``, ``oncall``, ``history --verify`` | nothing                                |

A role's name is ``<role prefix><role>`` (``liverl_gate``; the prefix defaults to ``topics.prefix`` and ``_``), the
same in PostgreSQL and Redis. Its password files are ``db-<role>.password`` and ``redis-<role>.password``
(``node-<n>`` for a node), which ``registry.password_file`` and ``redis.password_file`` point at.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from core import keys

PROCESSES = ("gate", "learner", "admin", "viewer", "ingest", "router")
"""The roles besides one per serving node."""

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
ROLE_PREFIX = re.compile(r"^[a-z_][a-z0-9_]*$")
MAX_IDENTIFIER = 63  # PostgreSQL's limit on a role name, in bytes


def default_role_prefix(topics_prefix: str) -> str:
    """``<topics.prefix>_``, lower-cased, every character outside ``[a-z0-9_]`` as ``_`` (``liverl`` -> ``liverl_``)."""
    p = re.sub(r"[^a-z0-9_]", "_", topics_prefix.lower())
    return ("_" + p if p[:1].isdigit() else p) + "_"


def check_role_prefix(prefix: str) -> str:
    if not ROLE_PREFIX.match(prefix):
        raise ValueError(
            "a role prefix is lower-case letters, digits and _ (not starting with a digit), e.g. liverl_; "
            f"got {prefix!r}"
        )
    return prefix


def check_node_name(name: str, prefix: str = "") -> str:
    """``name`` if it can name a node's role (``<prefix>node_<name>`` within PostgreSQL's 63 bytes); ValueError else."""
    if not NODE_NAME.match(name):
        raise ValueError(
            f"serving node name {name!r} cannot name a role: use letters, digits, '.', '_' and '-' "
            '(starting with a letter or digit), as in serving.node_name = "node-a"'
        )
    if len(f"{prefix}node_{name}".encode()) > MAX_IDENTIFIER:
        raise ValueError(
            f"the role of node {name!r} ({prefix}node_{name}) is longer than PostgreSQL's {MAX_IDENTIFIER} bytes: "
            "use a shorter node name or role prefix"
        )
    return name


@dataclass(frozen=True)
class Role:
    """One credential: a process's (``process`` in ``PROCESSES``), or a serving node's (``node``)."""

    process: str
    node: str | None = None

    @property
    def key(self) -> str:
        """How files and messages name it: ``gate``, ``node-<name>``."""
        return f"node-{self.node}" if self.node is not None else self.process

    def name(self, prefix: str) -> str:
        """The database role and the Redis user: ``<prefix>gate``, ``<prefix>node_<name>``."""
        return f"{prefix}node_{self.node}" if self.node is not None else f"{prefix}{self.process}"

    def password_file(self, service: str) -> str:
        """``db-<key>.password`` or ``redis-<key>.password``."""
        if service not in ("db", "redis"):
            raise ValueError(f"a password is for 'db' or 'redis', not {service!r}")
        return f"{service}-{self.key}.password"


def roles(nodes=(), prefix: str = "") -> list[Role]:
    """Every role of a deployment whose serving nodes are ``nodes`` (checked, duplicates dropped)."""
    seen = list(dict.fromkeys(check_node_name(n, prefix) for n in nodes))
    return [Role(p) for p in PROCESSES] + [Role("node", n) for n in seen]


# ------------------------------------------------------------------------------------------------ key files

KEY_FILES = {
    "announce": (("announce.key", "security.signing_key"), ("announce.pub", "security.verify_key")),
    "audit": (("audit.key", "security.audit_key"),),
    "feedback": (("feedback.key", "security.feedback_key"),),
    "assignment": (("assignment.key", "security.assignment_key"),),
    "shred": (("shred.key", "security.shred_key"),),
}
"""The shared keys (``liverl keys``): name -> (file, the setting that points at it), ..."""


def mounts(role: Role) -> list[tuple[str, str]]:
    """The files ``role``'s process mounts, each with the setting that points at it: its two passwords and the keys
    its code loads (``core.services.required_verify_key``, ``core.credentials``, ``deploy.registry.auditchain``)."""
    shared = {
        # verifies announcements; the gateway checks the product key and seals users' text (core.shred)
        "node": ("announce.pub", "feedback.key", "shred.key"),
        "router": ("announce.pub", "assignment.key"),  # the canary's terms; users' arms
        "ingest": ("shred.key",),  # opens generations to join them, seals the samples
        "learner": ("audit.key", "shred.key"),  # appends candidates to the keyed audit log; opens samples
        "gate": ("announce.key", "audit.key", "shred.key"),  # opens held-out samples (off-policy estimate)
        "admin": ("announce.key", "audit.key", "shred.key"),  # promote and rollback announce; forget destroys keys
        "viewer": ("audit.key",),  # `liverl history --verify` checks the chain's MACs
    }[role.process]
    setting = {f: s for files in KEY_FILES.values() for f, s in files}
    out = [(f, setting[f]) for f in shared]
    out += [(role.password_file("db"), "registry.password_file"), (role.password_file("redis"), "redis.password_file")]
    return out


# ------------------------------------------------------------------------------------------------ Redis ACL

CONNECT = ("ping", "select", "cluster|slots", "cluster|shards", "command", "readonly", "asking")
"""What any client sends besides its work: a health check, the database of a ``redis://host/N`` URL, a cluster
client's slot map. (redis-py's ``CLIENT SETINFO`` is left out: Redis 7.0 does not know it, and redis-py ignores its
refusal.)"""

SCRIPTS = ("eval", "evalsha", "script|load", "script|exists")
"""A Lua script's call (redis-py's ``Script`` loads it when the server has not seen it); its commands are checked
against the user's rules as if sent directly."""


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass(frozen=True)
class RedisGrant:
    """Key patterns read and written (``~``), read only (``%R~``), and the commands (``+``) of one Redis user;
    ``selectors``: Redis 7 ACL selectors, each ``(<rules>)`` a further set of commands on its own keys (a command is
    allowed when the root rules or one selector allow it), so a user may run one write command on keys it otherwise
    only reads."""

    write: tuple[str, ...]
    read: tuple[str, ...]
    commands: tuple[str, ...]
    categories: tuple[str, ...] = ()
    selectors: tuple[str, ...] = ()


def redis_grant(role: Role, prefix: str) -> RedisGrant:
    """What ``role``'s process does in Redis under ``topics.prefix`` ``prefix`` (the key table in ``core.keys``)."""
    p = glob_escape(prefix)
    claim_ro = (keys.deployment(p),)  # every standalone process checks the claim (liverl.stack.deployment)
    announcements = (keys.desired(p), keys.canary(p))
    if role.process == "node":  # serving.agent.agent: reads announcements, writes its heartbeat and swap records
        return RedisGrant(
            write=(keys.served(p, glob_escape(role.node or "")), keys.swaps(p), keys.swap_errors(p)),
            read=(*announcements, *claim_ro),
            commands=("get", "set", "rpush", "ltrim"),
        )
    if role.process == "router":  # serving.router: announcements (the canary's terms), heartbeats
        return RedisGrant(write=(), read=(*announcements, keys.served_pattern(p), *claim_ro), commands=("get", "scan"))
    if role.process == "ingest":  # ingest.metrics: one Lua call per version, the counters hash (TYPE, DEL: a key of
        # another type where ingest keeps a hash is replaced)
        return RedisGrant(
            write=(keys.live_pattern(p), keys.units_pattern(p), keys.counted_pattern(p), keys.ingest_counters(p)),
            read=claim_ro,
            commands=("get", "set", "expire", "hincrby", "hmget", "hset", "type", "del", *SCRIPTS),
        )
    if role.process == "learner":  # learner: its state hash, the lease, the hold; the audit head it appends past
        return RedisGrant(
            write=(keys.learner(p), keys.learner_lease(p), keys.audit_head(p)),
            read=(keys.learner_hold(p), *claim_ro),
            commands=("get", "set", "del", "pexpire", "hset", "hget", "hgetall", "type", *SCRIPTS),
        )
    if role.process == "gate":  # deploy.gate: signs announcements, reads heartbeats and per-user sums; claims.
        # An erasure run in its loop (liverl.ops.forget) deletes one user's fields from the per-user sums: HDEL
        # alone on those keys (a selector), so the gate still cannot write the canary's evidence
        return RedisGrant(
            write=(*announcements, keys.audit_head(p), keys.deployment(p)),
            read=(keys.served_pattern(p), keys.units_pattern(p), keys.live_pattern(p)),
            commands=("get", "set", "del", "scan", "hget", "hgetall", "hset", "type", *SCRIPTS),
            selectors=(f"(~{keys.units_pattern(p)} +hdel)",),
        )
    if role.process == "admin":  # the operators' verbs: every key of the deployment, no server administration
        return RedisGrant(write=(keys.everything(p),), read=(), commands=(), categories=("+@all", "-@dangerous"))
    if role.process == "viewer":
        return RedisGrant(write=(), read=(keys.everything(p),), commands=(), categories=("+@read", "-@dangerous"))
    raise ValueError(f"no Redis grant for {role.process!r}: a role is a node or one of {PROCESSES}")


def redis_rules(role: Role, prefix: str, password: str) -> list[str]:
    """The ``ACL SETUSER <name>`` arguments that make ``role``'s user from scratch (``reset``): on, the SHA-256 of
    ``password`` (never the password itself), no channels, only its commands and key patterns."""
    g = redis_grant(role, prefix)
    digest = hashlib.sha256(password.encode()).hexdigest()
    return [
        "reset",
        "on",
        f"#{digest}",
        "resetchannels",
        "-@all",
        *g.categories,
        *(f"+{c}" for c in (*CONNECT, *g.commands)),
        *(f"~{k}" for k in g.write),
        *(f"%R~{k}" for k in g.read),
        *g.selectors,
    ]


def acl_users(prefix: str, role_prefix: str, passwords: Mapping[Role, str]) -> list[tuple[str, list[str]]]:
    """``(user, ACL SETUSER rules)`` of every role in ``passwords`` (role -> its password) for ``topics.prefix``."""
    check_role_prefix(role_prefix)
    return [(role.name(role_prefix), redis_rules(role, prefix, pw)) for role, pw in passwords.items()]


def acl_file(users: list[tuple[str, list[str]]]) -> str:
    """Redis's ACL file (its ``aclfile``, loaded at start) holding ``users`` (``acl_users``) and the default user
    turned off: a file that leaves the default user out leaves it on, with no password and every command. It holds
    each password's SHA-256 (``redis_rules``), never the password."""
    lines = ["user default reset"]  # off, no password, no keys, channels or commands
    for name, rules in users:
        words = [name, *rules]
        # a selector "(~k +cmd)" is one rule with spaces inside its parentheses (Redis 7 merges them back)
        bad = [
            w
            for w in words
            if not w or any(c in "\"'\n\t" or (c == " " and not (w[0] == "(" and w[-1] == ")")) for c in w)
        ]
        if bad:
            raise ValueError(f"an ACL file line is space-separated words without quotes; cannot write {bad[0]!r}")
        lines.append(" ".join(["user", *words]))
    return "\n".join(lines) + "\n"


def apply_acl(r, users: list[tuple[str, list[str]]]) -> bool:
    """Make (or remake) ``users`` on the Redis ``r`` (an admin's client), then ``ACL SAVE``; False when the server
    has no ACL file to save to (its own configuration must then keep the users across a restart)."""
    import redis  # noqa: PLC0415 redis: `liverl --help` loads this module

    for name, rules in users:
        r.execute_command("ACL", "SETUSER", name, *rules)
    try:
        r.execute_command("ACL", "SAVE")
    except redis.ResponseError:
        return False
    return True


def drop_acl(r, role_prefix: str) -> list[str]:
    """Delete every user of ``role_prefix`` (``<prefix><process>``, ``<prefix>node_*``) from the Redis ``r``."""
    check_role_prefix(role_prefix)
    fixed = {f"{role_prefix}{p}" for p in PROCESSES}
    names = [u.decode() if isinstance(u, bytes) else u for u in r.execute_command("ACL", "USERS")]
    gone = [n for n in names if n in fixed or n.startswith(f"{role_prefix}node_")]
    for n in gone:
        r.execute_command("ACL", "DELUSER", n)
    return gone
