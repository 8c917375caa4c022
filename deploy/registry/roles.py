"""PostgreSQL roles for the registry: each process connects as a role granted only what its code does.

Which ``Registry`` methods each process calls, and so what its role may do (``core.roles`` names the roles):

- a serving node (``serving.agent``: ``get``, ``path``, ``deltas_between``, ``materialize``, ``update_fleet``) reads
  versions and writes only its own ``fleet`` and ``served`` rows;
- the learner (``stable``, ``list``, ``materialize``, ``last_rollback``, ``add_candidate``, ``init_base``) inserts
  versions as ``candidate`` only (and the base, version 0, into an empty registry: it registers the model directory
  when there is none), takes the version counter, and appends only ``candidate`` (and the base's ``init``) entries;
  it also adds its measurements of each version's sampler/trainer mismatch (``add_mismatch``: the ``mismatch``
  table's sums, nothing else);
- the gate (``candidates``, ``set_status``, ``promote``, ``record_gate``, the rollouts' methods) changes statuses
  (``status``, ``status_reason``, ``promoted_at`` only), writes rollouts and gate results, appends audit entries;
- the admin role (the operators' verbs in ``liverl.ops.admin``) does what the gate does, plus operators and ``gc``
  (a pruned version's ``blob_key``, ``snapshot_key``);
- the viewer reads everything but the operators' table;
- ingest and the router read only the ``deployment`` row (``liverl.stack.deployment.check_process``);
- users' data keys (``user_keys``, ``core.shred``): a serving node reads and inserts them (its gateway seals each user's
  text under the user's key, made on first use), ingest, the learner and the gate only read them (they open the
  text), the admin role reads and deletes them (forgetting a user destroys the key) and writes the ``erasures`` that
  record each request to forget; the viewer reads ``erasures``, never a key. Ingest inserts and reads ``erasures`` (the
  product's ``POST /v1/erasures``); the gate, whose loop runs those requests (``liverl.ops.forget``), also deletes keys
  and updates ``erasures``.

Nobody but the owner (who ran the migrations) may delete a version, update or delete an audit entry or a served row,
or create anything: the audit log is appended to only through ``RegistryDB.append_audit``'s ``INSERT``.

Row-level security, not a SECURITY DEFINER function, keeps a node to its own rows: the registry's code stays the one
path every role takes (``Registry.update_fleet`` issues the same ``INSERT``/``UPDATE`` as the owner's), a policy holds
for any statement the node's credentials could send, and there is no function whose search path or argument checks
could be got wrong. Each node has its own login role ``<prefix>node_<name>``, a member of the group ``<prefix>serving``
that holds the grants; the policies compare a row's ``node`` with the name in the role (``current_user``). A node
updates only ``version``, ``checksum``, ``updated_at`` (column grants), and an ``UPDATE`` whose row is not its own
fails the policy's check with SQLSTATE 42501, as a missing privilege does. The same policies keep the learner's
inserts to candidates and its audit entries to ``candidate`` (so a learner's credentials cannot write a ``promote``
entry for the gate to vouch for, ``deploy.registry.attest``). Owners bypass row-level security, so ``liverl up`` and
a registry without roles behave as before.

``role_sql`` writes the statements (idempotent: every apply revokes first, re-creates the policies, sets the
passwords); passwords go in as SCRAM-SHA-256 verifiers computed here (``scram_verifier``), so neither the printed SQL
nor the server's statement log holds one. ``apply_roles`` migrates the database first (as its owner) and runs them in
one transaction. Re-apply after a migration adds a table.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

import sqlalchemy as sa

from core.roles import PROCESSES, Role, check_role_prefix

SERVING_GROUP = "serving"
"""``<prefix>serving``: the group role (no login) every node's role is a member of."""

COMMON = {"alembic_version": "SELECT", "counters": "SELECT", "deployment": "SELECT"}
"""What every role that opens the registry reads: the schema's revision and the version counter (``RegistryDB``
checks both on opening), and the deployment row (``check_process``)."""

READ_ALL = (
    "versions",
    "gate_results",
    "audit_log",
    "fleet",
    "served",
    "rollouts",
    "deployment",
    "counters",
    "mismatch",
)

MISMATCH_SUMS = ("own_tokens", "own_abs", "own_kl", "replay_tokens", "replay_abs", "replay_kl")
"""The learner's measurements of each version's sampler/trainer mismatch (``mismatch``): sums it adds to."""

GATE = {
    **COMMON,
    "versions": "SELECT, UPDATE (status, status_reason, promoted_at)",
    "gate_results": "SELECT, INSERT",
    "rollouts": "SELECT, INSERT, UPDATE",
    "counters": "SELECT, UPDATE (value)",  # the registry's lock is the counter row, SELECT ... FOR UPDATE
    "audit_log": "SELECT, INSERT",
    "fleet": "SELECT",
    "served": "SELECT",
    "mismatch": "SELECT",
}

GRANTS: dict[str, dict[str, str]] = {
    "node": {
        **COMMON,
        "versions": "SELECT",
        "fleet": "SELECT, INSERT, UPDATE (version, checksum, updated_at)",
        "served": "SELECT, INSERT",
        "user_keys": "SELECT, INSERT",
    },
    "learner": {
        **COMMON,
        "versions": "SELECT, INSERT",
        "counters": "SELECT, UPDATE (value)",
        "audit_log": "SELECT, INSERT",
        "user_keys": "SELECT",
        "mismatch": f"SELECT, INSERT, UPDATE ({', '.join(MISMATCH_SUMS)}, updated_at)",
    },
    # the gate's loop runs the product's erasures (liverl.ops.forget.gate_chore): it destroys the user's key
    "gate": {**GATE, "user_keys": "SELECT, DELETE", "erasures": "SELECT, UPDATE"},
    "admin": {
        **GATE,
        "versions": "SELECT, UPDATE (status, status_reason, promoted_at, blob_key, snapshot_key)",
        "operators": "SELECT, INSERT, UPDATE",
        "user_keys": "SELECT, DELETE",
        "erasures": "SELECT, INSERT, UPDATE",
    },
    "viewer": {**COMMON, **dict.fromkeys(READ_ALL, "SELECT"), "erasures": "SELECT"},
    # POST /v1/erasures records the product's request; GET reads it back (ingest.erasures)
    "ingest": {"deployment": "SELECT", "user_keys": "SELECT", "erasures": "SELECT, INSERT"},
    "router": {"deployment": "SELECT"},
}
"""Table privileges per process (a node's go to the serving group)."""

SEQUENCES = {"node": (), "learner": ("audit_log",), "gate": ("audit_log", "gate_results", "rollouts")}
SEQUENCES["admin"] = SEQUENCES["gate"]
"""Tables whose ``id`` sequence (``<table>_id_seq``) a role's inserts draw from."""


def ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """``text`` as a SQL string literal (standard_conforming_strings, PostgreSQL's default since 9.1)."""
    if "\\" in text or "\0" in text:
        raise ValueError(f"refusing a backslash or NUL in a SQL literal: {text!r}")
    return "'" + text.replace("'", "''") + "'"


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677, as ``password_encryption =
    scram-sha-256`` makes it); PostgreSQL takes it in ``PASSWORD '...'`` as already encrypted."""
    if not password or not password.isascii() or not password.isprintable():
        raise ValueError("a role's password is printable ASCII (`liverl keys` makes such passwords)")
    salt = os.urandom(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}"


def _ensure_role(name: str, login: bool, password: str | None) -> list[str]:
    out = [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {literal(name)}) THEN "
        f"CREATE ROLE {ident(name)}; END IF; END $$",
    ]
    attrs = "NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT"
    if login:
        assert password is not None
        out.append(f"ALTER ROLE {ident(name)} WITH LOGIN {attrs} PASSWORD {literal(scram_verifier(password))}")
    else:
        out.append(f"ALTER ROLE {ident(name)} WITH NOLOGIN {attrs}")
    return out


def _grants(grantee: str, tables: Mapping[str, str], sequences: Iterable[str], database: str) -> list[str]:
    g = ident(grantee)
    out = [
        f"GRANT CONNECT ON DATABASE {ident(database)} TO {g}",
        f"GRANT USAGE ON SCHEMA public TO {g}",
        f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {g}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {g}",
    ]
    out += [f"GRANT {privs} ON {ident(table)} TO {g}" for table, privs in tables.items()]
    out += [f"GRANT USAGE ON SEQUENCE {ident(t + '_id_seq')} TO {g}" for t in sequences]
    return out


def _policy(table: str, name: str, command: str, to: str, using: str | None, check: str | None) -> list[str]:
    body = f"CREATE POLICY {name} ON {ident(table)} FOR {command} TO {to}"
    body += f" USING ({using})" if using is not None else ""
    body += f" WITH CHECK ({check})" if check is not None else ""
    return [f"DROP POLICY IF EXISTS {name} ON {ident(table)}", body]


def _policies(prefix: str) -> list[str]:
    r = {p: ident(f"{prefix}{p}") for p in ("learner", "gate", "admin", SERVING_GROUP)}
    node_prefix = f"{prefix}node_"
    n = len(node_prefix)
    mine = f"CASE WHEN left(current_user, {n}) = {literal(node_prefix)} THEN substr(current_user, {n + 1}) END"
    out = []
    for table in ("versions", "audit_log", "fleet", "served"):
        out.append(f"ALTER TABLE {ident(table)} ENABLE ROW LEVEL SECURITY")
        out += _policy(table, "liverl_read", "SELECT", "PUBLIC", "true", None)  # the grants say who reads
    out += _policy(
        "versions",
        "liverl_learner_insert",
        "INSERT",
        r["learner"],
        None,
        "status = 'candidate' OR (version = 0 AND parent IS NULL AND status = 'stable')",
    )
    out += _policy("versions", "liverl_release_update", "UPDATE", f"{r['gate']}, {r['admin']}", "true", "true")
    out += _policy(
        "audit_log", "liverl_learner_append", "INSERT", r["learner"], None,
        "action = 'candidate' OR (action = 'init' AND version = 0)",
    )  # fmt: skip
    out += _policy("audit_log", "liverl_release_append", "INSERT", f"{r['gate']}, {r['admin']}", None, "true")
    out += _policy("fleet", "liverl_node_insert", "INSERT", r[SERVING_GROUP], None, f"node = {mine}")
    out += _policy("fleet", "liverl_node_update", "UPDATE", r[SERVING_GROUP], "true", f"node = {mine}")
    out += _policy("served", "liverl_node_insert", "INSERT", r[SERVING_GROUP], None, f"node = {mine}")
    return out


def role_sql(database: str, prefix: str, passwords: Mapping[Role, str]) -> list[str]:
    """The statements that make (or bring up to date) every role in ``passwords`` (role -> its password) on the
    registry database ``database``, with its grants and the row-level security policies."""
    check_role_prefix(prefix)
    roles = list(passwords)
    out = _ensure_role(f"{prefix}{SERVING_GROUP}", login=False, password=None)
    out += _grants(f"{prefix}{SERVING_GROUP}", GRANTS["node"], SEQUENCES["node"], database)
    for role in roles:
        name = role.name(prefix)
        out += _ensure_role(name, login=True, password=passwords[role])
        if role.node is not None:
            out += _grants(name, {}, (), database)  # only what the serving group grants
            out.append(f"GRANT {ident(prefix + SERVING_GROUP)} TO {ident(name)}")
        else:
            out += _grants(name, GRANTS[role.process], SEQUENCES.get(role.process, ()), database)
    for p in ("learner", "gate", "admin"):  # the policies name them: they exist even when not asked for
        if Role(p) not in passwords:
            out += _ensure_role(f"{prefix}{p}", login=False, password=None)
    return out + _policies(prefix)


def apply_roles(owner_url: str, prefix: str, passwords: Mapping[Role, str]) -> list[str]:
    """Migrate the registry at ``owner_url`` (its owner's URL; a role that may create roles) to head, then run
    ``role_sql`` in one transaction. Returns the statements run."""
    from deploy.registry.regdb import RegistryDB  # noqa: PLC0415 alembic: only when applying

    url = sa.engine.make_url(owner_url)
    if url.get_backend_name() != "postgresql":
        raise ValueError(
            f"database roles are PostgreSQL's; the registry at {url.render_as_string(hide_password=True)} is "
            f"{url.get_backend_name()} (one file, one user: nothing to split)"
        )
    RegistryDB(owner_url).close()  # migrated (and the counter seeded) by its owner, before any role opens it
    statements = role_sql(url.database or "", prefix, passwords)
    engine = sa.create_engine(owner_url)
    try:
        with engine.begin() as c:
            for st in statements:
                c.exec_driver_sql(st)
    finally:
        engine.dispose()
    return statements


POLICIES = {
    "versions": ("liverl_read", "liverl_learner_insert", "liverl_release_update"),
    "audit_log": ("liverl_read", "liverl_learner_append", "liverl_release_append"),
    "fleet": ("liverl_read", "liverl_node_insert", "liverl_node_update"),
    "served": ("liverl_read", "liverl_node_insert"),
}


def deployment_roles(conn: sa.Connection, prefix: str) -> list[str]:
    """The roles of ``prefix`` on the server ``conn`` reaches: ``<prefix><process>``, ``<prefix>node_*`` and the
    serving group."""
    names = conn.execute(sa.text("SELECT rolname FROM pg_roles ORDER BY rolname")).scalars()
    fixed = {f"{prefix}{p}" for p in (*PROCESSES, SERVING_GROUP)}
    return [n for n in names if n in fixed or n.startswith(f"{prefix}node_")]


def drop_roles(owner_url: str, prefix: str) -> list[str]:
    """Undo ``apply_roles`` on the registry at ``owner_url``: its policies and row-level security go, and every role
    of ``prefix`` is dropped from the server (its privileges here first). A role that also has privileges in
    another database is refused by PostgreSQL: drop it there first. Returns the roles dropped."""
    check_role_prefix(prefix)
    engine = sa.create_engine(owner_url)
    try:
        with engine.begin() as c:
            for table, policies in POLICIES.items():
                if sa.inspect(c).has_table(table):
                    for policy in policies:
                        c.exec_driver_sql(f"DROP POLICY IF EXISTS {policy} ON {ident(table)}")
                    c.exec_driver_sql(f"ALTER TABLE {ident(table)} DISABLE ROW LEVEL SECURITY")
            gone = deployment_roles(c, prefix)
            for name in gone:
                c.exec_driver_sql(f"DROP OWNED BY {ident(name)}")
            for name in gone:
                c.exec_driver_sql(f"DROP ROLE {ident(name)}")
    finally:
        engine.dispose()
    return gone


def role_url(owner_url: str, role: Role, prefix: str) -> str:
    """``owner_url`` as ``role`` connects: its user, no password (``registry.password_file`` holds it)."""
    url = sa.engine.make_url(owner_url).set(username=role.name(prefix), password=None)
    return url.render_as_string(hide_password=False)
