"""What the learner's one-process checkpoint costs with its recent-id window as a list and as one JSON string.

    python scripts/ckpt_bench.py [--ids 100000] [--repeats 5]

The state is the learner's own (``PolicyTrainer.state()`` of the demo's base policy: fp32 weights, AdamW, the
baseline) plus ``--ids`` sample ids, written as ``learner.checkpoint.Checkpoints.save`` writes it (``torch.save`` to a
file, then fsync). Prints a table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from core.config import LearnerConfig, load_config
from learner.policy_trainer import PolicyTrainer
from liverl.demo.base_policy import ensure_base_policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=100_000, help="sample ids in the window (learner.dedupe_window)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model_dir = ensure_base_policy(Path(load_config().model_cache_path), seed=0, progress=False)
    trainer = PolicyTrainer(model_dir, LearnerConfig(lr=3e-4))
    ids = [f"{uuid.uuid4().hex}:0:{i}" for i in range(args.ids)]
    path = os.path.join(tempfile.mkdtemp(), "learner.pt")
    print(f"| trained_ids in the checkpoint | save + fsync (ms, median of {args.repeats}) | load (ms) | file (MB) |")
    print("|---|---|---|---|")
    for name, form in (("a list (before)", list(ids)), ("one JSON string (after)", json.dumps(ids))):
        st = dict(step=1, trained_ids=form, **trainer.state())
        saves, loads = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(st, f)
                f.flush()
                os.fsync(f.fileno())
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.load(path, weights_only=True)
            loads.append(time.perf_counter() - t)
        size = os.path.getsize(path) / 1e6
        print(
            f"| {name} | {statistics.median(saves) * 1000:.0f} | {statistics.median(loads) * 1000:.0f} | {size:.1f} |"
        )
    os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
