"""The tests' name for ``liverl.ops.netns`` (hosts with their own addresses on one machine)."""

from liverl.ops.netns import SUBNETS, Hosts, sweep_stale, unavailable

__all__ = ["SUBNETS", "Hosts", "sweep_stale", "unavailable"]
