"""Units. Time is integer nanoseconds, sizes are bytes, rates bits per second."""

from __future__ import annotations

NS_PER_US = 1_000
NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


def gbps_to_bps(link_gbps: float) -> float:
    return link_gbps * 1e9


def tx_time_ns(size_bytes: int, rate_bps: float) -> int:
    """Serialisation time of ``size_bytes`` on a link of ``rate_bps``, rounded up."""
    return -(-size_bytes * 8 * NS_PER_S // int(rate_bps))


def ns_to_ms(t_ns: float) -> float:
    return t_ns / NS_PER_MS


def ns_to_s(t_ns: float) -> float:
    return t_ns / NS_PER_S
