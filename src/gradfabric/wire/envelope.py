"""The emulator's datagram: an 8-byte job token, then one gradfabric packet.

The token is the secret the switch hands a job at registration. The switch
checks it against the job named in the packet before the packet reaches any
engine, and workers check the switch's replies the same way, so a host that
does not know a job's token can neither add to its aggregates nor feed its
workers results. The token sits outside the packet header: the simulator
models the header the switch parses, and the token would be checked by the
switch's parser (like an IPsec SPI), not aggregated.
"""

from __future__ import annotations

import hmac
import struct

from gradfabric.core.errors import ProtocolError
from gradfabric.wire.packet import HEADER, Packet, decode, encode

TOKEN_BYTES = 8
_JOB = struct.Struct("<H")
_JOB_OFFSET = TOKEN_BYTES + 6  # magic u16, version u8, priority u8, flags u16, then job_id


class BadTokenError(ProtocolError):
    """A datagram carries a token other than its job's."""


def drop_reason(e: ProtocolError) -> str:
    """The counter a driver bumps for a datagram it could not accept."""
    return "drop_bad_token" if isinstance(e, BadTokenError) else "drop_malformed"


def seal(token: bytes, pkt: Packet) -> bytes:
    return encode(pkt, token)


def job_of(data: bytes) -> int:
    """The job id a datagram claims, before anything is trusted."""
    if len(data) < TOKEN_BYTES + HEADER.size:
        raise ProtocolError(f"short datagram: {len(data)} bytes")
    return int(_JOB.unpack_from(data, _JOB_OFFSET)[0])


def unseal(data: bytes, token: bytes) -> Packet:
    """Check ``data``'s token against ``token``, then decode its packet.
    Raises ``ProtocolError`` (``bad token`` or a malformed packet) and nothing else."""
    if not hmac.compare_digest(data[:TOKEN_BYTES], token):
        raise BadTokenError("bad token")
    return decode(data[TOKEN_BYTES:])
