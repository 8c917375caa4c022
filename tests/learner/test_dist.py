"""The learner over torch.distributed on CPU (gloo): FSDP2 over 2 ranks against 1, DCP checkpoints and torn ones.

Each case runs the learner's own update path (``PolicyTrainer.train_step`` sharded with FSDP2, through
``python -m learner.dist_check``) in real processes under torchrun, on a generated ~0.2M-parameter Qwen3-MoE and
samples generated from a seed (the same samples in the same order for any number of ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
"""Max |w_2ranks - w_1rank| after 3 AdamW updates at lr 1e-3 (measured 6.7e-7: FSDP reduces the gradient in another
order of float additions; Adam's normalisation keeps such differences at the size of the rounding, not of lr)."""


def launch(args: list[str], nproc: int, tmp: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "learner.dist_check",
        "--backend",
        "gloo",
        "--size",
        "tiny",
        "--work",
        str(tmp / "models"),
        *args,
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert set(wa) == set(wb) and wa
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    return tmp_path


def test_two_ranks_and_one_rank_train_the_same_weights(tmp):
    common = ["--steps", "3", "--batch", "8", "--seed", "3"]
    launch(["--steps", "0"], 1, tmp).communicate(timeout=240)  # builds the model once before the two runs race
    one = launch([*common, "--save-weights", str(tmp / "one.safetensors")], 1, tmp)
    two = launch([*common, "--save-weights", str(tmp / "two.safetensors")], 2, tmp)
    out_two, out_one = finish(two), finish(one)
    assert "| 2 | default | gloo |" in out_two and "| 1 | default | gloo |" in out_one
    base = load_file(str(next((tmp / "models").glob("*/model.safetensors"))))
    moved = max(float((load_file(str(tmp / "one.safetensors"))[k] - base[k].float()).abs().max()) for k in base)
    assert moved > 100 * TOLERANCE  # the updates did change the weights: the comparison below means something
    assert max_diff(tmp / "one.safetensors", tmp / "two.safetensors") <= TOLERANCE


def test_a_restart_resumes_from_the_last_complete_checkpoint_and_never_loads_a_torn_one(tmp):
    """4 updates with a checkpoint every 2; then as if the run had died while writing step 4: its folder is still a
    ``.tmp-*`` (no commit), and a ``step-*`` folder with DCP files but no ``learner.json`` lies there too. The
    restart loads step 2, trains steps 3 and 4 on the same samples, and ends on the uninterrupted run's weights."""
    ck = tmp / "ckpt"
    args = ["--steps", "4", "--batch", "8", "--seed", "5", "--ckpt", str(ck)]
    out = finish(launch([*args, "--ckpt-every", "2", "--save-weights", str(tmp / "straight.safetensors")], 2, tmp))
    assert "step 4:" in out
    assert sorted(p.name for p in ck.iterdir()) == ["step-000000002", "step-000000004"]
    os.rename(ck / "step-000000004", ck / ".tmp-000000004")  # the commit (rename) of step 4 never happened
    (ck / ".tmp-000000004" / "learner.json").unlink()
    torn = ck / "step-000000009"  # a folder that claims a later step but was never committed
    shutil.copytree(ck / "step-000000002", torn)
    (torn / "learner.json").unlink()
    for f in torn.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])

    out = finish(launch([*args, "--resume", "--save-weights", str(tmp / "resumed.safetensors")], 2, tmp))
    assert "step 3:" in out and "step 4:" in out and "step 1:" not in out
    assert max_diff(tmp / "straight.safetensors", tmp / "resumed.safetensors") <= 1e-6


def test_the_checkpoint_folder_lists_only_committed_checkpoints(tmp_path):
    from learner.dist import CheckpointDir, Ranks

    ck = CheckpointDir(tmp_path, Ranks(rank=0, world=1, device=torch.device("cpu"), backend="gloo"))
    assert ck.latest() is None
    for name, files in {
        "step-000000003": [".metadata", "learner.json"],
        "step-000000007": [".metadata"],
        ".tmp-000000008": [".metadata", "learner.json"],
        "step-x": [".metadata", "learner.json"],
    }.items():
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
    assert ck.steps() == [3] and ck.latest() == tmp_path / "step-000000003"
    with pytest.raises(ValueError, match="keep"):
        CheckpointDir(tmp_path, ck.ranks, keep=0)


# ------------------------------------------------------------------------- the Kafka learner on a group of ranks


@pytest.fixture
def group_of_one(monkeypatch):
    """A gloo process group of one in this process (as torchrun would describe it), torn down afterwards."""
    import socket

    from learner import dist as ldist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    ranks = ldist.setup("gloo")
    yield ranks
    ldist.teardown()


def test_the_learner_on_ranks_checkpoints_every_k_updates_and_a_crash_trains_nothing_twice(cfg, group_of_one):
    """The Kafka learner with FSDP2 and DCP checkpoints every 2 updates (the leader path of ``liverl learn`` under
    torchrun, here on a group of one): it crashes after update 3, whose checkpoint was not due. The restart loads
    the step-2 checkpoint, seeks to its offsets and trains the third batch again from the same weights; the ledger
    shows every sample trained exactly once, and the crashed update is in no line of it."""
    from learner.model import load_model
    from learner.trainer import Learner
    from liverl.demo.base_policy import ensure_base_policy

    from .test_trainer import learner_cfg, ledger_fates, make_registry, make_samples, model_cache, produce_samples

    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    samples = make_samples(load_model(model_dir), 64, seed=7)
    cfg = learner_cfg(cfg, batch_size=16, candidate_every_steps=100, checkpoint_every_steps=2)
    produce_samples(cfg, samples)
    reg = make_registry(cfg, model_dir)

    class CrashAfter3(Learner):
        def _update(self):
            ok = super()._update()
            if self.state.step == 3:
                raise RuntimeError("simulated crash after update 3")
            return ok

    try:
        first = CrashAfter3(cfg, model_dir, cfg.broker.bootstrap, reg, ranks=group_of_one)
        with pytest.raises(RuntimeError, match="simulated crash"):
            first.run(max_steps=10)
        assert first.ckpts.steps() == [2]
        second = Learner(cfg, model_dir, cfg.broker.bootstrap, reg, ranks=group_of_one)
        meta = json.loads((first.ckpts.latest() / "learner.json").read_text())
        assert second.state.step == 2 and second.state.offsets == {int(p): o for p, o in meta["offsets"].items()}
        stats = second.run(max_steps=2)
        assert stats["step"] == 4 and second.ckpts.steps() == [2, 4]  # the stop checkpoints step 4
        trained, refused = ledger_fates(second)
        assert sorted(trained) == sorted(s.sample_id for s in samples) and not refused
    finally:
        reg.close()


def test_kill_9_of_one_rank_then_a_restart_trains_every_sample_exactly_once(cfg):
    """``liverl learn`` under torchrun, 2 gloo ranks, DCP every 2 updates. Rank 1 is killed with SIGKILL once the first
    checkpoint is down (torchrun then ends rank 0); a restart loads the last complete checkpoint on both ranks and
    trains the rest. The ledger (rank 0's) lists every sample trained exactly once in the final lineage."""
    import signal
    import time

    import psutil

    from learner.dist import CheckpointDir, Ranks, dcp_root
    from learner.ledger import Ledger, checkpoint_path_for, ledger_path
    from learner.model import load_model
    from liverl.demo.base_policy import ensure_base_policy

    from .test_trainer import learner_cfg, make_samples, model_cache, produce_samples

    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    samples = make_samples(load_model(model_dir), 96, seed=11)
    cfg = learner_cfg(cfg, batch_size=16, candidate_every_steps=100, checkpoint_every_steps=2)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        LIVERL__STATE_DIR=str(cfg.state_path),
        LIVERL__BROKER__BOOTSTRAP=cfg.broker.bootstrap,
        LIVERL__REDIS__URL=cfg.redis.url,
        LIVERL__TOPICS__PREFIX=cfg.topics.prefix,
        LIVERL__MODEL__CACHE_DIR=str(model_cache()),
        LIVERL__LEARNER__BATCH_SIZE="16",
        LIVERL__LEARNER__CANDIDATE_EVERY_STEPS="100",
        LIVERL__LEARNER__LR="1e-3",
        LIVERL__LEARNER__CHECKPOINT_EVERY_STEPS="2",
        LIVERL__LEARNER__MAX_BATCH_WAIT_S="2",
    )
    ckpt = checkpoint_path_for(cfg)
    ckpts = CheckpointDir(dcp_root(ckpt), Ranks(rank=0, world=1, device=torch.device("cpu"), backend="gloo"))

    def learn(max_steps: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "liverl.cli",
                "learn",
                "--max-steps",
                str(max_steps),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    produce_samples(cfg, samples[:48])
    first = learn(6)
    try:
        deadline = time.monotonic() + 150
        while not ckpts.steps() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert ckpts.steps(), f"no checkpoint within 150 s: {first.poll()}"
        [rank1] = [
            p
            for p in psutil.Process(first.pid).children(recursive=True)
            if p.environ().get("RANK") == "1" and "liverl.cli" in " ".join(p.cmdline())
        ]
        rank1.send_signal(signal.SIGKILL)
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, out[-3000:]
    done = ckpts.steps()[-1]
    assert 2 <= done < 6
    produce_samples(cfg, samples[48:])
    second = learn(6 - done)
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out[-4000:]
    assert ckpts.steps()[-1] == 6
    trained = [sid for line in Ledger.read(ledger_path(ckpt)) for _, _, sid in line.get("trained", [])]
    assert sorted(trained) == sorted(s.sample_id for s in samples)  # each once: none lost, none twice


def test_a_dcp_checkpoint_carries_the_candidates_weight_average(tmp_path, group_of_one):
    """FSDP2 over a group of one: the average (``learner.candidate_ema``) is measured for the entropy floor through the
    sharded forward as in one process, saved with the shards and loaded back in place; a checkpoint written without
    one starts it at the loaded weights."""
    from core.config import LearnerConfig
    from learner.dist import CheckpointDir
    from learner.model import load_model
    from learner.policy_trainer import PolicyTrainer
    from learner.ranks import load_checkpoint
    from liverl.demo.base_policy import ensure_base_policy

    from .test_trainer import make_samples, model_cache

    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    samples = make_samples(load_model(model_dir), 32, seed=5)
    lcfg = LearnerConfig(lr=1e-3, candidate_ema=0.9)

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    tr = PolicyTrainer(model_dir, lcfg, ranks=group_of_one)
    tr.train_step(samples[:16])
    tr.train_step(samples[16:])
    assert not same(tr.candidate_weights(), tr.bf16_state_dict())
    weights, cand = tr.bf16_state_dict(), tr.candidate_weights()
    held = tr.measure_candidate_entropy()  # the average through the sharded forward, then the shards put back
    assert same(tr.bf16_state_dict(), weights) and same(tr.candidate_weights(), cand)
    alone = PolicyTrainer(model_dir, lcfg)  # one process, no group: the same measurement
    alone.train_step(samples[:16])
    alone.train_step(samples[16:])
    ref = alone.measure_candidate_entropy()
    assert held["entropy"] == pytest.approx(ref["entropy"], rel=1e-3)
    assert held["candidate_entropy"] == pytest.approx(ref["candidate_entropy"], rel=1e-3)
    with_avg = CheckpointDir(tmp_path / "with", group_of_one)
    with_avg.save(2, tr.model, tr.opt, {}, ema=tr.ema_state())
    without = CheckpointDir(tmp_path / "without", group_of_one)
    without.save(2, tr.model, tr.opt, {})

    back = PolicyTrainer(model_dir, lcfg, ranks=group_of_one)
    assert load_checkpoint(back, with_avg)["ema_loaded"]
    assert same(back.candidate_weights(), tr.candidate_weights())
    assert same(back.bf16_state_dict(), tr.bf16_state_dict())
    fresh = PolicyTrainer(model_dir, lcfg, ranks=group_of_one)
    assert not load_checkpoint(fresh, without)["ema_loaded"]
    assert same(fresh.candidate_weights(), tr.bf16_state_dict())
