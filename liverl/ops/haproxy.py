"""HAProxy's configuration for several ``liverl route`` routers behind one address.

The settings, each explained where it is set, are in ``templates/haproxy.cfg.in``; this module fills in where
HAProxy listens and the routers. ``packaging/haproxy/haproxy.cfg`` is its rendering for two routers whose addresses
come from the environment (``LIVERL_ROUTER_1``, ``LIVERL_ROUTER_2``); for another number of routers, or fixed
addresses, render one:

    python -m liverl.ops.haproxy --router 10.0.0.7:8080 --router 10.0.0.8:8080 --router 10.0.0.9:8080 > haproxy.cfg
    python -m liverl.ops.haproxy --env 3 > haproxy.cfg      # LIVERL_ROUTER_1..3 read when HAProxy starts
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources

TEMPLATE = "haproxy.cfg.in"
BIND = "${LIVERL_LB_BIND-:8080}"  # where clients connect (the environment's LIVERL_LB_BIND, else every address, 8080)
STATS_BIND = "${LIVERL_LB_STATS_BIND-127.0.0.1:8404}"  # /metrics and /stats, loopback unless told otherwise
ADDRESS = re.compile(r"^[A-Za-z0-9._\-\[\]:]+:[0-9]{1,5}$|^\$\{[A-Z0-9_]+(-[A-Za-z0-9._\-:]+)?\}$")


def router_name(i: int) -> str:
    """The name of the ``i``-th router (from 0) in HAProxy's logs, stats and the ``X-Liverl-Router`` header."""
    return f"router-{i + 1}"


def env_routers(n: int) -> list[str]:
    """Addresses read from the environment when HAProxy starts: ``LIVERL_ROUTER_1`` .. ``LIVERL_ROUTER_n``, each
    ``host:port``, by default ``router-<i>:8080`` (a compose service of that name)."""
    if n < 1:
        raise ValueError(f"at least one router, not {n}")
    return [f"${{LIVERL_ROUTER_{i + 1}-{router_name(i)}:8080}}" for i in range(n)]


def render(routers: list[str], bind: str = BIND, stats_bind: str = STATS_BIND) -> str:
    """The configuration for ``routers`` (each ``host:port``, or an environment reference ``${NAME}``), clients
    on ``bind``, metrics and the status page on ``stats_bind``."""
    if not routers:
        raise ValueError("HAProxy needs at least one router address (host:port)")
    for a in [*routers, bind, stats_bind]:
        if not ADDRESS.match(a) and not (a.startswith(":") and a[1:].isdigit()):
            raise ValueError(f"{a!r} is not an address HAProxy takes here: host:port (or ${{ENV_NAME}})")
    text = resources.files("liverl.ops").joinpath("templates", TEMPLATE).read_text()
    servers = "\n".join(f'    server {router_name(i)} "{a}" check' for i, a in enumerate(routers))
    return text.replace("@BIND@", bind).replace("@STATS_BIND@", stats_bind).replace("@SERVERS@", servers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liverl.ops.haproxy", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--router", action="append", metavar="HOST:PORT", help="a router's address (repeat per router)")
    g.add_argument("--env", type=int, metavar="N", help="N routers whose addresses HAProxy reads from the environment")
    p.add_argument("--bind", default=BIND, help=f"where clients connect (default {BIND})")
    p.add_argument("--stats-bind", default=STATS_BIND, help=f"/metrics and /stats (default {STATS_BIND})")
    args = p.parse_args(argv)
    try:
        routers = args.router if args.router else env_routers(args.env)
        sys.stdout.write(render(routers, args.bind, args.stats_bind))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
