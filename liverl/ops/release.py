"""``liverl release-prefix``: hand back a Redis prefix whose deployment is gone, audited.

A deployment claims its prefix (``<p>:deployment``, ``liverl.stack.deployment``) for as long as the prefix exists, so
when its state dir is deleted the claim outlives it, and every later ``liverl up`` on that prefix is refused. This verb
ends such a claim, and only such a claim:

- It refuses while the claimant shows a sign of life: a serving node's heartbeat (``<p>:served:<node>``, gone some
  seconds after its agent stops), the learner's lease (``<p>:learner:lease``, likewise), the learner's state published
  or ingest's live counters written in the last ``RECENT_S`` seconds; its state dir still on this machine, holding it;
  or the configured registry still recording it (its versions and audit log exist). Ingest and the gate keep no
  heartbeat of their own: stop them before releasing.
- A claim made on another machine (the claim names its host) cannot have its state dir checked here: the verb
  refuses unless ``--state-dir-gone`` says that folder is gone there too (and the record says it was asserted).
- ``--deployment ID`` releases only the claim of that deployment (the one the refusal of ``up`` named), so a prefix
  claimed anew meanwhile is not released by mistake; the claim is removed by compare-and-delete either way.

Releasing removes the claim and every key under the prefix (the gone deployment's announcements, live counters,
rollout plan and audit head describe a registry that no longer exists: a new deployment must not read them), and
appends a record to ``<p>:releases``: who (an admin's name from the token, when the configured registry has
operators; else ``--as`` or the OS user, marked unauthenticated, with host and OS user), why, which deployment, what
was found, how many keys went. That list belongs to the prefix, not to a deployment: later releases and ``--fresh``
keep it. The same facts go into the audit log (``liverl history``) of the configured registry when it exists, and
otherwise into the registry of the next deployment that takes the prefix, when ``liverl up`` records it there
(``log_release``): an auditor finds the release where they read that deployment's history.

Why a verb and not ``liverl up --fresh --release-prefix``: releasing destroys another deployment's state, so it is
an operator's decision with a name and a reason, made once and recorded, not a flag that a restart script repeats
on every start; and it serves a standalone ``liverl serve | ingest | learn | gate`` refused the same way.
"""

from __future__ import annotations

import getpass
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sqlalchemy as sa

from core import fleet, keys
from core.config import LiverlConfig, redact_url
from liverl.stack.deployment import (
    FILE,
    Deployment,
    DeploymentError,
    claim_key,
    held_here,
    prefix_keys,
    registry_deployment,
    this_host,
)
from liverl.stack.releases import ACTION, audit_reason

RECENT_S = 60.0
"""The learner's published state or ingest's live counters written this recently count as a sign of life."""

# delete the claim only if it is still the one that was checked ('' for no claim)
_TAKE_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur == false then cur = '' end
if cur ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass
class Findings:
    """What ``inspect`` found about the claimant of a prefix: each ``alive`` line refuses the release, an
    ``unchecked`` line refuses it unless the operator asserts the state dir is gone, ``gone`` lines are evidence."""

    owner: Deployment | None
    claim: str  # the claim's raw value ('' for none)
    alive: list[str] = field(default_factory=list)
    alive_in: set[str] = field(default_factory=set)  # where life was found: "redis", "state dir", "registry"
    unchecked: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    keys: int = 0  # keys under the prefix, the claim's included (the release record's not)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_claim(redis, prefix: str) -> tuple[Deployment | None, str]:
    """The claimant (None without a claim, or for a value that is no claim) and the claim's raw value."""
    raw = redis.get(claim_key(prefix))
    if raw is None:
        return None, ""
    raw = _text(raw)
    try:
        data = json.loads(raw)
        return Deployment(**{k: data[k] for k in ("id", "state_dir", "model", "host") if k in data}), raw
    except (ValueError, TypeError, KeyError):
        return None, raw


def signs_of_life(redis, prefix: str, now: float | None = None) -> list[str]:
    """What in Redis says processes of the deployment on ``prefix`` still run."""
    now = time.time() if now is None else now
    out = []
    for name, beat in sorted(fleet.read_heartbeats(redis, prefix).items()):
        out.append(
            f"serving node {name} beats ({keys.served(prefix, name)}: v{beat.version}, {now - beat.ts:.0f} s ago; "
            "the key expires soon after its agent stops)"
        )
    holder = redis.get(keys.learner_lease(prefix))
    if holder is not None:
        ttl_ms = redis.pttl(keys.learner_lease(prefix))
        out.append(
            f"a learner holds the lease {keys.learner_lease(prefix)} ({_text(holder)}; it lapses "
            f"{max(ttl_ms, 0) / 1000:.0f} s after that learner stops)"
        )
    ts_raw, state = redis.hmget(keys.learner(prefix), ["ts", "state"])
    try:
        ts = float(_text(ts_raw or "nan"))
    except ValueError:
        ts = float("nan")
    if now - ts < RECENT_S and _text(state or "") != "stopped":  # (nan compares False); "stopped": it said goodbye
        out.append(f"the learner published its state {now - ts:.0f} s ago ({keys.learner(prefix)})")
    newest = max(
        (
            int(k.rsplit(":", 1)[1])
            for k in map(_text, redis.scan_iter(match=keys.units_pattern(prefix), count=1000))
            if k.rsplit(":", 1)[1].isdigit()
        ),
        default=None,
    )
    if newest is not None and now - newest * keys.UNIT_BUCKET_S < RECENT_S + keys.UNIT_BUCKET_S:
        out.append(f"ingest counted judgements made {max(now - newest * keys.UNIT_BUCKET_S, 0):.0f} s ago")
    return out


def _state_dir(owner: Deployment, f: Findings) -> None:
    """Whether the claimant's state dir is still on this machine, holding it."""
    here = this_host()
    if owner.host not in (None, here):
        f.unchecked.append(
            f"its state dir {owner.state_dir} is on {owner.host}, not on this machine ({here}), so it was not checked"
        )
        return
    held = held_here(owner)
    if held == owner.id:
        f.alive.append(f"its state dir {owner.state_dir} is on this machine and still holds it ({FILE} names it)")
        f.alive_in.add("state dir")
        return
    path = Path(owner.state_dir)
    found = (
        f"{path} now holds deployment {held}"
        if held
        else (f"{path} holds no deployment" if path.exists() else f"{path} does not exist on this machine")
    )
    if owner.host is None:  # a claim that does not say where it was made: the folder here may be another one
        f.unchecked.append(f"{found}, but the claim does not name the machine that made it")
    else:
        f.gone.append(found)


def inspect(cfg: LiverlConfig, redis, prefix: str) -> Findings:
    """Everything the release decides on: the claim, the signs of life, the claimant's state dir and registry."""
    owner, raw = read_claim(redis, prefix)
    f = Findings(owner=owner, claim=raw)
    f.keys = sum(1 for _ in prefix_keys(redis, prefix))
    f.alive += signs_of_life(redis, prefix)
    if f.alive:
        f.alive_in.add("redis")
    if owner is None:
        f.gone.append("no deployment claims the prefix" + (f" (the claim key holds {raw[:80]!r})" if raw else ""))
        return f
    _state_dir(owner, f)
    recorded = registry_deployment(cfg)
    if recorded is not None and recorded.id == owner.id:
        f.alive.append(
            f"the registry {redact_url(cfg.registry_url)} still records it (its versions and audit log are there)"
        )
        f.alive_in.add("registry")
    return f


def refusal(prefix: str, f: Findings, deployment: str | None, state_dir_gone: bool) -> str | None:
    """Why the release is refused, with what to do; None when it may go ahead."""
    who = f.owner.describe() if f.owner else "the keys under it"
    if deployment is not None and (f.owner is None or f.owner.id != deployment):
        now = f"it is claimed by {f.owner.describe()}" if f.owner else "no deployment claims it now"
        return (
            f"--deployment {deployment}: the prefix {prefix!r} is not that deployment's ({now}). Check with the "
            "refusal that named it, and run this again with the id that claims the prefix"
        )
    if f.alive:
        o = f.owner
        steps = []
        if "state dir" in f.alive_in and o is not None:
            steps.append(
                f"to start it over in its state dir (same id, so the prefix stays its own): liverl up --fresh "
                f"--state-dir {o.state_dir}; to retire it, delete {o.state_dir} first"
            )
        if "registry" in f.alive_in:
            steps.append("to retire it, drop that registry's database (or point registry.url at another) first")
        if "redis" in f.alive_in:
            steps.append(
                "stop its processes (Ctrl-C its `liverl up`), then run this again once their keys have expired"
            )
        return f"{who} on {prefix!r} is not gone: " + "; ".join(f.alive) + ". Nothing was released. " + "; ".join(steps)
    if f.unchecked and not state_dir_gone:
        return (
            f"{who} on {prefix!r} shows no sign of life in Redis, but " + "; ".join(f.unchecked) + ". Run this on "
            "the machine that holds its state dir, or, if that folder is gone there too, add --state-dir-gone "
            "(recorded with the release)"
        )
    return None


def release(
    cfg: LiverlConfig,
    redis,
    prefix: str,
    f: Findings,
    actor: str,
    authenticated: bool,
    reason: str,
) -> dict:
    """Remove the claim (if it is still the one ``f`` found) and every key of the prefix, then append the record to
    ``<p>:releases``. Returns the record. DeploymentError when the claim changed since ``inspect``. Call after
    ``refusal`` said None: an ``unchecked`` finding is then one the operator asserted (``--state-dir-gone``)."""
    if not redis.eval(_TAKE_CLAIM, 1, claim_key(prefix), f.claim):
        raise DeploymentError(
            f"the claim on {prefix!r} changed since it was checked (a deployment claimed it meanwhile); nothing was "
            "released. Run this again to see who holds it now"
        )
    removed = 1 if f.claim else 0
    batch = []
    for key in prefix_keys(redis, prefix):
        batch.append(key)
        if len(batch) >= 500:
            removed += _delete(redis, batch)
            batch = []
    removed += _delete(redis, batch)
    rec = {
        "id": uuid.uuid4().hex[:12],
        "at": time.time(),
        "prefix": prefix,
        "by": actor,
        "authenticated": authenticated,
        "os_user": getpass.getuser(),
        "host": this_host(),
        "reason": reason,
        "released": asdict(f.owner) if f.owner else None,
        "claim": None if f.owner or not f.claim else f.claim[:200],
        "found": f.gone + f.unchecked + (["--state-dir-gone: the operator says it is gone"] if f.unchecked else []),
        "keys_removed": removed,
        "registry": redact_url(cfg.registry_url),
        "for": held_here(Deployment(id="", state_dir=str(cfg.state_path))),  # who takes the prefix, when known
    }
    redis.rpush(keys.releases(prefix), json.dumps(rec))
    redis.ltrim(keys.releases(prefix), -keys.LIST_CAP, -1)
    return rec


def _delete(redis, batch: list) -> int:
    if not batch:
        return 0
    pipe = redis.pipeline(transaction=False)  # the keys sit in different Cluster slots
    for key in batch:
        pipe.delete(key)
    return sum(int(n) for n in pipe.execute())


def registry_exists(cfg: LiverlConfig) -> bool:
    """Whether ``registry.url`` names a registry that exists (made by ``liverl up`` or a migration), without making
    one: a SQLite file that is not there is no registry."""
    url = cfg.registry_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return False
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            return sa.inspect(c).has_table("audit_log")
    finally:
        engine.dispose()


def releases(redis, prefix: str) -> list[dict]:
    """The prefix's release records, oldest first."""
    return [json.loads(_text(x)) for x in redis.lrange(keys.releases(prefix), 0, -1)]


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _actor(cfg: LiverlConfig, as_name: str | None, token: str | None) -> tuple[str, bool]:
    """Who releases: the admin the token names when the configured registry has operators (``--as`` must then agree),
    else ``as_name`` or the OS user, unauthenticated (there is no one to check a token against, as for the first
    ``liverl operator add``)."""
    if not registry_exists(cfg):
        return as_name or getpass.getuser(), False
    from deploy.registry.registry import open_registry  # noqa: PLC0415 torch: only with a registry to ask

    reg = open_registry(cfg)
    try:
        if not reg.operators():
            return as_name or getpass.getuser(), False
        name = reg.authenticate(token, need="admin").name
    finally:
        reg.close()
    if as_name and as_name != name:
        raise DeploymentError(f"--as {as_name}: the operator token is {name}'s; the token says who releases")
    return name, True


def cmd_release_prefix(
    cfg: LiverlConfig,
    prefix: str,
    reason: str,
    deployment: str | None = None,
    as_name: str | None = None,
    token: str | None = None,
    state_dir_gone: bool = False,
    dry_run: bool = False,
) -> int:
    """``liverl release-prefix``: check, then release ``prefix`` and record it (module docstring). Exit code 0 when
    released (or, with ``dry_run``, when it would be), 1 when refused."""
    import redis as redis_lib  # noqa: PLC0415 redis: the CLI builds its parser without it

    from core.services import setup_redis  # noqa: PLC0415 (as above)
    from deploy.registry.regdb import RegistryError  # noqa: PLC0415 (as above; torch-free)

    if not reason.strip():
        raise ValueError("--reason must say why (it is recorded with the release)")
    if as_name is not None and not 0 < len(as_name) <= 64:
        raise ValueError("--as NAME: 1 to 64 characters (the audit log's actor)")
    cfg = cfg.model_copy(deep=True)
    cfg.topics.prefix = prefix  # the audit head of the registry's log is anchored under this prefix
    try:
        actor, authenticated = _actor(cfg, as_name, token)
    except RegistryError as e:
        return _err(f"{e}; nothing was released")
    r = setup_redis(cfg)
    try:
        try:
            r.ping()
        except redis_lib.RedisError as e:
            return _err(f"Redis unreachable ({e}); nothing was released")
        f = inspect(cfg, r, prefix)
        who = f.owner.describe() if f.owner else "no deployment claims it"
        print(f"prefix {prefix!r}: {who}; {f.keys} keys")
        for line in f.alive:
            print(f"  alive:     {line}")
        for line in f.unchecked:
            print(f"  unchecked: {line}")
        for line in f.gone:
            print(f"  gone:      {line}")
        if f.owner is None and not f.claim and f.keys == 0:
            print(f"nothing to release: no claim and no keys under {prefix!r}")
            return 0
        why = refusal(prefix, f, deployment, state_dir_gone)
        if why:
            return _err(why)
        if dry_run:
            print(f"dry run: would release {prefix!r} and remove its {f.keys} keys, as {actor}; nothing was changed")
            return 0
        rec = release(cfg, r, prefix, f, actor, authenticated, reason.strip())
    finally:
        r.close()
    where = f"the prefix's record {keys.releases(prefix)}"
    if registry_exists(cfg):
        from deploy.registry.registry import open_registry  # noqa: PLC0415 torch: only when the verb runs

        reg = open_registry(cfg)
        try:
            reg.log_action(actor, ACTION, audit_reason(rec))
            where += f" and the audit log of {redact_url(cfg.registry_url)} (liverl history)"
        except RegistryError as e:  # released already: the record in Redis stands, and `up` copies it
            print(
                f"warning: the release is not in the audit log of {redact_url(cfg.registry_url)}: {e}", file=sys.stderr
            )
            where += "; the next `liverl up` on this prefix writes it into its registry's audit log"
        finally:
            reg.close()
    else:
        where += (
            f"; {redact_url(cfg.registry_url)} does not exist yet, so the next `liverl up` on this prefix writes "
            "the release into its audit log (liverl history)"
        )
    print(
        f"released {prefix!r}"
        + (f" from deployment {f.owner.id}" if f.owner else "")
        + f": {rec['keys_removed']} keys removed, by {actor}"
        + ("" if authenticated else " (unauthenticated)")
        + f", release {rec['id']}. Recorded in {where}. `liverl up` may now claim it"
    )
    return 0
