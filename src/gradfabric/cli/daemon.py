"""The daemons: ``switch serve`` (any policy), ``ps serve`` and ``omni
serve`` (the same daemon in those roles), and ``stats`` of a running one.
Their flags come from ``SwitchConfig``'s fields, so the defaults live in one
place."""

from __future__ import annotations

import argparse
import asyncio
import json

from gradfabric.cli.common import Sub, dataclass_from, dataclass_options, err, out, table

SERVE = (
    "Serve aggregation on a UDP port for any number of jobs. Jobs register on the control "
    "port (TCP, JSON lines) and get an id and a secret token; datagrams with a wrong token, "
    "an unknown job or a malformed packet are counted drops. --loss/--dup/--delay-us/"
    "--jitter-us impair every datagram in and out (user space: this kernel has no netem). "
    "Prints its addresses once ready (one JSON object with --json) and its final counters "
    "on SIGTERM or SIGINT."
)
ROLES = (  # (command, what it is, its serve help, the policy it fixes; None: --policy)
    ("switch", "the software switch daemon",
     "run the switch (SwitchML, ATP, ESA or DLCP) on UDP until SIGTERM", None),
    ("ps", "the parameter server daemon",
     "run a parameter server on UDP until SIGTERM (switch serve --policy ps)", "ps"),
    ("omni", "the OmniReduce aggregator daemon",
     "run an OmniReduce aggregator on UDP (switch serve --policy omni)", "omni"),
)  # fmt: skip


def add(sub: Sub) -> None:
    from gradfabric.runtime.switchd import SwitchConfig

    for command, what, help_, policy in ROLES:
        role = sub.add_parser(command, help=what)
        roles = role.add_subparsers(dest=command, required=True)
        serve_ = roles.add_parser("serve", help=help_, description=SERVE)
        dataclass_options(serve_, SwitchConfig, skip=("policy",) if policy else ())
        serve_.add_argument("--json", action="store_true", help="addresses and counters as JSON")
        serve_.set_defaults(fn=serve, **({"policy": policy} if policy else {}))
    st = sub.add_parser("stats", help="a running switch's counters")
    st.add_argument("--switch", required=True, help="HOST:CONTROL_PORT")
    st.add_argument("--json", action="store_true", help="the counters as one JSON object")
    st.set_defaults(fn=stats)


def serve(args: argparse.Namespace) -> int:
    from gradfabric.runtime.switchd import SwitchConfig, SwitchDaemon

    cfg = dataclass_from(SwitchConfig, args, policy=args.policy)
    daemon = SwitchDaemon(cfg)

    def ready(addrs: dict[str, tuple[str, int]]) -> None:
        where = {k: f"{h}:{p}" for k, (h, p) in addrs.items()}
        if args.json:
            print(json.dumps(where), flush=True)
        else:
            err.print(
                f"switch ({cfg.policy}) serving: " + ", ".join(f"{k} {v}" for k, v in where.items())
            )

    asyncio.run(daemon.serve(ready))
    final = daemon.stats()
    if args.json:
        print(json.dumps(final), flush=True)
    else:
        err.print(f"stopped; counters: {final['counters']}")
    return 0


def stats(args: argparse.Namespace) -> int:
    from gradfabric.runtime.client import parse_address
    from gradfabric.runtime.control import control_call

    try:
        st = asyncio.run(control_call(parse_address(args.switch), {"op": "stats"}))
    except (OSError, TimeoutError) as e:
        err.print(f"[red]no switch at {args.switch}:[/red] {e}")
        return 1
    if args.json:
        print(json.dumps(st))
        return 0
    out.print(
        f"policy {st['policy']}, up {st['uptime_s']:.0f} s, {len(st['jobs'])} jobs, "
        f"{st['occupied']}/{st['slots']} aggregators held"
    )
    rows = [{"counter": k, "value": v} for k, v in st["counters"].items()]
    out.print(table(rows, "switch counters", ["counter", "value"]))
    return 0
