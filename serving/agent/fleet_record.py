"""The agent's record of what its node serves in the registry's fleet table.

A node's first swap to a version writes that version's ``served`` row (``Registry.update_fleet``), which a canary's
evidence waits for: the canary counts from when the last of its nodes served it. A record the registry refused (the
database restarting, a connection lost) is not dropped: it is tried again at every poll until it lands, dated at the
swap, so a blip at the swap's moment does not leave the canary waiting until its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("liverl.serving.agent")


class FleetRecord:
    """The last swap the registry has not taken yet, for ``node``. ``errors``: the agent's error counter (by kind);
    ``registry_errors``: what a registry call raises when the database is unreachable or refuses."""

    def __init__(self, registry, node: str, errors, registry_errors: tuple[type[BaseException], ...]):
        self.registry, self.node, self.errors, self.registry_errors = registry, node, errors, registry_errors
        self.unrecorded: tuple[int, str, float] | None = None  # (version, checksum, when the node swapped to it)
        self._last_error: str | None = None

    def swapped(self, version: int, checksum: str, at: float | None = None) -> None:
        """The node serves ``version`` since ``at`` (default now): record it at the next ``flush``."""
        self.unrecorded = (version, checksum, time.time() if at is None else at)

    async def flush(self) -> None:
        """Write the unrecorded swap; a failure is counted and kept for the next call, logged once per distinct
        error."""
        if self.registry is None or self.unrecorded is None:
            return
        version, checksum, at = self.unrecorded
        try:
            await asyncio.to_thread(self.registry.update_fleet, self.node, version, checksum, at)
        except self.registry_errors as e:
            self.errors.labels(kind=f"fleet_record {type(e).__name__}").inc()
            if self._last_error != str(e):
                self._last_error = str(e)
                log.warning(
                    "could not record node %s serving v%d in the registry's fleet table (retried every poll): %s",
                    self.node,
                    version,
                    e,
                )
            return
        self.unrecorded, self._last_error = None, None
