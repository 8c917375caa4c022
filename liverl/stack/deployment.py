"""One deployment, one state dir, one Redis namespace: the binding ``liverl up`` and ``liverl demo`` check first.

A deployment is a state dir (``<state_dir>/deployment.json`` holds its id, made once) together with the Redis keys
under its prefix (``topics.prefix``). The namespace is claimed in Redis by ``<prefix>:deployment``, which names the
owner's id, state dir and model. Without the binding two deployments on one Redis read and wrote each other's live
counters, rollout plan and desired version, and ``--fresh`` would delete the other one's keys.

The registry records the deployment too (its ``deployment`` table, written by ``record`` once ``up`` made the
registry), so a standalone process on another machine, sharing only the registry and Redis with the rest, checks the
same binding before it starts (``check_process``: ``liverl serve``, ``route``, ``ingest``, ``learn``, ``gate``).

Refused, each with a message naming both sides and what to do:
- a state dir whose registry holds another model's base (``liverl up --model OTHER`` after the demo): pass
  ``--fresh`` (start over in that state dir) or ``--state-dir NEW``; before this check the learner died on a torch
  size mismatch while loading the old checkpoint into the new model;
- a prefix claimed by another deployment (another state dir): use another ``topics.prefix`` (or that state dir);
- keys under the prefix that no deployment claims, from a new state dir: they predate deployment ids, and nothing
  says whose they are, so they are left alone (``--fresh`` included) and the message says how to remove them.

Torch-free (the registry is read with SQLAlchemy's core, not through ``deploy.registry.registry``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import sqlalchemy as sa
from redis.exceptions import NoPermissionError

from core import keys
from core.config import LiverlConfig, redact_url
from core.services import LiverlError

FILE = "deployment.json"
log = logging.getLogger("liverl.deployment")


class DeploymentError(LiverlError):
    """The state dir, the model and the Redis namespace do not belong to one deployment."""


@dataclass(frozen=True)
class Deployment:
    id: str
    state_dir: str
    model: str | None = None

    def describe(self) -> str:
        return f"deployment {self.id} (state dir {self.state_dir}" + (f", model {self.model})" if self.model else ")")


def claim_key(prefix: str) -> str:
    """The Redis key naming the deployment that owns ``<prefix>:*``."""
    return keys.deployment(prefix)


def identity(cfg: LiverlConfig) -> Deployment:
    """This state dir's deployment, made (and written) the first time."""
    path = cfg.state_path / FILE
    try:
        data = json.loads(path.read_text())
        return Deployment(id=str(data["id"]), state_dir=str(cfg.state_path))
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as e:
        raise DeploymentError(
            f"{path} is not a deployment file ({e}); restore it, or remove it to make this state dir a new deployment"
        ) from None
    d = Deployment(id=uuid.uuid4().hex[:12], state_dir=str(cfg.state_path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"id": d.id}) + "\n")
    tmp.replace(path)
    return d


def _registry_row(cfg: LiverlConfig, table: str, sql: str) -> tuple | None:
    """The first row of ``sql`` on the registry's ``table``; None without a registry, that table (a registry from
    before it) or a row."""
    url = cfg.registry_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return None
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            if not sa.inspect(c).has_table(table):
                return None
            row = c.execute(sa.text(sql)).first()
    finally:
        engine.dispose()
    return None if row is None else tuple(row)


def registry_base(cfg: LiverlConfig) -> str | None:
    """The model directory version 0 of this state dir's registry was made from, or None without a registry."""
    row = _registry_row(cfg, "versions", "SELECT model_dir FROM versions WHERE version = 0")
    return None if row is None or row[0] is None else str(row[0])


def registry_deployment(cfg: LiverlConfig) -> Deployment | None:
    """The deployment the registry (``registry.url``) belongs to, as ``record`` wrote it; None before one did."""
    row = _registry_row(cfg, "deployment", "SELECT id, state_dir, model FROM deployment ORDER BY made_at LIMIT 1")
    return None if row is None else Deployment(id=str(row[0]), state_dir=str(row[1]), model=row[2])


def _another_registry(cfg: LiverlConfig, me: Deployment, owner: Deployment) -> DeploymentError:
    return DeploymentError(
        f"the registry {redact_url(cfg.registry_url)} belongs to {owner.describe()}, not to this {me.describe()}. "
        f"Run with --state-dir {owner.state_dir}, or give this deployment its own registry (registry.url) and Redis "
        f"prefix (topics.prefix)"
    )


def record(cfg: LiverlConfig, me: Deployment, model_dir: Path | None = None) -> None:
    """Write this deployment into its registry (once; after the registry's migrations ran), so standalone processes
    that share only the registry and Redis can check the prefix (``check_process``). Refuses a registry another
    deployment wrote."""
    engine = sa.create_engine(cfg.registry_url)
    try:
        with engine.begin() as c:
            row = c.execute(sa.text("SELECT id, state_dir, model FROM deployment LIMIT 1")).first()
            if row is None:
                c.execute(
                    sa.text("INSERT INTO deployment (id, state_dir, model, made_at) VALUES (:i, :s, :m, :t)"),
                    {"i": me.id, "s": me.state_dir, "m": str(model_dir) if model_dir else None, "t": time.time()},
                )
                return
    finally:
        engine.dispose()
    if str(row[0]) != me.id:
        raise _another_registry(cfg, me, Deployment(id=str(row[0]), state_dir=str(row[1]), model=row[2]))


def _claimant(redis, prefix: str) -> Deployment | None:
    """The deployment that claims ``prefix`` in Redis, or None; a key that is no claim is refused."""
    raw = redis.get(claim_key(prefix))
    if raw is None:
        return None
    try:
        return Deployment(**json.loads(raw))
    except (ValueError, TypeError):
        raise DeploymentError(
            f"the Redis key {claim_key(prefix)} is not a deployment claim ({raw[:80]!r}); "
            "remove it by hand if no deployment uses this prefix"
        ) from None


def check_process(cfg: LiverlConfig, redis, role: str) -> Deployment | None:
    """What a standalone ``liverl serve | route | ingest | learn | gate`` checks before it starts: the deployment its
    registry belongs to must be the one that claims ``topics.prefix`` in Redis. It claims an unclaimed prefix for
    that deployment (unless its Redis user may only read the claim: ``core.roles``); it refuses one another
    deployment claims, naming both. A registry no deployment was recorded
    in (made by a release without deployment ids, or not reachable from this machine) has nothing to check: returns
    None."""
    me = registry_deployment(cfg)
    if me is None:
        return None
    prefix = cfg.topics.prefix
    try:
        if redis.set(claim_key(prefix), json.dumps(asdict(me)), nx=True):
            return me
    except NoPermissionError:  # a Redis user that may only read the claim (core.roles): checked, not made
        pass
    owner = _claimant(redis, prefix)
    if owner is None:
        log.warning(
            "liverl %s: the Redis namespace %r is not claimed yet and this process's Redis user may not claim it "
            "(the gate's may): started unchecked",
            role,
            prefix,
        )
    elif owner.id != me.id:
        raise DeploymentError(
            f"liverl {role}: its registry {redact_url(cfg.registry_url)} belongs to {me.describe()}, but the Redis "
            f"namespace {prefix!r} ({prefix}:*) is claimed by {owner.describe()}. Point this process at that "
            f"deployment's registry (registry.url), or give it its own prefix (topics.prefix, e.g. "
            f"LIVERL__TOPICS__PREFIX=myapp)"
        )
    return me


def check_operator(cfg: LiverlConfig, redis) -> None:
    """What an operator command checks before it reads or changes anything: the deployment its registry belongs to
    must be the one that claims ``topics.prefix`` in Redis, or the command would show (or act on) one deployment's
    versions beside another's fleet. Read-only: it claims nothing. A mismatch is refused naming both, with the prefix
    the registry's deployment claims when Redis has one. Nothing to check without a recorded deployment or a claim."""
    me = registry_deployment(cfg)
    if me is None:
        return
    prefix = cfg.topics.prefix
    owner = _claimant(redis, prefix)
    if owner is None or owner.id == me.id:
        return
    mine = _prefix_claimed_by(redis, me.id)
    advice = (
        f"Run it with that deployment's prefix: LIVERL__TOPICS__PREFIX={mine} (or topics.prefix in its config)"
        if mine
        else "Run it with the topics.prefix that deployment was started with (LIVERL__TOPICS__PREFIX=...)"
    )
    raise DeploymentError(
        f"the registry {redact_url(cfg.registry_url)} belongs to {me.describe()}, but the Redis namespace {prefix!r} "
        f"({prefix}:*) is claimed by {owner.describe()}: this command would read one deployment's versions and "
        f"another's fleet. {advice}; or point registry.url at the registry of {owner.state_dir} to operate that one"
    )


def _prefix_claimed_by(redis, deployment_id: str) -> str | None:
    """The Redis prefix whose claim names ``deployment_id``, if any (a scan of the claims)."""
    for key in redis.scan_iter(match=claim_key("*"), count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        prefix = name.removesuffix(":deployment")
        try:
            owner = _claimant(redis, prefix)
        except DeploymentError:
            continue
        if owner is not None and owner.id == deployment_id:
            return prefix
    return None


def check_model(cfg: LiverlConfig, model_dir: Path, fresh: bool) -> None:
    """Refuse a state dir whose registry was made from another model (unless ``fresh``: it starts over)."""
    if fresh:
        return
    base = registry_base(cfg)
    if base is None or Path(base).resolve() == Path(model_dir).resolve():
        return
    raise DeploymentError(
        f"the state dir {cfg.state_path} belongs to a deployment of the model {base}, not {model_dir} (its versions "
        f"and learner checkpoint are that model's). Pass --fresh to start over in this state dir (its versions, "
        f"checkpoints and broker data are deleted), or --state-dir NEW to keep it and start a second deployment "
        f"(on the same Redis, with another topics.prefix, e.g. LIVERL__TOPICS__PREFIX=myapp)"
    )


def check_namespace(cfg: LiverlConfig, redis, me: Deployment, adopt: bool) -> None:
    """Refuse ``topics.prefix`` when another deployment claims it, or when unclaimed keys are there and this
    deployment cannot say they are its own (``adopt``: its state dir already has a registry, from before ids)."""
    prefix = cfg.topics.prefix
    owner = _claimant(redis, prefix)
    if owner is not None:
        if owner.id != me.id:
            raise DeploymentError(
                f"the Redis namespace {prefix!r} ({prefix}:*) belongs to {owner.describe()}, not to this "
                f"{me.describe()}. Give this deployment its own prefix (topics.prefix, e.g. "
                f"LIVERL__TOPICS__PREFIX=myapp), or run with --state-dir {owner.state_dir}"
            )
        return
    if adopt:
        return
    stray = next(iter(redis.scan_iter(keys.everything(prefix), count=1000)), None)
    if stray is not None:
        raise DeploymentError(
            f"Redis already holds keys under the prefix {prefix!r} (e.g. {stray!r}) that no deployment claims (from a "
            f"liverl older than deployment ids); this {me.describe()} leaves them alone, --fresh included. Use "
            f"another topics.prefix (e.g. LIVERL__TOPICS__PREFIX=myapp), run with the state dir that made them, or "
            f"delete them: redis-cli --scan --pattern '{prefix}:*' | xargs -r redis-cli del"
        )


def claim(cfg: LiverlConfig, redis, me: Deployment, model_dir: Path | None = None) -> None:
    """Write this deployment's claim on ``topics.prefix`` (after ``check_namespace``)."""
    d = Deployment(id=me.id, state_dir=me.state_dir, model=str(model_dir) if model_dir else None)
    if not redis.set(claim_key(cfg.topics.prefix), json.dumps(asdict(d)), nx=True):
        check_namespace(cfg, redis, me, adopt=True)  # someone claimed it meanwhile: refused unless it is us


def made_before_ids(cfg: LiverlConfig) -> bool:
    """True for a state dir from a liverl older than deployment ids (a registry, no deployment file): the unclaimed
    keys under its prefix are taken to be its own. Ask before ``--fresh`` removes the registry."""
    return not (cfg.state_path / FILE).exists() and registry_base(cfg) is not None


def bind(cfg: LiverlConfig, redis, model_dir: Path, fresh: bool, adopt: bool | None = None) -> Deployment:
    """What ``up`` calls once Redis answers: this state dir's deployment, with the prefix checked (``claim`` writes
    it). ``check_model`` runs earlier, before anything starts; ``adopt`` is ``made_before_ids`` (asked now unless
    given). Returns the deployment."""
    adopt = made_before_ids(cfg) if adopt is None else adopt
    me = identity(cfg)
    owner = registry_deployment(cfg)
    if owner is not None and owner.id != me.id and not fresh:  # a registry.url another deployment uses
        raise _another_registry(cfg, me, owner)
    check_namespace(cfg, redis, me, adopt=adopt)
    return me
