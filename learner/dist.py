"""torch.distributed for the learner: the process group, FSDP2 sharding, and DCP checkpoints that are never torn.

Ranks. ``setup()`` joins the group that ``torchrun`` describes in its environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK), or makes a group of one when there is none, so the same code runs 1 and N ranks. The
backend is NCCL on CUDA, gloo on CPU.

Sharding. ``shard(model, ranks)`` applies FSDP2 (``torch.distributed.fsdp.fully_shard``) to every decoder layer, then
to the root (embeddings, final norm, LM head). FSDP2 shards each parameter on its dim 0. For the MoE families
transformers 5 stacks a layer's experts into ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I],
so dim 0 is the expert dim: at rest rank r holds experts [r*E/N, (r+1)*E/N) of every layer (whole experts when N
divides E), and a layer's experts are all-gathered for its forward and backward only. That is data parallelism with
fully sharded state (weights, gradients, AdamW moments: 1/N each), not expert parallelism: tokens do not move
between ranks.

Gradients. Every rank gets the whole batch and trains its share of the samples (``share``); the loss on each rank is
its share's token sum divided by the WHOLE batch's token count, times N because FSDP averages the gradients over
the ranks (``grad_scale``; FSDP's own divide factor needs PREMUL_SUM, which gloo lacks), so N ranks compute the
1-rank gradient up to the order of float additions.

Checkpoints (DCP). ``CheckpointDir.save`` writes ``torch.distributed.checkpoint`` files (each rank its shards) into
``.tmp-<step>``, then rank 0 writes ``learner.json`` (the caller's extra state: consumer offsets, ledger seq,
counters), fsyncs it and renames the folder to ``step-<step>``: a folder of that name is complete by construction. A
crash at any point before the rename leaves a ``.tmp-*`` folder that ``latest()`` never returns and the next save
removes. The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

log = logging.getLogger("liverl.learner")

_STEP_DIR = re.compile(r"^step-(\d{9})$")
META = "learner.json"
BARRIER_TIMEOUT_S = 120.0
"""How long a rank waits for the others at a clean end before it leaves the group anyway."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the learner's group."""

    rank: int
    world: int
    device: torch.device
    backend: str

    @property
    def main(self) -> bool:
        """Rank 0: the one that reads Kafka, writes the ledger and talks to the registry."""
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup(backend: str | None = None) -> Ranks:
    """Join (or create) the learner's process group; ``backend``: 'nccl', 'gloo', or None for NCCL iff CUDA exists."""
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # not under torchrun: a group of one
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), device=device, backend=backend)


def teardown(barrier: bool = False) -> None:
    """Leave the process group. ``barrier``, on a clean end: every rank waits for the others first, so none tears its
    connections down while a peer still uses them (a gloo rank whose peer left first aborted at exit, "terminate
    called without an active exception", after finishing its work). Not after an error: a dead peer would never come
    (gloo's monitored barrier gives up after ``BARRIER_TIMEOUT_S`` and names the ranks that did not)."""
    if not dist.is_initialized():
        return
    if barrier:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
            else:
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - leaving anyway; the log says which rank did not come
            log.warning("ranks: the barrier before leaving the group failed: %s", e)
    dist.destroy_process_group()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``); ValueError when it has none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers: liverl shards transformers causal LMs layer by layer"
        )
    return list(layers)


def shard(model, ranks: Ranks):
    """FSDP2 over ``ranks``: each decoder layer its own unit, then the root. Moves ``model`` to the rank's device."""
    model.to(ranks.device)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def reshard(model) -> None:
    """Free the gathered weights FSDP2 keeps after a forward without backward (the root keeps its own: the next
    forward then reuses them), so that the next forward gathers the shards again: after the shards were written in
    place (``PolicyTrainer.measure_candidate_entropy``). A model without FSDP2 units: nothing to do."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def grad_scale(ranks: Ranks) -> float:
    """What a rank's loss is multiplied by so that FSDP's gradient average over ranks is the batch's gradient."""
    return float(ranks.world)


def share(n: int, ranks: Ranks) -> list[int]:
    """Which of a batch's ``n`` samples this rank trains: contiguous, sizes differ by at most one. Empty when
    ``n < world`` (the rank still runs a zero-weighted forward and backward: FSDP's collectives need every rank)."""
    lo, hi = n * ranks.rank // ranks.world, n * (ranks.rank + 1) // ranks.world
    return list(range(lo, hi))


def all_sum(values: list[float], ranks: Ranks) -> list[float]:
    """Element-wise sum over ranks (one collective, one host sync)."""
    if ranks.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; for batches of samples and small control messages)."""
    if ranks.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=ranks.device if ranks.backend == "nccl" else None)
    return box[0]


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole model state (in-memory names, fp32, CPU) on EVERY rank, gathered from the shards (a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def load_full_state_dict(model, module_sd: dict[str, torch.Tensor]) -> None:
    """Every rank passes the same whole state (in-memory names): each keeps its shards (parameters in place)."""
    set_model_state_dict(model, module_sd, options=StateDictOptions(full_state_dict=True, strict=False))


def dcp_root(checkpoint: Path) -> Path:
    """Where the learner whose single-file checkpoint would be ``checkpoint`` keeps its DCP checkpoints."""
    return Path(checkpoint).with_suffix(".dcp")


class CheckpointDir:
    """Sharded learner checkpoints under ``root``: ``step-<N>/`` (DCP files + ``learner.json``), never torn."""

    def __init__(self, root: Path, ranks: Ranks, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.ranks, self.keep = Path(root), ranks, keep

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (a ``step-*`` folder without ``learner.json`` is skipped)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / META).is_file() and (p / ".metadata").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step-{steps[-1]:09d}" if steps else None

    def write_uncommitted(self, step: int, model, opt, ema: dict[str, torch.Tensor] | None = None) -> Path:
        """Every rank writes its shards of the weights and the optimizer (and of the candidates' weight average,
        ``ema``, when there is one) into ``.tmp-<step>`` (a collective)."""
        tmp = self.root / f".tmp-{step:09d}"
        if self.ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        if ema:
            state["ema"] = ema
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()  # every rank's files are on disk before rank 0 may commit
        return tmp

    def commit(self, tmp: Path, step: int, extra: dict[str, Any]) -> Path:
        """Rank 0 writes ``learner.json`` and renames the folder to ``step-<step>`` (atomic); older ones beyond
        ``keep`` and any leftover ``.tmp-*`` go. Every rank returns the committed path."""
        final = self.root / f"step-{step:09d}"
        if self.ranks.main:
            meta = tmp / META
            with open(meta, "w", encoding="utf-8") as f:
                json.dump(dict(extra, step=step, world=self.ranks.world), f)
                f.flush()
                os.fsync(f.fileno())
            for p in tmp.iterdir():  # DCP's own files, made durable before the name says "complete"
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():  # a checkpoint of this step from a run that crashed after it: ours replaces it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()
        return final

    def save(self, step: int, model, opt, extra: dict[str, Any], ema: dict[str, torch.Tensor] | None = None) -> Path:
        return self.commit(self.write_uncommitted(step, model, opt, ema), step, extra)

    def load(
        self, model, opt, path: Path | None = None, ema: dict[str, torch.Tensor] | None = None
    ) -> dict[str, Any] | None:
        """Load the latest complete checkpoint (or ``path``) into ``model`` and ``opt`` on every rank (a collective);
        returns its ``learner.json``, or None when there is none. Works for another world size than the one saved.
        ``ema``: the candidates' weight average, loaded in place when the checkpoint has one (the returned
        ``ema_loaded`` says whether it had)."""
        path = path if path is not None else self.latest()
        if path is None:
            return None
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        ema_loaded = bool(ema) and any(k.startswith("ema.") for k in saved)
        if ema_loaded:
            state["ema"] = ema
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        meta = json.loads((Path(path) / META).read_text(encoding="utf-8"))
        meta["ema_loaded"] = ema_loaded
        log.info(
            "learner: loaded checkpoint %s (step %s, saved by %s ranks)", path, meta.get("step"), meta.get("world")
        )
        return meta

    def _prune(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
        for s in self.steps()[: -self.keep]:
            shutil.rmtree(self.root / f"step-{s:09d}", ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
