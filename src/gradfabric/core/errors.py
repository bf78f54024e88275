"""The two kinds of error at gradfabric's boundaries.

*Local* errors are misuse of the API or a bad config: they raise
``ConfigError`` (a ``ValueError``) naming the field and what is allowed.
*Remote* errors come from bytes or packets we do not control: decoding raises
``ProtocolError`` only, and drivers turn it into a counted drop, never a crash.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ProtocolError(Exception):
    """Untrusted input (bytes or a packet) violates the wire protocol."""


class PeerTimeoutError(TimeoutError):
    """A peer did not answer within the configured timeout."""

    def __init__(self, peer: str, timeout_s: float) -> None:
        super().__init__(f"peer {peer} did not answer within {timeout_s:g} s")
        self.peer = peer
        self.timeout_s = timeout_s
