"""The differential harness for SA-ATP's helped host: ``net.hostpath``'s
``NativeHost`` (C) against ``ReferenceHost`` (``proto.host.HostEngine`` and
its envelope), driven by the same hypothesis-drawn steps.

A step is what a helped host meets: its own shares pushed (sometimes
skipping an iteration it was helped through), a straggler's share pushed
through a shadow stream from where the help starts, the switch's results
for what any stream sent and for what nobody on this host sent (someone
else helped it), ECN marks, loss notices, NOTIFYs (good, for another job,
naming a worker outside it), results in floats, forged tokens, truncated
datagrams, and time passing (retransmissions, and a stream giving up).

After every step both must have the same datagrams to send, byte for
byte, the same events (results, help requests, give-ups), the same next
deadline, the same streams' state and the same values in the sink; at the
end the same counters, stream by stream.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradfabric.core.errors import ConfigError
from gradfabric.net import hostpath
from gradfabric.net.hostpath import OWN, HostDriver, NativeHost, ReferenceHost
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.worker import WorkerEngine
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, decode, encode
from tests.native import require
from tests.property.test_differential import SETTINGS, _nonzero

require("the helped host", hostpath.PATH, hostpath.WHY_NOT, module=True)

TOKEN = bytes.fromhex("0123456789abcdef")
JOB, ME = 9, 1


@st.composite
def host_setups(draw: st.DrawFn) -> dict[str, int | str | bool]:
    """A helped host's job: its scheme's route, size, window, packet size, repair knobs."""
    return {
        "policy": draw(st.sampled_from(["atp", "esa", "switchml"])),
        "workers": draw(st.sampled_from([3, 4, 64])),
        "window": draw(st.integers(1, 8)),
        "vpp": draw(st.sampled_from([1, 3, 64])),
        "fast": draw(st.sampled_from([0, 0, 2])),
        "nack": draw(st.booleans()),
        "retries": draw(st.integers(1, 5)),
        "packets": draw(st.integers(1, 6)),  # an iteration's packets
        "first_seq": draw(st.sampled_from([0, 0, 1000])),  # where the job's sequences start
    }


def _own(setup: dict[str, int | str | bool]) -> WorkerEngine:
    workers = int(setup["workers"])
    names = tuple(f"w{r}" for r in range(workers))
    p = Placement(
        JOB, names, {"sw": names}, servers=("sw",), window=int(setup["window"]),
        pool_slots=64, slot_base=5, rto_ns=10_000, max_retries=int(setup["retries"]),
        values_per_packet=int(setup["vpp"]), resumable=True, fast_retransmit=int(setup["fast"]),
        nack=bool(setup["nack"]), takes_help=True, first_seq=int(setup.get("first_seq", 0)),
    )  # fmt: skip
    return SCHEMES.get(str(setup["policy"])).worker(p, ME)


STEPS = (
    "own", "help", "result", "result", "result", "result", "ahead", "ecn", "notice", "notify",
    "bad_notify", "float", "foreign", "forged", "malformed", "time", "time",
)  # fmt: skip
host_steps = st.lists(
    st.tuples(st.sampled_from(STEPS), st.integers(0, 2**16), st.integers(0, 30_000)),
    min_size=5, max_size=200,
)  # fmt: skip


def _values(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(2**20), 2**20, n, np.int32)


def _datagram(
    kind: str, seed: int, sent: list[int], it: int, setup: dict[str, int | str | bool]
) -> bytes | None:
    """What the switch (or a stranger) sends the host in a step."""
    workers, P, vpp = int(setup["workers"]), int(setup["packets"]), int(setup["vpp"])
    F = int(setup.get("first_seq", 0))
    if kind in ("notify", "bad_notify"):
        straggler = seed % workers if kind == "notify" else workers + seed % 3
        job = JOB if kind == "notify" or seed % 2 else JOB + 1
        pkt = Packet(job, straggler, F + it * P + seed % P, 0, 0, workers, Flag.NOTIFY, 0, 0, 0,
                     np.zeros(0, np.int32))  # fmt: skip
        return TOKEN + encode(pkt)
    if kind == "ahead":  # a result for what someone else sent for this host
        seq = F + it * P + seed % (3 * P)
    elif not sent:
        return None
    else:
        seq = sent[seed % len(sent)]
    flags = Flag.ACK | {"ecn": Flag.ECN, "float": Flag.FLOAT}.get(kind, 0)
    values: np.ndarray = _values(seed, vpp)
    if kind == "float":
        values = values.astype(np.float32)
    pkt = Packet(JOB, 0, seq, 0, (1 << workers) - 1 if workers < 64 else 2**64 - 1, workers,
                 flags, 0, 0, vpp, values)  # fmt: skip
    if kind == "foreign":
        pkt.job_id = JOB + 1
    if kind == "notice":
        pkt = Packet(JOB, ME, seq, 0, 1 << ME, workers, Flag.NACK, 0, 0, 0, np.zeros(0, np.int32))
    data = TOKEN + encode(pkt)
    if kind == "forged":
        return bytes(TOKEN_BYTES) + data[TOKEN_BYTES:]
    if kind == "malformed":
        return data[: TOKEN_BYTES + HEADER_BYTES - 1 - seed % 5]
    return data


@SETTINGS
@given(setup=host_setups(), script=host_steps)
def test_the_native_helped_host_equals_the_reference(
    setup: dict[str, int | str | bool], script: list[tuple[str, int, int]]
) -> None:
    P, vpp, workers = int(setup["packets"]), int(setup["vpp"]), int(setup["workers"])
    iterations = 2 + len(script) // 4
    F = int(setup["first_seq"])  # iteration i's sequences: F + i P ..
    sinks = [np.zeros((F + iterations * P) * vpp, np.int64) for _ in range(2)]
    ref = ReferenceHost(_own(setup), TOKEN, sinks[0])
    nat = NativeHost(_own(setup), TOKEN, sinks[1])
    sent: list[int] = []
    streams = [OWN]
    now, it = 0, 0

    def compare() -> None:
        a, b = ref.datagrams_to_send(now), nat.datagrams_to_send(now)
        assert b == a
        sent.extend(decode(d[TOKEN_BYTES:]).seq for d in a)
        assert nat.events() == ref.events()
        assert nat.get_timer() == ref.get_timer()
        assert [nat.state(s) for s in streams] == [ref.state(s) for s in streams]
        assert np.array_equal(sinks[0], sinks[1])

    try:
        for kind, seed, dt in script:
            now += dt
            if kind == "own" and it < iterations:  # this iteration's share, or the next one's
                it += seed % 2
                if it < iterations and ref.state().next_seq <= F + it * P:
                    for h in (ref, nat):
                        h.push(_values(seed, P * vpp - seed % vpp), now, F + it * P)
                    it += 1
            elif kind == "help":  # a straggler's share, from where the help starts
                s = (ME + 1 + seed % (workers - 1)) % workers
                start = max(ref.state().base, F + it * P - seed % (P + 1))
                end = F + (it + 1) * P
                st_ = ref.state(s)
                if s not in streams:
                    streams.append(s)
                if st_.idle and st_.next_seq <= start < end and end <= F + iterations * P:
                    for h in (ref, nat):
                        h.skip_to(s, start)
                        h.push(_values(seed, (end - start) * vpp), now, start, stream=s)
                else:
                    nat.state(s)  # (made in both)
            elif kind == "time":
                ref.handle_timer(now)
                nat.handle_timer(now)
            else:
                data = _datagram(kind, seed, sent, it, setup)
                if data is None:
                    continue
                ref.receive_datagram(data, now)
                nat.receive_datagram(data, now)
            compare()
        for s in streams:
            assert _nonzero(nat.counters(s)) == _nonzero(ref.counters(s)), s
    finally:
        nat.close()


def test_a_push_behind_the_stream_or_for_itself_is_refused_in_both() -> None:
    setup: dict[str, int | str | bool] = {
        "policy": "atp", "workers": 4, "window": 4, "vpp": 4, "fast": 0, "nack": True,
        "retries": 3, "packets": 2, "first_seq": 0,
    }  # fmt: skip
    for h in (ReferenceHost(_own(setup), TOKEN, np.zeros(64, np.int64)),
              NativeHost(_own(setup), TOKEN, np.zeros(64, np.int64))):  # fmt: skip
        h.push(_values(0, 8), 0, 4)
        with pytest.raises(ValueError):
            h.push(_values(0, 8), 0, 2)
        with pytest.raises(ConfigError, match="another worker"):
            h.push(_values(0, 8), 0, 6, stream=ME)
        with pytest.raises(ValueError):
            h.skip_to(OWN, 0)
        with pytest.raises(ValueError, match="int32"):
            h.push(np.zeros(4, np.int64), 0, 8)
        h.close()
        assert h.counters()["drop_bad_token"] == 0  # readable after close
    nat = NativeHost(_own(setup), TOKEN, np.zeros(64, np.int64))
    nat.close()
    with pytest.raises(RuntimeError, match="closed"):
        nat.push(_values(0, 8), 0, 4)


@pytest.mark.parametrize("impl", [ReferenceHost, NativeHost])
def test_a_host_whose_switch_went_silent_gives_up_on_it(impl: type[ReferenceHost]) -> None:
    """On real sockets, through the driver: a switch that never answers
    gets every packet and its retransmissions, then the host's own stream
    gives up (what the application turns into the switch's timeout)."""
    setup: dict[str, int | str | bool] = {
        "policy": "atp", "workers": 3, "window": 8, "vpp": 4, "fast": 0, "nack": False,
        "retries": 2, "packets": 2,
    }  # fmt: skip

    async def run() -> tuple[int, int]:
        switch = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        switch.bind(("127.0.0.1", 0))
        switch.setblocking(False)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        h = impl(_own(setup), TOKEN, np.zeros(64, np.int64))
        d = HostDriver(h, sock, switch.getsockname(), lambda s, c: None, lambda s, f: None)
        d.push(_values(0, 8), at_seq=0)
        stream = await asyncio.wait_for(d.gave_up, 10)
        d.close()
        got = 0
        while True:
            try:
                decode(switch.recv(1 << 16)[TOKEN_BYTES:])
            except BlockingIOError:
                break
            got += 1
        switch.close()
        return stream, got

    stream, got = asyncio.run(run())
    assert stream == OWN
    assert got == 2 * (1 + 2)  # two packets, each sent and resent twice, then given up


@pytest.mark.parametrize("impl", [ReferenceHost, NativeHost])
def test_a_callback_that_raises_fails_the_job_and_the_rest_still_arrive(
    impl: type[ReferenceHost],
) -> None:
    """The application's callback raises on the first result: ``gave_up``
    holds that exception, every other result of the batch is still handed
    over, and closing the driver twice, or reading counters after, is safe."""
    setup: dict[str, int | str | bool] = {
        "policy": "atp", "workers": 3, "window": 8, "vpp": 4, "fast": 0, "nack": False,
        "retries": 50, "packets": 4,
    }  # fmt: skip

    async def run() -> tuple[list[int], BaseException | None, int]:
        switch = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        switch.bind(("127.0.0.1", 0))
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        seen: list[int] = []

        def on_result(seq: int, count: int) -> None:
            seen.append(seq)
            if len(seen) == 1:
                raise RuntimeError("the application failed")

        h = impl(_own(setup), TOKEN, np.zeros(64, np.int64))
        d = HostDriver(h, sock, switch.getsockname(), on_result, lambda s, f: None)
        d.push(_values(0, 16), at_seq=0)
        for seq in range(4):  # the switch answers every packet, in one burst
            res = Packet(JOB, 0, seq, 0, 7, 3, Flag.ACK, 0, 0, 4, _values(seq, 4))
            switch.sendto(TOKEN + encode(res), sock.getsockname())
        with pytest.raises(RuntimeError, match="application failed"):
            await asyncio.wait_for(asyncio.shield(d.gave_up), 10)

        async def all_in() -> None:
            while len(seen) < 4:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_in(), 10)
        d.close()
        d.close()
        switch.close()
        return seen, d.gave_up.exception(), h.counters()["results"]

    seen, error, results = asyncio.run(run())
    assert sorted(seen) == [0, 1, 2, 3]
    assert isinstance(error, RuntimeError)
    assert results == 4
