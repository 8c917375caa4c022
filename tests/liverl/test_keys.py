"""`liverl keys`, `liverl db roles` and `liverl redis acl` as an operator runs them: key files made once (mode 0600),
never overwritten, rotated only by name; the roles and users made with those passwords, and a process that takes
its role from its config."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import pytest
import redis

from core.config import load_config
from liverl.cli import main

SHARED = {"announce.key", "announce.pub", "audit.key", "feedback.key", "assignment.key", "shred.key"}
PROCESSES = ("gate", "learner", "admin", "viewer", "ingest", "router")


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_keys_are_made_once_mode_0600_and_work_where_they_are_mounted(tmp_path, capsys):
    from core.credentials import load_assignment_key, load_feedback_keys
    from core.schemas import VersionAnnouncement
    from core.shred import load_kek
    from deploy.registry.auditchain import load_audit_key
    from deploy.registry.signing import Signer, Verifier

    folder = tmp_path / "secrets"
    assert main(["keys", str(folder), "--nodes", "node-a"]) == 0
    out = capsys.readouterr().out
    roles = [*PROCESSES, "node-node-a"]
    assert set(contents(folder)) == SHARED | {f"{s}-{r}.password" for s in ("db", "redis") for r in roles}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    node_part = " ".join(out[out.index("liverl serve (serving.node_name = node-a)") :].split())
    assert f"security.verify_key = {folder / 'announce.pub'}" in node_part
    assert f"registry.password_file = {folder / 'db-node-node-a.password'}" in node_part

    cfg = load_config(
        env={},
        security__audit_key=str(folder / "audit.key"),
        security__assignment_key=str(folder / "assignment.key"),
        security__feedback_key=str(folder / "feedback.key"),
    )
    assert len(load_audit_key(cfg)) >= 32 and len(load_assignment_key(cfg)) >= 16 and len(load_feedback_keys(cfg)) == 1
    assert len(load_kek(load_config(env={}, security__shred_key=str(folder / "shred.key")))) == 32
    ann = VersionAnnouncement(version=1, checksum="c" * 64, reason="r", ts=1.0, prefix="p", expires_at=2e9)
    Verifier(folder / "announce.pub").verify(Signer(folder / "announce.key").sign(ann))

    before = contents(folder)
    assert main(["keys", str(folder)]) == 2  # a second run refuses, and writes nothing
    assert "never overwrites a key" in capsys.readouterr().err and contents(folder) == before
    assert main(["keys", str(folder), "--missing", "--nodes", "node-a,node-b"]) == 0
    after = contents(folder)
    assert set(after) - set(before) == {"db-node-node-b.password", "redis-node-node-b.password"}
    assert {k: after[k] for k in before} == before


def test_rotate_replaces_only_the_key_named_and_never_the_audit_key(tmp_path, capsys):
    from core.credentials import load_feedback_keys

    folder = tmp_path / "secrets"
    assert main(["keys", str(folder)]) == 0
    before = contents(folder)
    assert main(["keys", str(folder), "--rotate", "db-gate"]) == 0
    assert "liverl db roles --keys" in capsys.readouterr().out  # what to run next
    after = contents(folder)
    assert [k for k in before if before[k] != after[k]] == ["db-gate.password"]
    assert stat.S_IMODE((folder / "db-gate.password").stat().st_mode) == 0o600

    assert main(["keys", str(folder), "--rotate", "announce"]) == 0
    changed = contents(folder)
    assert [k for k in after if after[k] != changed[k]] == ["announce.key", "announce.pub"]

    old = (folder / "feedback.key").read_bytes()
    assert main(["keys", str(folder), "--rotate", "feedback"]) == 0  # the old product key stays, second
    keys = load_feedback_keys(load_config(env={}, security__feedback_key=str(folder / "feedback.key")))
    assert len(keys) == 2 and keys[1] == old.strip() and keys[0] != keys[1]

    final = contents(folder)
    assert main(["keys", str(folder), "--rotate", "audit"]) == 2
    assert "the audit key is not rotated" in capsys.readouterr().err
    assert main(["keys", str(folder), "--rotate", "shred"]) == 2  # a new one would forget every user
    assert "forget every user at once" in capsys.readouterr().err
    assert main(["keys", str(folder), "--rotate", "db-nobody"]) == 2
    assert contents(folder) == final
    (folder / "announce.pub").unlink()
    assert main(["keys", str(folder), "--missing"]) == 2  # half a pair: not remade behind the operator's back
    assert "without the rest of the announce pair" in capsys.readouterr().err


def test_the_printed_sql_and_acl_rules_hold_no_password(tmp_path, capsys):
    folder = tmp_path / "secrets"
    assert main(["keys", str(folder), "--nodes", "node-a"]) == 0
    capsys.readouterr()
    passwords = [p.read_text().strip() for p in folder.glob("*.password")]
    url = "postgresql+psycopg://owner@db.internal/liverl"
    assert main(["db", "roles", "--keys", str(folder), "--url", url, "--nodes", "node-a"]) == 0
    sql = capsys.readouterr().out
    assert 'GRANT SELECT ON "versions" TO "liverl_serving"' in sql and "CREATE POLICY liverl_node_update" in sql
    assert main(["redis", "acl", "--keys", str(folder), "--url", "redis://x:6379/0", "--nodes", "node-a"]) == 0
    rules = capsys.readouterr().out
    assert "ACL SETUSER liverl_node_node-a reset on" in rules and "'~liverl:served:node-a'" in rules
    assert not any(pw in sql or pw in rules for pw in passwords)


def test_db_roles_and_redis_acl_applied_and_a_process_connects_with_its_files(tmp_path, pg_url, capsys, monkeypatch):
    from deploy.registry.registry import open_registry

    admin = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        admin.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at 127.0.0.1:6379 ({e})")
    folder, prefix, topics = tmp_path / "secrets", f"t{uuid.uuid4().hex[:8]}_", f"t{uuid.uuid4().hex[:10]}"
    common = ["--keys", str(folder), "--nodes", "node-a", "--role-prefix", prefix]
    monkeypatch.setenv("LIVERL__TOPICS__PREFIX", topics)  # the deployment's keys, as its config names them
    assert main(["keys", str(folder), "--nodes", "node-a"]) == 0
    try:
        assert main(["db", "roles", *common, "--url", pg_url, "--apply"]) == 0
        assert main(["redis", "acl", *common, "--url", "redis://127.0.0.1:6379/0", "--apply"]) == 0
        out = capsys.readouterr().out
        out = " ".join(out.split())
        assert f'registry.url = "{pg_url.replace("postgres@", prefix + "gate@")}"' in out
        assert f'redis.url = "redis://{prefix}node_node-a@127.0.0.1:6379/0"' in out
        gate = load_config(
            env={},
            state_dir=str(tmp_path / "state"),
            topics__prefix=topics,
            registry__url=pg_url.replace("postgres@", f"{prefix}gate@"),
            registry__password_file=str(folder / "db-gate.password"),
        )
        reg = open_registry(gate)
        try:
            assert reg.list() == [] and prefix + "gate" in reg.url
        finally:
            reg.close()
        from core.services import setup_redis

        node = load_config(
            env={},
            topics__prefix=topics,
            redis__url=f"redis://{prefix}node_node-a@127.0.0.1:6379/0",
            redis__password_file=str(folder / "redis-node-node-a.password"),
        )
        r = setup_redis(node)
        try:
            r.set(f"{topics}:served:node-a", "{}")  # authenticated with the file's password, as its own user
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.set(f"{topics}:desired", "forged")
        finally:
            r.close()
    finally:
        assert main(["redis", "acl", *common, "--url", "redis://127.0.0.1:6379/0", "--drop"]) == 0
        assert main(["db", "roles", *common, "--url", pg_url, "--drop"]) == 0
        left = [u for u in admin.execute_command("ACL", "USERS") if u.decode().startswith(prefix)]
        admin.delete(f"{topics}:served:node-a")
        admin.close()
    assert left == []


def test_redis_acl_writes_an_acl_file_redis_loads_with_the_default_user_off(tmp_path, capsys, monkeypatch):
    import os
    import shutil
    import subprocess
    import time

    from core.services import free_port, setup_redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: redis-server): no Redis to load the ACL file")
    folder, topics = tmp_path / "secrets", f"t{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("LIVERL__TOPICS__PREFIX", topics)
    assert main(["keys", str(folder), "--nodes", "node-a"]) == 0
    acl = tmp_path / "acl" / "users.acl"
    acl.parent.mkdir()
    common = ["--keys", str(folder), "--nodes", "node-a", "--role-prefix", "liverl_"]
    assert main(["redis", "acl", *common, "--aclfile", str(acl)]) == 0
    assert "--aclfile" in capsys.readouterr().out
    text = acl.read_text()
    assert stat.S_IMODE(acl.stat().st_mode) == 0o644 and text.startswith("user default reset\n")
    assert not any(p.read_text().strip() in text for p in folder.glob("*.password"))
    assert not list(acl.parent.glob("*.tmp"))

    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(acl), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        anonymous = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                anonymous.ping()
                raise AssertionError("the default user answered: it should be off")
            except redis.exceptions.AuthenticationError:
                break  # up, and asking for a user
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        anonymous.close()
        node = setup_redis(
            load_config(
                env={},
                topics__prefix=topics,
                redis__url=f"redis://liverl_node_node-a@127.0.0.1:{port}/0",
                redis__password_file=str(folder / "redis-node-node-a.password"),
            )
        )
        try:
            node.set(f"{topics}:served:node-a", "{}")
            with pytest.raises(redis.exceptions.NoPermissionError):
                node.set(f"{topics}:desired", "forged")
        finally:
            node.close()
    finally:
        os.kill(server.pid, 15)
        server.wait(timeout=10)
