"""``liverl audit``: where every feedback event went, reconciled from the topics, the learner's ledger and the registry.

The unit is one feedback event: a distinct ``feedback_id`` (every redelivered copy of it is the same event), or one
record of the feedback topic that does not parse (it has no id of its own). Every event in the topic was
acknowledged by the broker, and each must end in exactly one place:

- ``trained``: its sample is in the learner's ledger as trained, exactly once (more is ``trained_twice``);
- ``refused_by_learner:<reason>``: its sample was refused by the learner with a counted reason (stale, ...);
- ``dead_letter:<reason>``: ingest dead-lettered it (the dead letter names the event's partition and offset);
- ``dropped:not_trainable``: it judged a generation logged as not trainable (greedy decoding, ...);
- ``forgotten``: it judged a sealed generation whose user's data key was destroyed before the join (``core.shred``):
  counted, no sample (ingest's dead letter ``forgotten``, which carries none of its value). A sample of a user
  forgotten after the join is ``refused_by_learner:forgotten``;
- still moving, not yet a verdict: ``queued_for_learner`` (its sample is past the learner's committed offset),
  ``in_flight`` (ingest has not committed its offset), ``waiting_for_generation`` (its generation record has not
  arrived and the pending TTL has not run out);
- ``lost``: none of the above. ``lost`` and ``trained_twice`` must be 0.

It also checks that the live acceptance counters count each judged generation once, that the registry has exactly
one stable version, and that every serving node's heartbeat reports that version with its checksum.
The learner's ledger lives beside its checkpoint (``<state_dir>/learner``): run the audit where the learner runs.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from kafka.admin import KafkaAdminClient

from core import fleet, keys
from core.bus import kafka_python_security, make_reader
from core.config import BrokerConfig, LiverlConfig
from core.schemas import DeadLetter, FeedbackEvent, GenerationRecord, TrainingSample, WireError
from learner.ledger import Ledger, checkpoint_path_for, ledger_path

VERDICT_OK = "ok"
MOVING = ("queued_for_learner", "in_flight", "waiting_for_generation")
JOINED = (
    "trained",
    "held_out",
    "refused_by_learner",
    "queued_for_learner",
    "dropped:not_trainable",
    "dead_letter:sample_too_large",
    "forgotten",  # (joined and counted, no sample: ingest.sealing)
    "dead_letter:unsealable",
    "dead_letter:bad_routing",  # (a sealed generation's routing is checked when it joins)
)


@dataclass
class Report:
    feedback_records: int = 0
    events: int = 0
    fates: collections.Counter = field(default_factory=collections.Counter)
    lost_examples: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    dead_letters_repeated: int = 0
    live_events: int = 0
    joined_events: int = 0  # judged events that count for one version (the live counters' share)
    joined_unversioned: int = 0  # judged events on a generation two versions sampled: counted for none, by design
    stable_versions: list[int] = field(default_factory=list)
    stable_checksum: str | None = None
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    ledger_lines: int = 0

    @property
    def lost(self) -> int:
        return self.fates["lost"]

    @property
    def moving(self) -> int:
        return sum(self.fates[k] for k in MOVING)

    @property
    def converged(self) -> bool:
        return bool(self.nodes) and all(n["converged"] for n in self.nodes.values())

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{self.lost} feedback event(s) lost, e.g. {', '.join(self.lost_examples[:3])}")
        if self.trained_twice:
            out.append(f"{len(self.trained_twice)} sample(s) trained twice, e.g. {', '.join(self.trained_twice[:3])}")
        if not self.moving and self.live_events != self.joined_events:
            out.append(f"live counters hold {self.live_events} events for {self.joined_events} judged generations")
        if self.fates["dead_letter:internal_error"]:  # a bug: ingest could not decide them (its log says why)
            out.append(f"{self.fates['dead_letter:internal_error']} feedback event(s) dead-lettered internal_error")
        if len(self.stable_versions) != 1:
            out.append(f"the registry has {len(self.stable_versions)} stable versions {self.stable_versions}")
        for node, n in sorted(self.nodes.items()):
            if not n["converged"]:
                out.append(
                    f"node {node} serves v{n['version']} ({n['checksum']}), not "
                    + (f"the canary v{n['canary']}" if "canary" in n else "the stable version")
                )
        if not self.nodes:
            out.append("no serving node reports a heartbeat")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "feedback_records": self.feedback_records,
            "events": self.events,
            "fates": dict(self.fates),
            "lost": self.lost,
            "trained_twice": len(self.trained_twice),
            "moving": self.moving,
            "dead_letters_repeated": self.dead_letters_repeated,
            "live_events": self.live_events,
            "joined_events": self.joined_events,
            "joined_unversioned": self.joined_unversioned,
            "stable_versions": self.stable_versions,
            "stable_checksum": self.stable_checksum,
            "nodes": self.nodes,
            "converged": self.converged,
            "ledger_lines": self.ledger_lines,
            "problems": self.problems(),
            "ok": not self.problems(),
        }


def read_topic(bootstrap: str, topic: str, broker: BrokerConfig | None = None, *, timestamps: bool = False):
    """Every record of ``topic`` up to its high watermark: (partition, offset, value), and with ``timestamps`` the
    record's timestamp in seconds (when its producer sent it) after the value.

    The end is the high watermark of the fetch responses, not ListOffsets: the embedded Tansu broker's ListOffsets
    answers the start of the last batch (see ``ingest.app._log_end_offsets``).
    """
    c = make_reader(bootstrap, broker, fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        if not tps:
            return
        c.assign(tps)
        c.seek_to_beginning(*tps)
        todo, last_data = set(tps), time.monotonic()
        while todo:
            got = c.poll(timeout_ms=300, max_records=5000)
            for records in got.values():
                for r in records:
                    yield (
                        (r.partition, r.offset, r.value, r.timestamp / 1000)
                        if timestamps
                        else (
                            r.partition,
                            r.offset,
                            r.value,
                        )
                    )
            if got:
                last_data = time.monotonic()
            todo = {tp for tp in todo if c.highwater(tp) is None or c.position(tp) < c.highwater(tp)}
            if todo and time.monotonic() - last_data > 30:
                raise TimeoutError(f"reading {topic}: no records for 30 s with {len(todo)} partition(s) unread")
    finally:
        c.close()


def committed(bootstrap: str, group: str, topic: str, broker: BrokerConfig | None = None) -> dict[int, int]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="liverl-audit", **kafka_python_security(broker))
    try:
        got = admin.list_group_offsets({group: None}).get(group, {})
    except Exception:  # noqa: BLE001 - a group that never committed reads as nothing committed
        got = {}
    finally:
        admin.close()
    return {tp.partition: om.offset for tp, om in got.items() if tp.topic == topic and om.offset >= 0}


def run_audit(cfg: LiverlConfig, bootstrap: str, redis, registry, now: float | None = None) -> Report:
    t, rep = cfg.topics, Report()
    now = time.time() if now is None else now
    # the committed offsets first: ingest writes a sample before it commits its feedback, the learner its ledger before
    # it commits its samples, so whatever is committed by now is in what is read next, even while they run
    ingest_done = committed(bootstrap, f"{t.prefix}-ingest", t.feedback, cfg.broker)
    learner_done = committed(bootstrap, f"{t.prefix}.learner", t.samples, cfg.broker)
    # ingest's verdicts
    dead = _dead_letters(cfg, bootstrap, rep)
    generations, unversioned = _generations(cfg, bootstrap)
    samples = _samples(cfg, bootstrap)
    held_out = _held_out(cfg, bootstrap)
    # the learner's verdicts
    trained, refused = _ledger(cfg, rep)
    rep.trained_twice = sorted(sid for sid, n in trained.items() if n > 1)
    pending_window = cfg.ingest.pending_ttl_s * 10 + 60  # ingest's hard limit on waiting feedback, plus slack

    arrived: dict[tuple[int, int], float] = {}
    events = _feedback_events(cfg, bootstrap, rep, dead, ingest_done, arrived)
    for fid, recs in events.items():
        rep.events += 1
        fate = (
            "held_out"
            if fid in held_out and fid not in samples
            else _fate(
                recs,
                samples.get(fid, []),
                trained,
                refused,
                learner_done,
                dead,
                generations,
                ingest_done,
                now,
                pending_window,
                arrived,
            )
        )
        if fate == "dead_letter:forgotten":
            fate = "forgotten"
        rep.fates[fate] += 1
        if fate == "lost":
            rep.lost_examples.append(fid)
        if fate.startswith(JOINED):
            if recs[0][2].generation_id in unversioned:  # ingest counts it for no version (ingest/__init__.py)
                rep.joined_unversioned += 1
            else:
                rep.joined_events += 1
    # live counters, registry, fleet
    for key in redis.scan_iter(keys.live_pattern(t.prefix), count=1000):
        if keys.version_of_live(key) is not None:
            rep.live_events += int(redis.hget(key, "events") or 0)
    _fleet(redis, registry, t.prefix, rep, now)
    return rep


def _dead_letters(cfg: LiverlConfig, bootstrap: str, rep: Report) -> dict[tuple[int, int], str]:
    """The feedback records ingest dead-lettered: (partition, offset) -> reason; counts those dead-lettered twice."""
    t = cfg.topics
    dead: dict[tuple[int, int], str] = {}
    for _, _, raw in read_topic(bootstrap, t.dead_letters, cfg.broker):
        try:
            d = DeadLetter.from_bytes(raw or b"")
        except WireError:
            continue
        if d.source_topic == t.feedback and d.partition is not None and d.offset is not None:
            if (d.partition, d.offset) in dead:
                rep.dead_letters_repeated += 1
            dead[(d.partition, d.offset)] = d.reason
    return dead


def _generations(cfg: LiverlConfig, bootstrap: str) -> tuple[dict[str, bool], set[str]]:
    """Every generation: id -> trainable; and the ids of those a hot-swap split between versions."""
    generations: dict[str, bool] = {}
    unversioned: set[str] = set()  # generations a hot-swap split between versions (``mixed_versions``)
    for _, _, raw in read_topic(bootstrap, cfg.topics.generations, cfg.broker):
        try:
            g = GenerationRecord.from_bytes(raw or b"")
        except WireError:
            continue
        generations[g.generation_id] = g.trainable
        if g.mixed_versions:
            unversioned.add(g.generation_id)
    return generations, unversioned


def _samples(cfg: LiverlConfig, bootstrap: str) -> dict[str, list[tuple[int, int, str]]]:
    """The training samples ingest wrote: feedback id -> (partition, offset, sample id) of each."""
    samples: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)  # feedback id -> records
    for part, off, raw in read_topic(bootstrap, cfg.topics.samples, cfg.broker):
        try:
            s = TrainingSample.from_bytes(raw or b"")
        except WireError:
            continue
        samples[s.feedback_id].append((part, off, s.sample_id))
    return samples


def _held_out(cfg: LiverlConfig, bootstrap: str) -> set[str]:
    held_out = set()  # feedback ids whose sample went to the gate's held-out stream (never trained, by design)
    for _, _, raw in read_topic(bootstrap, cfg.topics.heldout, cfg.broker):
        try:
            held_out.add(TrainingSample.from_bytes(raw or b"").feedback_id)
        except WireError:
            continue
    return held_out


def _ledger(cfg: LiverlConfig, rep: Report) -> tuple[collections.Counter, dict[tuple[int, int], str]]:
    """The learner's ledger: how often each sample id was trained, and the refused samples' (partition, offset) ->
    reason."""
    trained: collections.Counter = collections.Counter()
    refused: dict[tuple[int, int], str] = {}
    for line in Ledger.read(ledger_path(checkpoint_path_for(cfg))):
        rep.ledger_lines += 1
        for _, _, sid in line.get("trained", []):
            trained[sid] += 1
        for part, off, _, reason in line.get("refused", []):
            refused[(part, off)] = reason
    return trained, refused


def _feedback_events(
    cfg: LiverlConfig,
    bootstrap: str,
    rep: Report,
    dead: dict[tuple[int, int], str],
    ingest_done: dict[int, int],
    arrived: dict[tuple[int, int], float],
) -> dict[str, list[tuple[int, int, FeedbackEvent]]]:
    """The feedback topic's events by feedback id; a record that does not parse gets its fate here. ``arrived``
    collects each record's timestamp (when its producer sent it), by (partition, offset)."""
    t = cfg.topics
    events: dict[str, list[tuple[int, int, FeedbackEvent]]] = collections.defaultdict(list)
    for part, off, raw, sent in read_topic(bootstrap, t.feedback, cfg.broker, timestamps=True):
        rep.feedback_records += 1
        arrived[(part, off)] = sent
        try:
            fb = FeedbackEvent.from_bytes(raw or b"")
        except WireError:
            rep.events += 1
            if (part, off) in dead:
                rep.fates[f"dead_letter:{dead[(part, off)]}"] += 1
            elif off >= ingest_done.get(part, 0):
                rep.fates["in_flight"] += 1
            else:
                rep.fates["lost"] += 1
                rep.lost_examples.append(f"{t.feedback}[{part}]@{off}")
            continue
        events[fb.feedback_id].append((part, off, fb))
    return events


def _fleet(redis, registry, prefix: str, rep: Report, now: float) -> None:
    """The registry's stable versions and what each serving node serves (converged: the version it should)."""
    rep.stable_versions = sorted(int(v.version) for v in registry.list(status="stable"))
    if len(rep.stable_versions) == 1:
        rep.stable_checksum = registry.get(rep.stable_versions[0]).checksum
        view = fleet.fleet_view(registry, redis, prefix)  # during a canary its nodes should serve the canary
        for name, n in view.nodes.items():
            rep.nodes[name] = {
                "version": n.beat.version,
                "checksum": n.beat.checksum,
                "healthy": n.beat.healthy,
                "age_s": round(max(now - n.beat.ts, 0.0), 1),
                "converged": n.converged,
                **({"canary": view.rollout.version} if n.canary else {}),
            }
    else:  # no single stable version: no node can be in sync with it
        for name, beat in fleet.read_heartbeats(redis, prefix).items():
            rep.nodes[name] = {
                "version": beat.version,
                "checksum": beat.checksum,
                "healthy": beat.healthy,
                "age_s": round(max(now - beat.ts, 0.0), 1),
                "converged": False,
            }


def _fate(
    recs, sample_recs, trained, refused, learner_done, dead, generations, ingest_done, now, pending_window, arrived=None
) -> str:
    if sample_recs:
        sid = sample_recs[0][2]
        if trained[sid]:
            return "trained"
        reasons = [refused[(p, o)] for p, o, _ in sample_recs if (p, o) in refused]
        if any(o >= learner_done.get(p, 0) and (p, o) not in refused for p, o, _ in sample_recs):
            return "queued_for_learner"
        if reasons:
            return f"refused_by_learner:{next((r for r in reasons if r != 'duplicate'), reasons[0])}"
        return "lost"
    for part, off, _ in recs:
        if (part, off) in dead:
            return f"dead_letter:{dead[(part, off)]}"
    # a follow-up whose accept did not train (held out), or with ingest.train_reverts off: counted, no correction
    if recs[0][2].kind == "revert":
        return "in_flight" if any(off >= ingest_done.get(part, 0) for part, off, _ in recs) else "counted:revert"
    gid = recs[0][2].generation_id
    if generations.get(gid) is False:
        return "dropped:not_trainable"
    if any(off >= ingest_done.get(part, 0) for part, off, _ in recs):
        return "in_flight"
    # ingest counts a feedback's wait from when it read it, so the window runs from when its first record was sent: a
    # product that sends again what the broker did not take keeps the event's own (older) ts
    sent = [arrived[(part, off)] for part, off, _ in recs if arrived and (part, off) in arrived]
    since = min(sent) if sent else min(fb.ts for _, _, fb in recs)
    if gid not in generations and now - since < pending_window:
        return "waiting_for_generation"
    return "lost"


def print_report(rep: Report) -> None:
    rows = [("feedback records in the topic", rep.feedback_records), ("feedback events (distinct)", rep.events)]
    rows += [(f"  {fate}", n) for fate, n in sorted(rep.fates.items(), key=lambda kv: (-kv[1], kv[0]))]
    rows += [
        ("lost", rep.lost),
        ("trained twice", len(rep.trained_twice)),
        ("still moving (queued, in flight, waiting)", rep.moving),
        ("live counter events / judged generations", f"{rep.live_events} / {rep.joined_events}"),
        ("  judged on a swap-split generation (no version)", rep.joined_unversioned),
        ("stable versions in the registry", ", ".join(f"v{v}" for v in rep.stable_versions) or "none"),
    ]
    for node, n in sorted(rep.nodes.items()):
        rows.append(
            (
                f"node {node}",
                f"v{n['version']} {'converged' if n['converged'] else 'NOT converged'} (heartbeat {n['age_s']} s ago)",
            )
        )
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    problems = rep.problems()
    print("verdict: " + ("OK: nothing lost, nothing trained twice" if not problems else "; ".join(problems)))
