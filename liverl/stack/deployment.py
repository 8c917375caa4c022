"""One deployment, one state dir, one Redis namespace: the binding ``liverl up`` and ``liverl demo`` check first.

A deployment is a state dir (``<state_dir>/deployment.json`` holds its id, made once) together with the Redis keys
under its prefix (``topics.prefix``). The namespace is claimed in Redis by ``<prefix>:deployment``, which names the
owner's id, state dir and model. Without the binding two deployments on one Redis read and wrote each other's live
counters, rollout plan and desired version, and ``--fresh`` would delete the other one's keys.

The registry records the deployment too (its ``deployment`` table, written by ``record`` once ``up`` made the
registry), so a standalone process on another machine, sharing only the registry and Redis with the rest, checks the
same binding before it starts (``check_process``: ``liverl serve``, ``route``, ``ingest``, ``learn``, ``gate``).

Refused, each with a message naming both sides and a next step that works from where the operator stands:
- a state dir whose registry holds another model's base (``liverl up --model OTHER`` after the demo): pass
  ``--fresh`` (start over in that state dir) or ``--state-dir NEW``; before this check the learner died on a torch
  size mismatch while loading the old checkpoint into the new model;
- a prefix claimed by another deployment: use another ``topics.prefix``; run with that deployment's state dir when it
  is on this machine and still holds it; when that deployment is gone (its state dir deleted, or this very path now
  holding a new deployment), release the prefix with ``liverl release-prefix`` (``liverl.ops.release``: it refuses
  while the deployment shows signs of life, and records who released which deployment, and why);
- keys under the prefix that no deployment claims, from a new state dir: they predate deployment ids, and nothing
  says whose they are, so they are left alone (``--fresh`` included) until ``liverl release-prefix`` removes them.

The claim names the host that made it, so ``release-prefix`` knows whether the state dir it names can be checked on
the machine it runs on. ``<prefix>:releases`` (the prefix's record of its releases) belongs to no deployment: neither
the stray-key check nor ``--fresh`` counts it (``prefix_keys``).

Torch-free (the registry is read with SQLAlchemy's core, not through ``deploy.registry.registry``).
"""

from __future__ import annotations

import json
import logging
import shlex
import socket
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
    host: str | None = None  # the machine whose state dir it is (in a claim ``up`` wrote; None: not recorded)

    def describe(self) -> str:
        where = f"state dir {self.state_dir}" + (f" on {self.host}" if self.host else "")
        return f"deployment {self.id} ({where}" + (f", model {self.model})" if self.model else ")")


def this_host() -> str:
    """The name a claim records for the machine that made it."""
    return socket.gethostname()


def held_here(d: Deployment) -> str | None:
    """The deployment id that ``d``'s state dir holds on this machine (its ``deployment.json``), or None when that
    folder or file is not here or unreadable."""
    try:
        return str(json.loads((Path(d.state_dir) / FILE).read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prefix_keys(redis, prefix: str):
    """Every key under ``prefix`` that belongs to a deployment: all of ``<prefix>:*`` except the prefix's record of
    its releases (``keys.releases``), which outlives the deployments it names."""
    log_key = keys.releases(prefix)
    for key in redis.scan_iter(match=keys.everything(prefix), count=1000):
        if (key.decode() if isinstance(key, bytes) else key) != log_key:
            yield key


def release_command(prefix: str, d: Deployment | None, state_dir: str | Path | None = None) -> str:
    """The ``liverl release-prefix`` line that releases ``prefix`` from ``d`` (None: from keys no deployment claims),
    its audit entry kept in ``state_dir``'s registry. ``--state-dir-gone`` is in it when ``d``'s state dir is not on
    this machine by its claim (another host, or none named), where the verb cannot check it: the message around it
    says the line is for a deployment that is gone. The config it needs is the one that was refused (the same Redis),
    which the line says rather than spells (a config file is not known here)."""
    parts = ["liverl", "release-prefix", "--prefix", prefix]
    if d is not None:
        parts += ["--deployment", d.id]
    if state_dir is not None:
        parts += ["--state-dir", str(state_dir)]
    if d is not None and d.host != this_host():
        parts += ["--state-dir-gone"]
    return shlex.join(parts) + ' --reason "..." (with the --config and LIVERL__* settings this ran with)'


def own_prefix(prefix: str, me: Deployment) -> str:
    """A prefix no other deployment has: ``prefix`` followed by the start of this deployment's id."""
    return f"{prefix}{me.id[:6]}"


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
    where = f"the registry {redact_url(cfg.registry_url)} belongs to {owner.describe()}, not to this {me.describe()}"
    in_state_dir = not cfg.registry.url  # SQLite in the state dir: --fresh deletes it
    if Path(owner.state_dir) == cfg.state_path:  # this state dir's deployment.json was removed or replaced
        return DeploymentError(
            f"{where}: {cfg.state_path / FILE} no longer names the deployment that made this state dir. Restore it "
            f"(echo '{json.dumps({'id': owner.id})}' > {shlex.quote(str(cfg.state_path / FILE))}) to resume that "
            "deployment, "
            + (
                "or pass --fresh to start this one over (its registry, versions and checkpoints are deleted)"
                if in_state_dir
                else "or give this deployment its own registry (registry.url)"
            )
        )
    there = held_here(owner) == owner.id
    return DeploymentError(
        f"{where}. "
        + (f"Run with --state-dir {owner.state_dir} to operate that deployment, or give" if there else "Give")
        + f" this deployment its own registry (registry.url) and Redis prefix (topics.prefix, e.g. "
        f"LIVERL__TOPICS__PREFIX={own_prefix(cfg.topics.prefix, me)})"
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
        data = json.loads(raw)
        return Deployment(**{k: data[k] for k in ("id", "state_dir", "model", "host") if k in data})
    except (ValueError, TypeError, KeyError):
        raise DeploymentError(
            f"the Redis key {claim_key(prefix)} is not a deployment claim ({raw[:80]!r}). If no deployment uses "
            f"this prefix, release it: {release_command(prefix, None)}"
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
        mine = _prefix_claimed_by(redis, me.id)
        advice = (
            f"Run it with its deployment's prefix, LIVERL__TOPICS__PREFIX={mine} (topics.prefix), or point it at the "
            "registry of the deployment that claims this one (registry.url)"
            if mine
            else f"Point it at the registry of the deployment that claims this prefix (registry.url), or give its "
            f"deployment a prefix of its own (topics.prefix, e.g. LIVERL__TOPICS__PREFIX={own_prefix(prefix, me)}) "
            "for all of its processes"
        )
        raise DeploymentError(
            f"liverl {role}: its registry {redact_url(cfg.registry_url)} belongs to {me.describe()}, but the Redis "
            f"namespace {prefix!r} ({prefix}:*) is claimed by {owner.describe()}. {advice}; if that deployment is "
            f"gone, release its prefix: {release_command(prefix, owner)}"
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
        f"another's fleet. {advice}; "
        + (
            f"or run it with LIVERL__STATE_DIR={owner.state_dir} to operate that one"
            if held_here(owner) == owner.id and not cfg.registry.url
            else "or point registry.url at that deployment's registry to operate that one"
        )
        + f"; if that deployment is gone, release its prefix: {release_command(prefix, owner)}"
    )


def _prefix_claimed_by(redis, deployment_id: str) -> str | None:
    """The Redis prefix whose claim names ``deployment_id``, if any (a scan of the claims; None where this process's
    Redis user may read only its own prefix's claim, as a role's is: ``core.roles``)."""
    try:
        for key in redis.scan_iter(match=claim_key("*"), count=1000):
            name = key.decode() if isinstance(key, bytes) else key
            prefix = name.removesuffix(":deployment")
            try:
                owner = _claimant(redis, prefix)
            except DeploymentError:
                continue
            if owner is not None and owner.id == deployment_id:
                return prefix
    except NoPermissionError:
        return None
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


def claimed_elsewhere(cfg: LiverlConfig, me: Deployment, owner: Deployment) -> DeploymentError:
    """The refusal of ``topics.prefix`` claimed by ``owner``, with the ways on that work from here: another prefix;
    ``owner``'s state dir when this machine holds it; releasing the prefix when ``owner`` is gone."""
    prefix = cfg.topics.prefix
    other = f"give this deployment its own prefix (topics.prefix, e.g. LIVERL__TOPICS__PREFIX={own_prefix(prefix, me)})"
    release = release_command(prefix, owner, cfg.state_path)
    head = f"the Redis namespace {prefix!r} ({prefix}:*) belongs to {owner.describe()}, not to this {me.describe()}"
    if Path(owner.state_dir) == cfg.state_path and owner.host in (None, this_host()):
        return DeploymentError(
            f"{head}: {cfg.state_path} was deleted or replaced since that deployment claimed the prefix, and now "
            f"holds this one. If that deployment is gone, release its prefix (refused while its processes still "
            f"beat in Redis), then run this again: {release}; or {other}"
        )
    if held_here(owner) == owner.id and owner.host in (None, this_host()):
        return DeploymentError(f"{head}. Run with --state-dir {owner.state_dir} to run that deployment, or {other}")
    return DeploymentError(
        f"{head}. Either {other}, or, if that deployment is gone (its state dir"
        + (f" on {owner.host}" if owner.host else "")
        + f" deleted), release its prefix: {release}"
    )


def check_namespace(cfg: LiverlConfig, redis, me: Deployment, adopt: bool) -> None:
    """Refuse ``topics.prefix`` when another deployment claims it, or when unclaimed keys are there and this
    deployment cannot say they are its own (``adopt``: its state dir already has a registry, from before ids)."""
    prefix = cfg.topics.prefix
    owner = _claimant(redis, prefix)
    if owner is not None:
        if owner.id != me.id:
            raise claimed_elsewhere(cfg, me, owner)
        return
    if adopt:
        return
    stray = next(iter(prefix_keys(redis, prefix)), None)
    if stray is not None:
        raise DeploymentError(
            f"Redis already holds keys under the prefix {prefix!r} (e.g. {stray!r}) that no deployment claims (from a "
            f"liverl older than deployment ids); this {me.describe()} leaves them alone, --fresh included. Use "
            f"another topics.prefix (e.g. LIVERL__TOPICS__PREFIX={own_prefix(prefix, me)}), run with the state dir "
            f"that made them, or release them (removes them, audited): "
            f"{release_command(prefix, None, cfg.state_path)}"
        )


def claim(cfg: LiverlConfig, redis, me: Deployment, model_dir: Path | None = None) -> None:
    """Write this deployment's claim on ``topics.prefix`` (after ``check_namespace``)."""
    d = Deployment(id=me.id, state_dir=me.state_dir, model=str(model_dir) if model_dir else None, host=this_host())
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
