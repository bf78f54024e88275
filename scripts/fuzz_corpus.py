"""Write the fuzzers' seed corpus (fuzz/corpus): valid traffic for every
policy in the op stream of fuzz/ops.h, made by driving the Python
reference engines, and one regression input for each fault found in the
native code (``regress-*``). Run again after a change to the op stream:

    .venv/bin/python scripts/fuzz_corpus.py
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from gradfabric.proto.dlcp import dlcp_control, dlcp_data
from gradfabric.proto.routes import atp_index
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.worker import ResumableWorker
from gradfabric.proto.worker_node import WorkerNode
from gradfabric.wire.packet import Flag, Packet, decode, encode

ROOT = Path(__file__).resolve().parent.parent / "fuzz" / "corpus"
SCHEMES_C = ("switchml", "atp", "esa", "ps", "dlcp")
WORKERS = (3, 2, 64, 1)
VPP = (1, 3, 300, 16000)


def op(kind: int, payload: bytes = b"") -> bytes:
    return struct.pack("<BH", kind, len(payload)) + payload


def switch_seed(scheme: int, window: int, njobs: int, rounds: int, seed: int) -> bytes:
    """Every job's workers send ``rounds`` windows of shares, some twice."""
    rng = np.random.default_rng(seed)
    slots = njobs * window
    out = bytes([scheme, window, njobs - 1, 0])
    for seq in range(rounds * window):
        for k in range(njobs):
            job, workers = k + 1, WORKERS[k]
            agg = k * window + seq % window if scheme == 0 else atp_index(job, seq, slots)
            for w in range(min(workers, 4) if workers != 64 else 64):
                vals = rng.integers(-1000, 1000, 5, dtype=np.int32)
                flags = Flag.NACK if scheme == 0 and rng.random() < 0.5 else 0
                pkt = Packet(job, w, seq, agg, 1 << w, workers, flags, int(rng.integers(4)), 0,
                             5, vals)  # fmt: skip
                out += op(0, bytes([job]) * 8 + encode(pkt))
                if rng.random() < 0.1:
                    out += op(0, bytes([job]) * 8 + encode(pkt))  # a duplicate
            out += op(1)
    return out + op(2, b"\0") + op(0, b"junk") + op(4, b"\1") + op(1)


def dlcp_seed(window: int, njobs: int, seed: int) -> bytes:
    """Every DLCP job's workers push two tensors (a tenth of the packets
    lost, some twice), time passes for the server's requests and probes,
    and the workers ACK the first tensor's sum and ask for a range of the
    second's (the fourth job is a background job: its datagrams only count)."""
    rng = np.random.default_rng(seed)
    pp = 256 if window == 8 else 1 + window
    out = bytes([4, window, njobs - 1, 0])
    for tensor in (0, 1):
        n = 2 * pp + 1
        for k in range(njobs):
            job, workers = k + 1, WORKERS[k]
            for w in range(workers):
                vals = rng.standard_normal(n).astype(np.float32)
                for lo in range(0, n, pp):
                    if rng.random() < 0.1:
                        continue  # lost
                    pkt = dlcp_data(job_id=job, sender=w, tensor=tensor, offset=lo, length=n,
                                    priority=int(rng.integers(0x14)), count=min(n, lo + pp) - lo,
                                    values=vals[lo : lo + pp])  # fmt: skip
                    out += op(0, bytes([job]) * 8 + encode(pkt)) * (2 if rng.random() < 0.1 else 1)
        out += op(1) + op(3, struct.pack("<I", 5000 * (1 + window))) + op(1)
    for k in range(njobs):
        for w in range(WORKERS[k]):
            for tensor, flags, span in ((0, Flag.ACK, 0), (1, Flag.RESEND, pp + 1)):
                pkt = dlcp_control(job_id=k + 1, sender=w, flags=flags, tensor=tensor, about=0,
                                   offset=1, span=span)  # fmt: skip
                out += op(0, bytes([k + 1]) * 8 + encode(pkt))
    return out + op(1) + op(3, struct.pack("<I", 100_000)) + op(1) + op(4, b"\0") + op(1)


def worker_seed(route: int, window: int, vpp_sel: int, flags: int, seed: int) -> bytes:
    """A reference worker's collectives answered by a switch that loses
    some results, recorded as ops."""
    rng = np.random.default_rng(seed)
    policy = ("switchml", "atp", "ps")[route]
    names = ("w0", "w1", "w2")
    p = Placement(7, names, {"sw": names}, servers=("sw",), window=window, pool_slots=64,
                  slot_base=5, rto_ns=10_000, max_retries=5, values_per_packet=VPP[vpp_sel],
                  resumable=True, fast_retransmit=3 if flags & 1 else 0, nack=bool(flags & 2),
                  takes_help=False)  # fmt: skip
    engine = SCHEMES.get(policy).worker(p, 1)
    assert isinstance(engine, ResumableWorker)
    node = WorkerNode(engine, bytes([7]) * 8, 0, 1.0 if flags & 4 else 0.0)
    out, now = bytes([route, window - 1, vpp_sel, flags]), 0
    for _ in range(2):
        n = int(rng.integers(1, 3 * VPP[vpp_sel] + 2))
        out += op(3, struct.pack("<I", n - 1))
        node.push(np.zeros(n, np.int32), np.zeros(n, np.int64), now)
        for _ in range(200):
            if node.done:
                break
            now += 1000
            out += op(2, struct.pack("<I", 1000)) + op(1)
            node.handle_timer(now)
            for d in node.datagrams_to_send(now):
                pkt = decode(d[8:])
                if rng.random() < 0.1:
                    continue  # lost
                res = Packet(7, 0, pkt.seq, 0, 7, 3, Flag.ACK, 0, 0, pkt.count,
                             np.ones(pkt.count, np.int32))  # fmt: skip
                data = bytes([7]) * 8 + encode(res)
                out += op(0, data)
                node.receive_datagram(data, now)
    return out + op(4, b"\2") + op(1) + op(5)


def host_seed(cfg: bytes, steps: list[tuple[int, bytes]]) -> bytes:
    """A helped host's config, then its ops (fuzz/host.c reads them)."""
    return cfg + b"".join(op(k, p) for k, p in steps)


def host_seeds() -> dict[str, bytes]:
    """Shares, help, the switch's results (some ahead, some for another job,
    in floats, with ECN), notices and NOTIFYs, time to a give-up."""
    token = bytes([9]) * 8

    def res(seq: int, workers: int, vpp: int, flags: int = 0, job: int = 9) -> bytes:
        v = np.arange(vpp, dtype=np.int32) * (seq + 1)
        full = 2**workers - 1 if workers < 64 else 2**64 - 1
        values = v.astype(np.float32) if flags & Flag.FLOAT else v
        return token + encode(Packet(job, 0, seq, 0, full, workers, Flag.ACK | flags, 0, 0, vpp,
                                     values))  # fmt: skip

    def ctl(worker: int, seq: int, workers: int, flags: int) -> bytes:
        return token + encode(Packet(9, worker, seq, 0, 0 if flags & Flag.NOTIFY else 2, workers,
                                     flags, 0, 0, 0, np.zeros(0, np.int32)))  # fmt: skip

    u32 = struct.Struct("<I").pack
    tick = (2, u32(10_001))
    help_ = [
        (3, u32(8) + b"\0"), (1, b""), (0, ctl(2, 1, 4, Flag.NOTIFY)), (4, bytes([2, 0, 8, 0])),
        (1, b""), *[(0, res(s, 4, 3)) for s in (0, 2, 1)], (0, ctl(1, 3, 4, Flag.NACK)),
        (5, b""), (2, u32(20_000)), (1, b""), (3, u32(5) + b"\2"), (0, res(9, 4, 3)),
        (0, res(8, 4, 3)), (6, b""), (5, b""), (7, b"\3"),
    ]  # fmt: skip
    ahead = [
        (3, u32(6) + b"\0"), (1, b""), (0, res(1, 3, 1, Flag.ECN)), (0, res(2, 3, 1)),
        (0, res(7, 3, 1)), (0, res(0, 3, 1, Flag.FLOAT)), (0, res(5, 3, 1, job=10)),
        (0, ctl(7, 0, 3, Flag.NOTIFY)), (0, bytes(12)), *[tick] * 9, (1, b""), (5, b""),
    ]  # fmt: skip
    wide = [
        (3, u32(900) + b"\0"), (4, bytes([63, 1, 0x20, 0x03])), (6, b""), (1, b""), *[tick] * 8,
        (5, b""), (7, b"\0"),
    ]  # fmt: skip
    return {
        "hashed-help": host_seed(bytes([1, 3, 1, 0b1010]), help_),
        "static-fast-ahead": host_seed(bytes([0, 1, 0, 0b100001]), ahead),
        # a shadow for worker 63 of 64 (its bit: a shift the sanitizer caught)
        "regress-shadow-bit-63": host_seed(bytes([1, 7, 2, 0b10000]), wide),
    }


def main() -> None:
    for name, data in host_seeds().items():
        (ROOT / "host").mkdir(parents=True, exist_ok=True)
        (ROOT / "host" / name).write_bytes(data)
    for name in ("switch_node", "worker", "quant"):
        (ROOT / name).mkdir(parents=True, exist_ok=True)
    for scheme in range(4):
        for window, njobs in ((1, 1), (4, 3), (2, 4)):
            path = ROOT / "switch_node" / f"{SCHEMES_C[scheme]}-w{window}-j{njobs}"
            path.write_bytes(switch_seed(scheme, window, njobs, 3, scheme * 10 + window))
    for window, njobs in ((1, 1), (4, 3), (8, 4), (2, 2)):
        path = ROOT / "switch_node" / f"dlcp-w{window}-j{njobs}"
        path.write_bytes(dlcp_seed(window, njobs, window))
    for route in range(3):
        for flags in (0, 3, 7, 16 | 4):
            path = ROOT / "worker" / f"{('static', 'hashed', 'one')[route]}-f{flags}"
            path.write_bytes(worker_seed(route, 4, 2 if route else 1, flags, route * 100 + flags))
    # regressions: a share of no values to a copy or an aggregator never
    # filled (memcpy from NULL); a take of an outbox never used (pointer
    # arithmetic on NULL, found by the fuzzer); a block of no values (the
    # quantiser looped for ever); a sum past 2**62 (a signed add overflowed)
    (ROOT / "switch_node" / "regress-take-empty-outbox").write_bytes(bytes([0, 1, 0, 0]) + op(1))
    # a range of no slots (SwitchML's slot of a sequence: a division by its size)
    zero = Packet(1, 0, 5, 0, 1, 3, 0, 0, 0, 4, np.ones(4, np.int32))
    (ROOT / "switch_node" / "regress-zero-slot-count").write_bytes(
        bytes([0, 0, 0, 1]) + op(0, bytes([1]) * 8 + encode(zero)) + op(1))
    for scheme in (0, 1):
        slots = 1
        agg = 0 if scheme == 0 else atp_index(1, 0, slots)
        empty = Packet(1, 0, 0, agg, 1, 3, 0, 0, 0, 0, np.zeros(0, np.int32))
        seed = bytes([scheme, 1, 0, 0]) + op(0, bytes([1]) * 8 + encode(empty)) + op(1)
        (ROOT / "switch_node" / f"regress-empty-share-{SCHEMES_C[scheme]}").write_bytes(seed)
    # a DLCP push announcing a tensor of 2**31 - 1 values, then its server's
    # timer (each request round scanned every value: a run timed out)
    huge = dlcp_data(job_id=1, sender=0, tensor=0, offset=0, length=2**31 - 1, priority=0,
                     count=1, values=np.ones(1, np.float32))  # fmt: skip
    (ROOT / "switch_node" / "regress-dlcp-huge-tensor").write_bytes(
        bytes([4, 1, 0, 0]) + op(0, bytes([1]) * 8 + encode(huge))
        + op(3, struct.pack("<I", 10_000)) * 3 + op(1))  # fmt: skip
    ones = np.ones(9, np.float32).tobytes()
    (ROOT / "quant" / "regress-block-0").write_bytes(bytes([8, 0]) + ones)
    (ROOT / "quant" / "regress-decode-2-62").write_bytes(
        bytes([9, 0]) + np.array([2**62 + 5, -(2**62)], np.int64).tobytes())
    rng = np.random.default_rng(0)
    for block in (1, 5, 200):
        x = rng.standard_normal(1000).astype(np.float32)
        (ROOT / "quant" / f"block{block}").write_bytes(bytes([block + 8, 20]) + x.tobytes())


if __name__ == "__main__":
    main()
