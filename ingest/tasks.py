"""Task assignment: what a worker does when the consumer group gives it partitions or takes them away.

The range assignor gives a worker the same partition numbers of both inputs, so a generation and its feedback meet in
one worker (Kafka Streams' tasks: one per partition number, with its store). On a revocation the worker settles every
decided batch, writes the table's write buffer and commits; on an assignment it opens the partitions' databases,
reads their changelogs' tails (``ingest.restore``) and rebuilds the join's pending index (``Ingest.restore``). A batch
fetched before either is not processed (``epoch``). Of the join, the listener sees two calls: ``revoked`` and
``restore``.

Also here: one worker per state folder (``LOCK_FILE``), and the group member a killed worker left behind
(``leave_previous_member``).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.client import CoordinationType
from aiokafka.protocol.group import LeaveGroupRequest

from core.bus import make_aio_client
from core.config import LiverlConfig
from ingest.commit import Committer, die
from ingest.pacing import Pacer
from ingest.table import JoinTable

log = logging.getLogger("liverl.ingest")

MEMBER_FILE = "group-member-id"
LOCK_FILE = "LOCK"


def state_dir(cfg: LiverlConfig) -> Path:
    return cfg.state_path / "ingest"


def lock_state(state: Path) -> int:
    """One worker per state folder: its databases and its remembered group member are its own. Returns the lock's
    file descriptor (held until closed)."""
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"another ingest worker uses {state}: give each worker its own state_dir") from None
    return fd


async def leave_previous_member(cfg: LiverlConfig, bootstrap: str) -> bool:
    """Ask the group coordinator to drop the consumer-group member this worker had before it was killed.

    Why: a worker that died without leaving the group (kill -9, OOM, power) stays a member until its session times
    out, and the group's next join waits for it: on the embedded broker a restarted worker would wait ~12 s before
    it is given partitions. The member id is kept in the worker's state folder (``MEMBER_FILE``), which no two
    workers share (``LOCK_FILE``). A member that is already gone is answered with an error, which is fine.
    Returns True when a leave was sent. Static membership (group.instance.id) would do this in the protocol, but
    the embedded broker does not shorten the wait for it.
    """
    path = state_dir(cfg) / MEMBER_FILE
    try:
        member_id = path.read_text().strip()
    except OSError:
        return False
    if not member_id:
        return False
    group = f"{cfg.topics.prefix}-ingest"
    client = make_aio_client(bootstrap, cfg.broker)
    try:
        await client.bootstrap()
        node = await client.coordinator_lookup(CoordinationType.GROUP, group)
        await client.send(node, LeaveGroupRequest(group, member_id))
        log.info("asked the coordinator to drop this worker's previous group member %s", member_id)
        return True
    except Exception as e:  # noqa: BLE001 - best effort: without it the join only waits longer
        log.info(
            "previous group member %s not dropped (%s: %s); the group join waits for its session",
            member_id,
            type(e).__name__,
            e,
        )
        return False
    finally:
        await client.close()


class Tasks(ConsumerRebalanceListener):
    """The rebalance listener: revocations and assignments, one at a time with batches and timers (``busy``)."""

    def __init__(
        self,
        cfg: LiverlConfig,
        bootstrap: str,
        consumer: Any,
        table: JoinTable,
        committer: Committer,
        pacer: Pacer,
        state: Path,
        *,
        revoked: Callable[[], None],
        restore: Callable[[], Awaitable[int]],
    ):
        """``revoked``: the join decides nothing until ``restore`` (``Ingest.revoked``). ``restore``: rebuild the
        join's indexes from the table, returning how much feedback is pending (``Ingest.restore``)."""
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.consumer = consumer  # (an aiokafka consumer: its group member id is remembered)
        self.table, self.committer, self.pacer = table, committer, pacer
        self.state = state
        self._revoked, self._restore = revoked, restore
        self.inputs = (cfg.topics.generations, cfg.topics.feedback)
        self.busy = asyncio.Lock()  # a batch, a timer or a rebalance callback: one at a time
        self.epoch = 0  # bumped by every rebalance: a batch fetched before one is not processed
        self.feedback_partitions: frozenset[int] = frozenset()  # the feedback partitions this worker holds

    async def on_partitions_revoked(self, revoked) -> None:
        async with self.busy:
            self.epoch += 1
            self._revoked()
            self.pacer.drop()
            await self.committer.drain()
            await self.committer.commit_now()

    async def on_partitions_assigned(self, assigned) -> None:
        async with self.busy:
            self.epoch += 1
            await self.committer.drain()
            t0 = time.monotonic()
            mine = set(assigned)
            parts = {tp.partition for tp in mine if tp.topic in self.inputs}
            gens = {tp.partition for tp in mine if tp.topic == self.cfg.topics.generations}
            fbs = {tp.partition for tp in mine if tp.topic == self.cfg.topics.feedback}
            if gens != fbs:
                log.error(
                    "this worker holds generations %s but feedback %s: the inputs must have the same partition "
                    "count (broker.partitions) and every worker the same subscription",
                    sorted(gens),
                    sorted(fbs),
                )
            self.feedback_partitions = frozenset(fbs)
            self.committer.keep_only(mine)
            self.pacer.reset(mine)
            self.table.hold(parts)
            try:
                stats = await self.table.recover(self.bootstrap, self.cfg.broker)
            except Exception as e:  # noqa: BLE001 - without its table the worker must not join anything
                die(f"reading the join table's changelog failed: {type(e).__name__}: {e}")
            pending = await self._restore()
            self._remember_member()
            log.info(
                "join table ready: partitions %s, %d changelog records read, %d feedback pending (%.2f s)",
                stats["partitions"],
                stats["read"],
                pending,
                time.monotonic() - t0,
            )

    def _remember_member(self) -> None:
        try:
            member_id = self.consumer._coordinator.member_id
        except AttributeError:
            return
        if member_id:
            path = self.state / MEMBER_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(member_id)
            os.replace(tmp, path)
