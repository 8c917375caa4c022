"""The compose file's logins, read without running it (test_compose.py runs it): each liverl service logs in to
PostgreSQL and Redis as its own role (``core.roles``) with its own password files and mounts exactly the key files its
role's code loads (``core.roles.mounts``); the one-shot services that make the roles mount only the passwords, and
the bundled PostgreSQL and Redis take no login without one."""

from __future__ import annotations

import json
import re

import yaml

from core.roles import Role, mounts, roles
from liverl.ops.keyfiles import key_files
from tests.packaging.test_compose import COMPOSE

KEYS = "/etc/liverl/keys/"
NODES = ("node-a", "node-b")
SERVICES = {
    "router-a": Role("router"),
    "router-b": Role("router"),
    "node-a": Role("node", "node-a"),
    "node-b": Role("node", "node-b"),
    "ingest-a": Role("ingest"),
    "ingest-b": Role("ingest"),
    "learner": Role("learner"),
    "gate": Role("gate"),
    "admin": Role("admin"),
    "viewer": Role("viewer"),
}
ONE_SHOTS = {"db-roles": "db", "redis-acl": "redis"}  # the service, and the passwords it makes roles of


def defaults(value):
    """``value`` with compose's ``${VAR:-default}`` as the default, as `up` reads it with none of the variables set."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m[2], value)
    if isinstance(value, list):
        return [defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: defaults(v) for k, v in value.items()}
    return value


def services() -> dict[str, dict]:
    return defaults(yaml.safe_load(COMPOSE.read_text())["services"])


def key_mounts(service: dict) -> dict[str, str]:
    """The files mounted under ``/etc/liverl/keys/``: the name inside -> the path in the keys folder."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if target.startswith(KEYS):
            out[target.removeprefix(KEYS)] = source
    return out


def test_each_liverl_service_logs_in_as_its_own_role_and_mounts_only_its_files():
    every = services()
    made = {f for kf in key_files(roles(NODES)) for f in kf.files}  # what `liverl keys --nodes node-a,node-b` makes
    image = every["gate"]["image"]
    # every long-running liverl process is one of the roles (the broker logs in to neither store)
    runs_liverl = {n for n, s in every.items() if s.get("image") == image} - {"broker", *ONE_SHOTS}
    assert runs_liverl == set(SERVICES)
    for name, role in SERVICES.items():
        env, files = every[name]["environment"], key_mounts(every[name])
        user = role.name("liverl_")
        assert env["LIVERL__REGISTRY__URL"] == f"postgresql+psycopg://{user}@postgres:5432/liverl", name
        assert env["LIVERL__REDIS__URL"] == f"redis://{user}@redis:6379/0", name
        assert set(files) == {f for f, _ in mounts(role)}, name  # nothing more, nothing less
        for file, setting in mounts(role):
            assert env["LIVERL__" + setting.upper().replace(".", "__")] == KEYS + file, (name, setting)
            assert files[file] == f"./keys/{file}" and file in made, (name, file)
        if role.node is not None:
            assert env["LIVERL__SERVING__NODE_NAME"] == role.node  # a node writes only the rows of its role's name
    fleet = json.loads(every["gate"]["environment"]["LIVERL__SERVING__FLEET"])
    assert set(fleet) == set(NODES)  # the one-shots make the roles of the nodes in serving.fleet


def test_the_one_shots_make_every_role_from_its_password_and_the_stores_need_one():
    every = services()
    for name, service in ONE_SHOTS.items():
        files = key_mounts(every[name])
        assert set(files) == {r.password_file(service) for r in roles(NODES)}, name
    assert every["redis-acl"]["command"][:2] == ["redis", "acl"] and "--aclfile" in every["redis-acl"]["command"]
    assert "liverl db roles" in every["db-roles"]["command"][0] and "--apply" in every["db-roles"]["command"][0]
    # Redis loads the ACL file (the default user off in it) and starts only once it is written
    redis = every["redis"]
    assert "--aclfile /etc/redis/liverl/users.acl" in redis["command"][-1]
    assert redis["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
    # PostgreSQL: the owner only through the socket, which only db-roles shares; every network login by password
    pg = every["postgres"]["command"][-1]
    hba = [line.strip() for line in pg.splitlines() if "pg_hba.conf" in line]
    # written whole at every start: a cluster made with other rules takes these
    rules = "'local all liverl trust' 'host all all all scram-sha-256'"
    assert hba == [f"""printf '%s\\n' {rules} >"$$PGDATA/pg_hba.conf\""""]
    assert "--auth-host=scram-sha-256" in pg and "--auth-host=trust" not in pg
    socket = [n for n, s in every.items() if any(v.startswith("pg-socket:") for v in s.get("volumes", []))]
    assert sorted(socket) == ["db-roles", "postgres"]


def test_no_volume_name_starts_with_another():
    """podman 4 also finds a volume by a unique prefix of its name: podman-compose would take ``redis`` for an existing
    ``redis-acl``, and podman would then make ``redis`` without the project's label, which ``down -v`` leaves behind."""
    names = list(yaml.safe_load(COMPOSE.read_text())["volumes"])
    assert not [(a, b) for a in names for b in names if a != b and b.startswith(a)]
