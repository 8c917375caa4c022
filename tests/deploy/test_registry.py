"""The registry on SQLite and PostgreSQL: lineage, snapshots + deltas, promote / rollback, audit, blobs."""

from __future__ import annotations

import os
import threading
import time

import pytest
import sqlalchemy as sa
import torch

from deploy.registry.blobstore import BlobError, LocalBlobStore, S3BlobStore
from deploy.registry.delta import apply_delta, checksum, read_header
from deploy.registry.registry import Registry, RegistryError, Version
from tests.deploy.conftest import perturb, tiny_model


def chain(registry: Registry, n: int) -> dict[int, dict]:
    """Base + n candidates, each the child of the previous one; returns weights by version."""
    state = tiny_model()
    registry.init_base(state, "/models/base")
    weights = {0: state}
    parent = 0
    for i in range(n):
        state = perturb(state, 0.05, seed=i + 1)
        row = registry.add_candidate(
            state,
            parent=parent,
            metrics={"loss": 1.0 / (i + 1)},
            sample_offsets={"samples:0": 100 * i},
            learner_step=10 * i,
        )
        weights[row.version] = state
        parent = row.version
    return weights


def test_base_candidates_and_materialize_across_snapshot_boundary(registry):
    weights = chain(registry, 7)  # snapshot_every=3: snapshots at versions 0, 3, 6
    assert sorted(weights) == list(range(8))
    rows = {r.version: r for r in registry.list()}
    assert [v for v, r in sorted(rows.items()) if r.snapshot_key] == [0, 3, 6]
    assert rows[0].status == "stable" and rows[0].blob_kind == "snapshot" and rows[0].model_dir == "/models/base"
    r5 = rows[5]
    assert (r5.parent, r5.status, r5.blob_kind, r5.snapshot_base, r5.chain_depth) == (4, "candidate", "delta", 3, 2)
    assert r5.metrics == {"loss": 1.0 / 5} and r5.sample_offsets == {"samples:0": 400} and r5.learner_step == 40
    assert 0.02 < r5.changed_fraction < 0.1 and r5.ratio > 3 and r5.delta_bytes < r5.raw_bytes
    for v, w in weights.items():
        assert registry.materialize(v).keys() == w.keys()
        assert checksum(registry.materialize(v)) == checksum(w) == rows[v].checksum
    # every non-base version has a delta from its parent, usable in both directions
    new, now = apply_delta(weights[4], registry.delta_for(5))
    assert now == 5 and checksum(new) == rows[5].checksum
    back, now = apply_delta(weights[5], registry.delta_for(5))
    assert now == 4 and checksum(back) == rows[4].checksum
    with pytest.raises(RegistryError, match="base snapshot"):
        registry.delta_for(0)
    assert [r.version for r in registry.candidates()] == list(range(1, 8))


def test_deltas_between_walks_up_then_down(registry):
    weights = chain(registry, 3)
    branch = registry.add_candidate(perturb(weights[1], 0.05, seed=42), parent=1)  # 1 -> 4
    weights[branch.version] = perturb(weights[1], 0.05, seed=42)
    state = weights[3]
    for blob in registry.deltas_between(3, branch.version):  # 3 -> 2 -> 1 -> 4
        state, now = apply_delta(state, blob)
    assert now == branch.version and checksum(state) == branch.checksum
    assert registry.deltas_between(2, 2) == []


def test_promote_rollback_and_audit(registry):
    chain(registry, 3)
    registry.set_status(1, "rejected", actor="gate", reason="failed heldout")
    with pytest.raises(RegistryError, match="was rejected \\(failed heldout\\); pass --force"):
        registry.promote(1, actor="ops")
    registry.promote(2, actor="gate", reason="passed")
    registry.promote(3, actor="alice", reason="looks good")
    assert registry.stable().version == 3
    assert {r.version: r.status for r in registry.list()} == {0: "retired", 1: "rejected", 2: "retired", 3: "stable"}
    with pytest.raises(RegistryError, match="already stable"):
        registry.promote(3, actor="alice")

    back = registry.rollback(actor="bob", reason="live acceptance dropped")
    assert back.version == 2 and registry.stable().version == 2 and registry.get(3).status == "rolled_back"
    back = registry.rollback(actor="bob", reason="further", to=0)
    assert back.version == 0 and registry.get(2).status == "rolled_back"
    with pytest.raises(RegistryError, match="never stable; use promote"):
        registry.rollback(actor="bob", to=1)
    with pytest.raises(RegistryError, match="unknown version 99"):
        registry.promote(99, actor="bob")
    registry.promote(1, actor="carol", reason="override", force=True)
    assert registry.stable().version == 1

    audit = [(a.actor, a.action, a.version) for a in registry.audit()]
    assert audit[:4] == [
        ("system", "init", 0),
        ("learner", "candidate", 1),
        ("learner", "candidate", 2),
        ("learner", "candidate", 3),
    ]
    assert audit[4:] == [
        ("gate", "rejected", 1),
        ("gate", "promote", 2),
        ("alice", "promote", 3),
        ("bob", "rollback", 2),
        ("bob", "rollback", 0),
        ("carol", "promote", 1),
    ]
    assert "live acceptance dropped (from 3)" == registry.audit(version=2)[-1].reason


def test_gate_results_and_fleet(registry):
    chain(registry, 1)
    registry.record_gate(1, "heldout", 0.61, 0.58, True, "ok")
    registry.record_gate(1, "collapse", 0.01, 0.05, False, "collapsed")
    assert [(g.check, g.passed) for g in registry.gate_results(1)] == [("heldout", True), ("collapse", False)]
    with pytest.raises(RegistryError, match="unknown version"):
        registry.record_gate(7, "heldout", 0.1, 0.2, False)
    registry.update_fleet("node-0", 1, "ab" * 32)
    registry.update_fleet("node-0", 0, "cd" * 32)
    assert [(f.node, f.version) for f in registry.fleet()] == [("node-0", 0)]


def test_init_base_is_idempotent_and_refuses_another_base(registry):
    base = tiny_model()
    assert registry.init_base(base, "m").version == 0
    assert registry.init_base(base, "m").checksum == checksum(base)
    with pytest.raises(RegistryError, match="already has a different base"):
        registry.init_base(tiny_model(seed=5), "m")


def test_concurrent_writers_get_distinct_versions(registry, tmp_path):
    base = tiny_model()
    registry.init_base(base, "m")
    results, errors = [], []

    def writer(seed: int) -> None:
        reg = Registry(registry.url, LocalBlobStore(tmp_path / "blobs"), snapshot_every=3)
        try:
            for i in range(3):
                results.append(reg.add_candidate(perturb(base, 0.05, seed=100 * seed + i), parent=0).version)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
        finally:
            reg.close()

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(results) == list(range(1, 10))


def test_materialize_refuses_a_corrupted_blob(registry):
    chain(registry, 2)
    path = registry.blobs._path(registry.get(2).blob_key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BlobError, match="corrupted"):
        registry.materialize(2)
    assert checksum(registry.materialize(1)) == registry.get(1).checksum


def test_blobstore_round_trip(tmp_path):
    store = LocalBlobStore(tmp_path)
    key = store.put(b"hello")
    assert store.put(b"hello") == key and store.exists(key) and store.get(key) == b"hello"
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(BlobError, match="not found"):
        store.get(key)
    with pytest.raises(BlobError, match="invalid blob key"):
        store.get("../etc/passwd")
    assert not list(tmp_path.rglob("*.tmp"))


def test_snapshot_every_n_versions_bounds_every_rebuild(registry):
    """snapshot_every=3: a snapshot every third version along each parent chain, branches included."""
    weights = chain(registry, 10)
    branch = registry.add_candidate(perturb(weights[4], 0.05, seed=77), parent=4)  # depth(4)=1 -> 2, no snapshot
    branch2 = registry.add_candidate(perturb(weights[4], 0.05, seed=78), parent=branch.version)  # depth 3 -> snapshot
    rows = {r.version: r for r in registry.list()}
    assert [v for v in range(11) if rows[v].snapshot_key] == [0, 3, 6, 9]
    assert (branch.snapshot_key, branch.chain_depth, branch.snapshot_base) == (None, 2, 3)
    assert (branch2.chain_depth, branch2.snapshot_base) == (0, branch2.version) and branch2.snapshot_key
    assert all(r.chain_depth < 3 for r in rows.values())


def age(store: LocalBlobStore, key: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(store._path(key), (t, t))


def test_gc_removes_only_old_unreferenced_blobs(registry):
    weights = chain(registry, 4)
    referenced = registry.referenced_blobs()
    assert len(referenced) == 4 + 1 + 1  # 4 deltas, the base snapshot, version 3's snapshot
    old, young = registry.blobs.put(b"orphan from a crashed writer"), registry.blobs.put(b"a version being added")
    age(registry.blobs, old, 7200)
    for key in referenced:  # age is irrelevant for referenced blobs
        age(registry.blobs, key, 7200)

    dry = registry.gc(dry_run=True)
    assert dry.dry_run and [b.key for b in dry.removed] == [old] and [b.key for b in dry.recent] == [young]
    assert (
        dry.referenced == len(referenced)
        and dry.missing == []
        and dry.removed_bytes == len(b"orphan from a crashed writer")
    )
    assert registry.blobs.exists(old) and not [a for a in registry.audit() if a.action == "gc"]

    res = registry.gc()
    assert [b.key for b in res.removed] == [old] and not registry.blobs.exists(old) and registry.blobs.exists(young)
    assert registry.audit()[-1].action == "gc" and "removed 1 unreferenced blobs" in registry.audit()[-1].reason
    assert registry.gc(grace_s=0).removed[0].key == young
    assert set(registry.blobs.list_keys()) == referenced
    for v, w in weights.items():
        assert checksum(registry.materialize(v)) == checksum(w)
    assert registry.gc(grace_s=0).removed == []

    registry.blobs.delete(registry.get(2).blob_key)
    assert registry.gc(dry_run=True).missing == [registry.get(2).blob_key]
    with pytest.raises(ValueError, match="grace_s"):
        registry.gc(grace_s=-1)


def test_gc_prunes_rejected_versions_no_surviving_version_descends_from(registry):
    """Rejected candidates' deltas do not stay forever. A rejected version that a live version
    descends from keeps its delta (rebuilding the descendant walks through it); a rejected subtree goes."""
    weights = chain(registry, 4)  # 0 <- 1 <- 2 <- 3 <- 4, snapshot at 3
    side = registry.add_candidate(perturb(weights[2], 0.05, seed=7), parent=2)  # 2 <- 5
    leaf = registry.add_candidate(perturb(weights[2], 0.05, seed=8), parent=side.version)  # 5 <- 6
    for v in (1, 2, side.version, leaf.version):
        registry.set_status(v, "rejected", actor="gate", reason="test")
    registry.promote(4, actor="gate", reason="test")
    assert registry.prunable_rejected(3600) == []  # too young
    assert registry.prunable_rejected(0) == [leaf.version, side.version]  # 1 and 2: version 4 descends from them
    keys = {v: registry.get(v).blob_key for v in (side.version, leaf.version)}
    gone = set(keys.values()) | {registry.get(v).snapshot_key for v in keys} - {None}
    for key in registry.blobs.list_keys():
        age(registry.blobs, key, 7200)

    dry = registry.gc(dry_run=True, prune_rejected_s=0)
    assert dry.pruned == [leaf.version, side.version] and {b.key for b in dry.removed} == gone
    assert registry.get(leaf.version).blob_key == keys[leaf.version]  # a dry run changes nothing

    res = registry.gc(prune_rejected_s=0)
    assert {b.key for b in res.removed} == gone and not any(registry.blobs.exists(k) for k in gone)
    row = registry.get(leaf.version)
    assert row.status == "rejected" and row.blob_key is None and row.checksum  # history stays
    assert [a.action for a in registry.audit()[-2:]] == ["gc", "gc"] and "pruned the deltas of 2" in registry.audit()[
        -2
    ].reason
    with pytest.raises(RegistryError, match="pruned by gc"):
        registry.materialize(leaf.version)
    for v in (0, 1, 2, 3, 4):  # everything else still rebuilds exactly
        assert checksum(registry.materialize(v)) == checksum(weights[v])
    assert registry.gc(prune_rejected_s=0).pruned == []


class PausingStore(LocalBlobStore):
    """Stops the writer after its delta blob is stored and before its row is committed."""

    def __init__(self, root, stored: threading.Event, resume: threading.Event):
        super().__init__(root)
        self.stored, self.resume = stored, resume

    def put(self, data: bytes) -> str:
        key = super().put(data)
        if not self.stored.is_set():
            self.stored.set()
            assert self.resume.wait(30)
        return key


def test_gc_spares_a_blob_whose_row_is_not_committed_yet(registry, tmp_path):
    weights = chain(registry, 1)
    stored, resume = threading.Event(), threading.Event()
    writer = Registry(registry.url, PausingStore(tmp_path / "blobs", stored, resume), snapshot_every=3)
    out = {}

    def add() -> None:
        out["row"] = writer.add_candidate(perturb(weights[1], 0.05, seed=9), parent=1, parent_state=weights[1])

    t = threading.Thread(target=add)
    t.start()
    try:
        assert stored.wait(30)
        res = registry.gc()  # the new delta is in the store, unreferenced, and young: kept
        assert res.removed == [] and len(res.recent) == 1
        pending = res.recent[0].key
    finally:
        resume.set()
        t.join()
        writer.close()
    assert out["row"].blob_key == pending and registry.blobs.exists(pending)
    assert checksum(registry.materialize(out["row"].version)) == out["row"].checksum
    assert registry.gc(grace_s=0).removed == []


def test_gc_on_an_s3_store(registry, s3_bucket, s3_env):
    reg = Registry(registry.url, S3BlobStore(s3_bucket, prefix="blobs", endpoint_url=s3_env), snapshot_every=3)
    try:
        weights = chain(reg, 3)
        orphan = reg.blobs.put(b"orphan")
        assert reg.gc(dry_run=False).recent[0].key == orphan  # young: kept
        res = reg.gc(grace_s=0)
        assert [b.key for b in res.removed] == [orphan] and not reg.blobs.exists(orphan)
        assert set(reg.blobs.list_keys()) == reg.referenced_blobs()
        assert checksum(reg.materialize(3)) == checksum(weights[3])
    finally:
        reg.close()


def test_compose_in_both_directions_and_across_branches(registry):
    weights = chain(registry, 7)  # snapshots at 0, 3, 6
    side = perturb(weights[2], 0.05, seed=42)
    branch = registry.add_candidate(side, parent=2)  # v8, child of 2
    weights[branch.version] = side
    for a, b in [(1, 7), (7, 1), (0, 5), (5, 0), (6, 4), (7, branch.version), (branch.version, 4), (3, 4)]:
        blob = registry.compose(a, b)
        h = read_header(blob)
        assert (h.base_version, h.target_version) == (a, b)
        assert (h.base_checksum, h.target_checksum) == (registry.get(a).checksum, registry.get(b).checksum)
        out, now = apply_delta(registry.materialize(a), blob)
        assert now == b and checksum(out) == checksum(registry.materialize(b)) == checksum(weights[b])
        back, now = apply_delta(weights[b], blob)  # and it still works backwards
        assert now == a and checksum(back) == checksum(weights[a])
    # one composed delta is smaller than the chain it replaces when changes overlap, never absurdly larger
    assert len(registry.compose(1, 7)) < 2 * sum(len(d) for d in registry.deltas_between(1, 7))


def test_compose_refuses_a_chain_that_misses_the_recorded_checksum(registry):
    chain(registry, 3)
    with registry.db.tx() as s:
        s.execute(sa.update(Version).where(Version.version == 3).values(checksum="0" * 64))
    with pytest.raises(RegistryError, match="registry says"):
        registry.compose(1, 3)
    with pytest.raises(RegistryError, match="unknown version 99"):
        registry.compose(1, 99)


def test_gc_command_prints_what_it_would_remove_then_removes_it(cfg, capsys):
    """The admin verb behind ``liverl gc``: a dry run needs no identity, deleting needs an admin's token."""
    from liverl.ops.admin import gc_command, open_registry

    reg = open_registry(cfg)
    try:
        token = reg.add_operator("root", "admin", by="test", reason="set-up")
        chain(reg, 2)
        orphan = reg.blobs.put(b"orphan")
        age(reg.blobs, orphan, 7200)
        young = reg.blobs.put(b"young")
    finally:
        reg.close()
    assert gc_command(cfg, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and orphan in out and "would remove" in out and young in out and "kept" in out
    assert LocalBlobStore(cfg.blob_location).exists(orphan)
    assert gc_command(cfg, dry_run=False) == 1
    assert "needs an operator token" in capsys.readouterr().err
    assert gc_command(cfg, dry_run=False, token=token) == 0
    out = capsys.readouterr().out
    assert "removed 1 unreferenced blobs" in out and not LocalBlobStore(cfg.blob_location).exists(orphan)
    reg = open_registry(cfg)
    try:
        reg.blobs.delete(reg.get(1).blob_key)
    finally:
        reg.close()
    assert gc_command(cfg, dry_run=True) == 1
    assert "missing" in capsys.readouterr().err


def test_demo_codec_report_compares_stored_deltas_with_xor_zstd(registry):
    """The demo summary's codec report: real stored deltas, next to XOR + zstd of the same changes."""
    from liverl.demo.report import codec_report

    g = torch.Generator().manual_seed(5)
    master = {f"w{i}": torch.randn(128, 256, generator=g) * 0.02 for i in range(3)}
    registry.init_base({k: v.to(torch.bfloat16) for k, v in master.items()}, "base")
    for step in range(3):
        master = {k: v + 1e-6 * torch.randn(v.shape, generator=g).sign() for k, v in master.items()}
        registry.add_candidate({k: v.to(torch.bfloat16) for k, v in master.items()}, parent=step)
    rep = codec_report(registry, [v for v in registry.list() if v.version != 0], sample=2)
    assert [r["version"] for r in rep["versions"]] == [2, 3]  # the most recent, oldest first
    assert all(r["method_bytes"] for r in rep["versions"])
    assert rep["median_ratio_liverl"] > 2 * rep["median_ratio_xor_zstd"] > 2 * rep["median_ratio_zstd"]
