"""SA-ATP at the switch: detect a straggler, ask a leading worker to help.

Theory of operation
-------------------
The switch sees every worker's gradient packets, so it sees progress: the
highest sequence each worker has sent. In synchronous aggregation the leaders
can run at most a window ahead of the slowest worker before every aggregator
of the job waits on it. A *detector* (registered by name) turns progress into
a straggler; a *helper policy* chooses which worker helps, among those that
hold a replica of the straggler's data shard (worker ``s``'s shard is
replicated on ``s+1 .. s+replicas``, mod n: that is the storage help costs).

The switch then sends the helper a ``NOTIFY`` packet (``worker_id`` = the
straggler, ``seq`` = where help starts: the straggler's next unsent sequence,
or the start of the leaders' iteration if the straggler's progress is stale). The helper
computes the straggler's gradients from the replica and sends them flagged
``HELP`` under the straggler's bit; from then on whichever copy of a
straggler packet arrives first is aggregated and the other is a duplicate
dropped by the bitmap, so the sum is exactly the synchronous one. Requests
for one (straggler, iteration) stop once a HELP packet for it arrives, and
after ``max_requests`` (a lost NOTIFY is retried as packets keep coming).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Send
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.packet import Flag, Packet, ina_packet

Detector = Callable[[list[int], int], int | None]
HelperPolicy = Callable[[int, list[int], int, int], int | None]
DETECTORS: Registry[Detector] = Registry("straggler detector")
HELPERS: Registry[HelperPolicy] = Registry("helper policy")


@DETECTORS.register("progress-gap")
def progress_gap(progress: list[int], lag_packets: int) -> int | None:
    """The slowest worker, if the leader is ``lag_packets`` or more ahead of it."""
    slow = min(range(len(progress)), key=progress.__getitem__)
    return slow if max(progress) - progress[slow] >= lag_packets else None


def holders(straggler: int, n: int, replicas: int) -> list[int]:
    return [(straggler + k) % n for k in range(1, replicas + 1) if (straggler + k) % n != straggler]


@HELPERS.register("most-ahead")
def most_ahead(straggler: int, progress: list[int], n: int, replicas: int) -> int | None:
    """The replica holder that has sent the most (it has the most spare time)."""
    cands = holders(straggler, n, replicas)
    best = max(cands, key=lambda w: (progress[w], -w), default=None)
    return best if best is not None and progress[best] > progress[straggler] else None


@HELPERS.register("next-holder")
def next_holder(straggler: int, progress: list[int], n: int, replicas: int) -> int | None:
    """The first replica holder that is itself ahead of the straggler."""
    return next(
        (w for w in holders(straggler, n, replicas) if progress[w] > progress[straggler]), None
    )


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class HelpConfig:
    detector: str = "progress-gap"
    helper: str = "most-ahead"
    lag_packets: int = 64  # half the default ATP window: healthy workers drift less
    replicas: int = 2
    max_requests: int = 3  # per (straggler, iteration), until a HELP packet shows up
    iteration_packets: int = 0  # packets per iteration; 0: set by the runner

    def __post_init__(self) -> None:
        DETECTORS.get(self.detector)
        HELPERS.get(self.helper)
        if self.lag_packets < 1 or self.replicas < 1:
            raise ConfigError("lag_packets", "lag_packets and replicas must be >= 1")


@dataclass
class StragglerMonitor:
    cfg: HelpConfig
    job: SwitchJob
    counters: Counters
    progress: list[int] = field(default_factory=list)
    # (straggler, iteration) -> (requests sent, leader's progress then, helper)
    asked: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    help_seen: set[tuple[int, int]] = field(default_factory=set)
    helping: dict[int, int] = field(default_factory=dict)  # helper -> iteration it helps in

    def __post_init__(self) -> None:
        if self.cfg.iteration_packets < 1:
            raise ConfigError("iteration_packets", "the monitor needs packets per iteration")
        self.progress = [-1] * self.job.fan_in
        self.detect = DETECTORS.get(self.cfg.detector)
        self.choose = HELPERS.get(self.cfg.helper)

    def observe(self, pkt: Packet) -> list[Action]:
        it_len = self.cfg.iteration_packets
        if pkt.flags & Flag.HELP:
            s = pkt.bitmap.bit_length() - 1
            self.help_seen.add((s, pkt.seq // it_len))
            self.helping[pkt.worker_id] = pkt.seq // it_len
            return []
        w = pkt.worker_id
        if pkt.seq > self.progress[w]:
            self.progress[w] = pkt.seq
        view = self.progress
        lead = max(view)
        # A helper lags because it sends two shares: it is not a straggler.
        helpers_now = [i for i, it in self.helping.items() if it == lead // it_len]
        if helpers_now:
            view = view.copy()
            for i in helpers_now:
                view[i] = lead
        slow = self.detect(view, self.cfg.lag_packets)
        if slow is None:
            return []
        s = slow
        # Help in the iteration the leaders are in, from where the straggler is
        # (its progress may be stale: after being helped it skipped ahead).
        start = max(self.progress[s] + 1, lead // it_len * it_len)
        key = (s, start // it_len)
        if key in self.help_seen:
            return []
        prev = self.asked.get(key)
        if prev is None:
            # A worker already asked to help someone in this iteration is busy.
            busy = {h for (_, it), (_, _, h) in self.asked.items() if it == key[1]}
            cand = [-1 if i in busy else p for i, p in enumerate(self.progress)]
            h = self.choose(s, cand, self.job.fan_in, self.cfg.replicas)
            if h is None:
                return []
            self.asked[key] = (1, lead, h)
        else:  # a retry (the NOTIFY may be lost) goes to the same helper
            count, last_lead, h = prev
            if count >= self.cfg.max_requests or lead - last_lead < self.cfg.lag_packets:
                return []
            self.asked[key] = (count + 1, lead, h)
        self.counters["help_requests"] += 1
        # worker_id names the straggler; seq the first sequence to send for it
        note = ina_packet(
            job_id=self.job.job_id, worker_id=s, seq=start, agg_index=0, bitmap=1 << s,
            fan_in=self.job.fan_in, flags=Flag.NOTIFY,
        )  # fmt: skip
        return [Send(self.job.children[h], note)]
