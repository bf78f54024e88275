"""The gradfabric packet and its versioned binary codec.

Layout (little-endian, 32-byte header, then ``count`` 4-byte values)::

    magic u16 | version u8 | priority u8 | flags u16 | job_id u16 |
    worker_id u16 | fan_in u16 | layer u16 | count u16 |
    seq u32 | agg_index u32 | bitmap u64 | payload: count x (int32 | float32)

``bitmap`` is the set of contributions a packet carries: a worker's own packet
has just its bit (``1 << worker_id``); a partial aggregate flushed to the
parameter server carries every contributor's bit. ``worker_id`` is the
*sender* (whom to answer): it differs from the contribution's bit only in a
``HELP`` packet, where a helper sends a straggler's share under the
straggler's bit. This makes "merge by bitmap"
one rule for every hop. One bitmap word bounds the fan-in of one aggregation
point to 64; larger jobs aggregate hierarchically (leaf, then spine). The
wire bounds ``fan_in`` and the bitmap by that word, not ``worker_id``: a
sender may be any of a u16's values (OmniReduce's aggregators and DLCP's
server name their peers by it and keep no bitmap of them), and every engine
drops a sender outside its own job as foreign (in-network aggregation: not
below ``fan_in``). Where
a job's levels meet at one receiver (ATP's PS behind two levels, a PS job
of more than 64 workers), ``layer`` says whose bits these are: 0 the top
level's children (racks, or the workers of a one-level job), ``g + 1`` the
workers of group ``g`` (``proto.ps.PsJob.groups``). The other protocols
give ``layer`` their own meaning (a tensor, a bucket).

``decode`` raises only ``ProtocolError``: it is fed untrusted bytes.

Sequence numbers never run out: a job numbers its packets without bound
(64-bit in the native engines), and the wire carries the low 32 bits. A
receiver takes the sequence nearest to one it expects (``unwrap``, QUIC's
packet-number decoding, RFC 9000 A.3): every sequence a peer can still
send lies within a window of the expected one, far inside half of 2**32,
so the choice is never ambiguous, and a job trains across the wire's
limit as it trains below it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ProtocolError

MAGIC = 0x4647  # "GF"
VERSION = 1
HEADER = struct.Struct("<HBBHHHHHHIIQ")
HEADER_BYTES = HEADER.size
MAX_FAN_IN = 64
MAX_SENDERS = 1 << 16  # worker_id is a u16: senders 0..65535
SEQ_BITS = 32  # what the wire carries of a sequence number
SEQ_WRAP = 1 << SEQ_BITS
MAX_WIRE_VALUES = 16_000  # 64 KB of values: one UDP datagram (loopback, jumbo)
VALUE_BYTES = 4


def traffic_class(queue: int, drop: int) -> int:
    """The ``priority`` byte as a switch egress port reads it (DLCP), like
    DSCP: the high nibble picks the queue (strict priority, 0 served first),
    the low nibble the drop precedence within it (0 dropped last)."""
    return (queue << 4) | drop


class Flag:
    """Header flag bits (plain ints: enum arithmetic is too slow for the
    simulator's hot path; ``Final`` so that compiled code inlines them).
    Unknown bits are a protocol error."""

    NONE: Final = 0
    ACK: Final = 1 << 0  # an aggregated result travelling back to workers
    COLLISION: Final = 1 << 1  # the aggregator was held by another key; on to the PS
    RESEND: Final = 1 << 2  # a worker retransmission
    ECN: Final = 1 << 3  # congestion experienced on some hop
    OVERFLOW: Final = 1 << 4  # values did not fit the integer domain; sent as float
    FLOAT: Final = 1 << 5  # payload is float32 (else int32)
    PARTIAL: Final = 1 << 6  # a partial aggregate flushed from a switch to the PS
    HELP: Final = 1 << 7  # SA-ATP: a helper sending a straggler's share under its bit
    NOTIFY: Final = 1 << 8  # SA-ATP: the switch asking a helper to help (worker_id = straggler)
    NACK: Final = 1 << 9  # SwitchML: on a share, "name my losses"; from the switch, "resend seq"

    @staticmethod
    def names(flags: int) -> list[str]:
        return [k for k, v in _FLAG_NAMES if flags & v]


_FLAG_NAMES: Final = (
    ("ACK", Flag.ACK), ("COLLISION", Flag.COLLISION), ("RESEND", Flag.RESEND),
    ("ECN", Flag.ECN), ("OVERFLOW", Flag.OVERFLOW), ("FLOAT", Flag.FLOAT),
    ("PARTIAL", Flag.PARTIAL), ("HELP", Flag.HELP), ("NOTIFY", Flag.NOTIFY), ("NACK", Flag.NACK),
)  # fmt: skip
KNOWN_FLAGS: Final = sum(v for _, v in _FLAG_NAMES)

Payload = npt.NDArray[np.int32] | npt.NDArray[np.float32]


@dataclass
class Packet:
    """One packet. ``payload`` is None in the simulator's timing-only mode.

    Engines never mutate a payload they received or sent: they copy into their
    own buffers, so one array may be shared by many in-flight packets.
    """

    job_id: int
    worker_id: int
    seq: int
    agg_index: int = 0
    bitmap: int = 0
    fan_in: int = 1
    flags: int = 0
    priority: int = 0
    layer: int = 0
    count: int = 0
    payload: Payload | None = None

    def __init__(
        self, job_id: int, worker_id: int, seq: int, agg_index: int = 0, bitmap: int = 0,
        fan_in: int = 1, flags: int = 0, priority: int = 0, layer: int = 0, count: int = 0,
        payload: Payload | None = None,
    ) -> None:  # fmt: skip
        # written out: compiled (mypyc), the one ``dataclass`` generates stays interpreted
        self.job_id = job_id
        self.worker_id = worker_id
        self.seq = seq
        self.agg_index = agg_index
        self.bitmap = bitmap
        self.fan_in = fan_in
        self.flags = flags
        self.priority = priority
        self.layer = layer
        self.count = count
        self.payload = payload

    def clone(self) -> Packet:
        return Packet(
            self.job_id,
            self.worker_id,
            self.seq,
            self.agg_index,
            self.bitmap,
            self.fan_in,
            self.flags,
            self.priority,
            self.layer,
            self.count,
            self.payload,
        )

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)


def ina_packet(
    *, job_id: int, worker_id: int, seq: int, agg_index: int, bitmap: int, fan_in: int,
    flags: int = 0, priority: int = 0, layer: int = 0, count: int = 0,
    values: Payload | None = None,
) -> Packet:  # fmt: skip
    """A packet of in-network aggregation, the header's own meaning (SwitchML,
    ATP, ESA, SA-ATP and the parameter server): sequence ``seq`` of
    ``worker_id`` (or of an aggregate) for aggregator ``agg_index``, holding
    the contributions in ``bitmap`` of ``fan_in``. The other protocols, whose
    fields mean other things, build theirs with their own constructors
    (``proto.ring``, ``proto.omni``, ``proto.dlcp``). Keyword-only: a call
    names what each field is."""
    return Packet(job_id, worker_id, seq, agg_index, bitmap, fan_in, flags, priority, layer,
                  count, values)  # fmt: skip


def result_packet(
    *, job_id: int, sender: int, seq: int, count: int, values: Payload | None, fan_in: int = 1
) -> Packet:
    """What a ``Deliver`` hands the application when a whole unit completes
    (a ring or OmniReduce bucket, a DLCP tensor): ``seq`` and ``layer`` name
    the unit."""
    return Packet(job_id, sender, seq, 0, 0, fan_in, 0, 0, seq, count, values)


def encode(pkt: Packet, prefix: bytes = b"") -> bytes:
    """Serialise ``pkt`` (after ``prefix``, e.g. the emulator's token); raises
    ``ValueError`` for a packet we should never build."""
    want = np.float32 if pkt.flags & Flag.FLOAT else np.int32
    if pkt.payload is None and pkt.count:
        raise ValueError("cannot encode a timing-only packet (payload is None)")
    # no payload and no values: a control packet (a NOTIFY), sent with an empty one
    payload: np.ndarray = np.zeros(0, dtype=want) if pkt.payload is None else pkt.payload
    if pkt.count != len(payload) or pkt.count > MAX_WIRE_VALUES:
        raise ValueError(f"count {pkt.count} does not match payload or exceeds {MAX_WIRE_VALUES}")
    if payload.dtype.kind == "i" and want is np.int32 and payload.dtype != np.int32:
        # an engine's wider integer sum (OmniReduce keeps int64): fine if it fits
        if len(payload) and int(np.abs(payload).max()) > np.iinfo(np.int32).max:
            raise ValueError("an integer payload does not fit int32")
        payload = payload.astype(np.int32)
    if payload.dtype != want:
        raise ValueError(f"payload dtype {payload.dtype} does not match flags ({want})")
    head = HEADER.pack(
        MAGIC,
        VERSION,
        pkt.priority,
        pkt.flags,
        pkt.job_id,
        pkt.worker_id,
        pkt.fan_in,
        pkt.layer,
        pkt.count,
        pkt.seq & (SEQ_WRAP - 1),
        pkt.agg_index,
        pkt.bitmap,
    )
    wire = np.ascontiguousarray(payload, dtype="<i4" if want is np.int32 else "<f4")
    return b"".join((prefix, head, wire.data))  # one copy of the values


def decode(data: bytes) -> Packet:
    """Parse untrusted bytes. Raises ``ProtocolError`` and nothing else."""
    if len(data) < HEADER_BYTES:
        raise ProtocolError(f"short packet: {len(data)} bytes < header {HEADER_BYTES}")
    (
        magic,
        version,
        priority,
        flags,
        job_id,
        worker_id,
        fan_in,
        layer,
        count,
        seq,
        agg_index,
        bitmap,
    ) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version} (this build speaks {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}")
    if not 1 <= fan_in <= MAX_FAN_IN:
        raise ProtocolError(f"fan_in {fan_in} outside 1..{MAX_FAN_IN}")
    if bitmap >> fan_in:
        raise ProtocolError(f"bitmap 0x{bitmap:x} names contributors beyond fan_in {fan_in}")
    if count > MAX_WIRE_VALUES:
        raise ProtocolError(f"count {count} > {MAX_WIRE_VALUES}")
    if len(data) != HEADER_BYTES + count * VALUE_BYTES:
        raise ProtocolError(f"length {len(data)} != header + {count} values")
    dtype = "<f4" if flags & Flag.FLOAT else "<i4"
    payload = np.frombuffer(data, dtype=dtype, count=count, offset=HEADER_BYTES)
    # A read-only view of the datagram where the wire order is the machine's
    # (engines never write into a packet's payload; they copy into their own).
    native: Payload
    if flags & Flag.FLOAT:
        native = payload if payload.dtype == np.float32 else payload.astype(np.float32)
        if not np.all(np.isfinite(native)):
            raise ProtocolError("non-finite float payload")
    else:
        native = payload if payload.dtype == np.int32 else payload.astype(np.int32)
    return Packet(
        job_id, worker_id, seq, agg_index, bitmap, fan_in, flags, priority, layer, count, native
    )


def unwrap(wire: int, expected: int) -> int:
    """The sequence whose low 32 bits are ``wire`` nearest to ``expected``
    (RFC 9000's packet-number decoding); never below 0."""
    half = SEQ_WRAP // 2
    candidate = (expected & ~(SEQ_WRAP - 1)) | wire
    if candidate <= expected - half:
        candidate += SEQ_WRAP
    elif candidate > expected + half and candidate >= SEQ_WRAP:
        candidate -= SEQ_WRAP
    return candidate


def unwrapped(pkt: Packet, expected: int) -> Packet:
    """``pkt`` with the sequence it carries unwrapped nearest ``expected``
    (in place: a receiver's fresh packet)."""
    pkt.seq = unwrap(pkt.seq, expected)
    return pkt


def wire_bytes(count: int, values_per_packet: int) -> int:
    """Bytes on the wire for ``count`` values cut into packets of ``values_per_packet``.

    A simulated packet may stand for a train of real packets (coarse
    granularity): it pays one header per real packet.
    """
    packets = max(1, -(-count // values_per_packet))
    return packets * HEADER_BYTES + count * VALUE_BYTES
