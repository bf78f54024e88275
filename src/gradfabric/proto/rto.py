"""A retransmission timeout that follows the round trips it measures.

RFC 6298's estimator: the smoothed round trip ``srtt`` and its variation
``rttvar`` from samples (the first sets ``srtt`` to it and ``rttvar`` to
half of it; each later one moves them by 1/8 and 1/4), the timeout ``srtt
+ 4 rttvar`` and never below the configured floor, doubled per timeout
(up to ``MAX_BACKOFF`` times) and back to one on the next progress. As
Karn's algorithm asks, a caller samples only what it sent once. A fixed
timeout shorter than a loaded fabric's rounds fires on every round: copies
nobody lost, in the queues that made the rounds slow.
"""

from __future__ import annotations

from typing import Final

MAX_BACKOFF: Final = 64


class Rto:
    """The timeout of one sender, at least ``floor_ns`` (> 0, else
    ``ValueError``)."""

    def __init__(self, floor_ns: int) -> None:
        if floor_ns <= 0:
            raise ValueError(f"a timeout's floor must be > 0 ns, got {floor_ns}")
        self.floor_ns = floor_ns
        self.srtt = self.rttvar = 0.0  # (no sample yet: srtt 0)
        self.backoff = 1

    def sample(self, rtt_ns: int) -> None:
        """A round trip of something sent once."""
        if self.srtt:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt_ns)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt_ns
        else:
            self.srtt, self.rttvar = float(rtt_ns), rtt_ns / 2

    def progress(self) -> None:
        """Something was answered: the back-off ends."""
        self.backoff = 1

    def expired(self) -> None:
        """The timeout fired: the next one is twice as long."""
        self.backoff = min(MAX_BACKOFF, 2 * self.backoff)

    def ns(self) -> int:
        """The timeout now."""
        base = self.srtt + 4 * self.rttvar if self.srtt else 0.0
        return int(max(self.floor_ns, base)) * self.backoff
