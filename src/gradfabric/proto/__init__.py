"""Sans-I/O protocol engines.

Every engine takes packets and the current time and returns actions::

    engine.on_packet(pkt, now_ns) -> list[Action]
    engine.on_timer(now_ns) -> list[Action]
    engine.next_deadline() -> int | None

It never opens a socket, reads a clock, sleeps, draws from a global RNG or
imports the simulator, asyncio or torch. Drivers (``gradfabric.sim``,
``gradfabric.net``) own time and I/O.
"""
