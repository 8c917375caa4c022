"""Where each shared service is: the one place every process and command asks.

A process never starts a service; ``liverl up`` and ``liverl demo`` start the embedded stack
(``liverl.stack.stack``) and pass its URLs down through the config. The rules:

- Kafka: ``broker.bootstrap``, else the embedded broker's port on 127.0.0.1.
- Redis: ``redis.url``, else 127.0.0.1:6379 when it answers, else the embedded port.
- Registry: ``cfg.registry_url`` (``registry.url``, else SQLite in ``<state_dir>/registry.db``).
- Blobs: ``cfg.blob_location`` (``registry.blob_dir`` as written: a folder or ``s3://`` URL; else
  ``<state_dir>/blobs``).

The registry and blob store themselves are opened by the library that owns them
(``deploy.registry.registry.open_registry``); this module is torch-free and imports no process package.
"""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import LiverlConfig
from core.config.base import redact_url, url_with_password_file

if TYPE_CHECKING:
    import redis

log = logging.getLogger("liverl.services")


class LiverlError(RuntimeError):
    """Base of liverl's operational errors (a service down, a node that fails, a swap refused).

    ``liverl``'s CLI turns these into a one-line message and exit code 1 instead of a traceback.
    """


class ServiceError(LiverlError):
    """A configured service does not answer: ``liverl`` exits ``EXIT_TEMPFAIL``, so a supervisor starts it again."""


EXIT_TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: a service this process needs did not answer; try again


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on now, outside the kernel's range for outgoing connections.

    Why not the kernel's pick (bind to port 0): that comes from the ephemeral range, the same range every outgoing
    connection (Kafka, Redis, vLLM's own sockets) draws its local port from, and a server that binds tens of seconds
    later (a gateway after vLLM's start) found its port taken (a CI run failed so). Below the range only listeners
    compete for a port, and they are ours.
    """
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    first = 10_000 if low > 12_000 else 1024
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, max(low, first + 1))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a crowded machine: the kernel's pick after all)
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def kafka_bootstrap(cfg: LiverlConfig) -> str:
    """Kafka bootstrap servers: ``broker.bootstrap``, else the embedded broker on 127.0.0.1."""
    return cfg.broker.bootstrap or f"127.0.0.1:{cfg.broker.embedded_port}"


def local_redis_url(cfg: LiverlConfig) -> str | None:
    """``redis.url`` (with the password of ``redis.password_file``), else the standard local Redis when one answers,
    else None (the stack starts one)."""
    if cfg.redis.url or cfg.redis.password_file:
        return url_with_password_file(cfg.redis.url, cfg.redis.password_file, "redis")
    if port_open("127.0.0.1", 6379):
        return "redis://127.0.0.1:6379/0"
    return None


def redis_url(cfg: LiverlConfig) -> str:
    """The Redis every process uses: ``redis.url``, else 127.0.0.1:6379 when it answers, else the embedded port."""
    return local_redis_url(cfg) or f"redis://127.0.0.1:{cfg.redis.embedded_port}/0"


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def redis_from_url(url: str, *, asyncio: bool = False, **kw):
    """A client for ``url``: ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) is a Redis Cluster,
    reached through any of its nodes (``redis.cluster.RedisCluster``); any other URL one Redis server. Every process
    builds its clients here, so both work everywhere (keys used together share a hash tag: ``core.keys``)."""
    cluster = is_cluster_url(url)
    if cluster:
        url = url.replace("+cluster", "", 1)
    if asyncio:
        import redis.asyncio as aioredis  # noqa: PLC0415 redis: `liverl --help` loads this module
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster  # noqa: PLC0415 redis: `liverl --help` loads this module

        return (AsyncRedisCluster if cluster else aioredis.Redis).from_url(url, **kw)
    import redis  # noqa: PLC0415 redis: `liverl --help` loads this module

    return (redis.RedisCluster if cluster else redis.Redis).from_url(url, **kw)


def forget_prefix(url: str, prefix: str) -> int:
    """Delete every key of a run's namespace (``<prefix>*``) from the Redis at ``url`` (a bench's or a test's, which
    may be the user's own: a run leaves a guard key per joined event, and millions of them slow every later scan of
    the keyspace). Returns how many keys went."""
    r = redis_from_url(url)
    per_key = is_cluster_url(url)  # a cluster deletes several keys at once only within one slot

    def delete(batch: list[bytes]) -> int:
        return sum(r.delete(k) for k in batch) if per_key else r.delete(*batch)

    gone = 0
    try:
        batch: list[bytes] = []
        for k in r.scan_iter(f"{prefix}*", count=5000):
            batch.append(k)
            if len(batch) >= 1000:
                gone += delete(batch)
                batch.clear()
        if batch:
            gone += delete(batch)
    finally:
        r.close()
    return gone


def setup_redis(cfg: LiverlConfig, decode_responses: bool = False) -> redis.Redis:
    """A client for the configured Redis (``redis_url``); connects lazily."""
    return redis_from_url(redis_url(cfg), decode_responses=decode_responses, socket_connect_timeout=3)


def signing_key_path(cfg: LiverlConfig) -> Path | None:
    """The announcement signing key: ``security.signing_key``, else ``<state_dir>/keys/announce.key`` if present."""
    if cfg.security.signing_key:
        return Path(cfg.security.signing_key)
    default = cfg.state_path / "keys" / "announce.key"
    return default if default.exists() else None


def verify_key_path(cfg: LiverlConfig) -> Path | None:
    """The announcement verify key: ``security.verify_key``, else ``<state_dir>/keys/announce.pub`` if present."""
    if cfg.security.verify_key:
        return Path(cfg.security.verify_key)
    default = cfg.state_path / "keys" / "announce.pub"
    return default if default.exists() else None


def _required_key(
    cfg: LiverlConfig, path: Path | None, setting: str, default_name: str, who: str, without: str
) -> Path | None:
    if path is not None:
        if not path.is_file():
            raise ValueError(
                f"security.{setting} is {path}, which is not a file: point it at the key "
                f"(deploy.registry.signing.generate_keypair or `liverl up` makes a pair)"
            )
        return path
    if cfg.security.allow_unsigned:
        log.warning(
            "UNSIGNED ANNOUNCEMENTS: %s runs without an announcement key (security.allow_unsigned = true): %s",
            who,
            without,
        )
        return None
    raise ValueError(
        f"{who} needs the announcement {'signing' if setting == 'signing_key' else 'verify'} key and "
        f"has none: set security.{setting} (or put it at {cfg.state_path / 'keys' / default_name}; "
        "`liverl up` makes a pair there), or, UNSAFE and only where every Redis writer is trusted, set "
        "security.allow_unsigned = true"
    )


def required_verify_key(cfg: LiverlConfig) -> Path | None:
    """The verify key a serving agent must have (``verify_key_path``). Without one: ``ValueError`` naming both ways out,
    unless ``security.allow_unsigned`` (then None, said loudly in the log)."""
    return _required_key(
        cfg,
        verify_key_path(cfg),
        "verify_key",
        "announce.pub",
        "liverl serve",
        "its agent follows any announcement written to Redis, signed or not",
    )


def required_signing_key(cfg: LiverlConfig) -> Path | None:
    """The signing key the gate must have (``signing_key_path``). Without one: ``ValueError`` naming both ways out,
    unless ``security.allow_unsigned`` (then None, said loudly in the log)."""
    return _required_key(
        cfg,
        signing_key_path(cfg),
        "signing_key",
        "announce.key",
        "the gate",
        "its announcements are unsigned, and agents that hold a verify key refuse them",
    )


def check_redis(url: str) -> None:
    import redis  # noqa: PLC0415 redis: `liverl --help` loads this module

    try:
        redis_from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as e:
        raise ServiceError(f"Redis at {redact_url(url)} does not answer: {e}") from e
