"""The switch daemon's counters for Prometheus, served on ``metrics_port``.

``DaemonMetrics`` reads the daemon's counters when scraped
(``prometheus_client``'s custom-collector protocol); ``serve_metrics`` answers
any HTTP request on the metrics port with the exposition text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gradfabric.core.trace import Counters


class Daemon(Protocol):
    """What the metrics read of the daemon (``runtime.switchd.SwitchDaemon``)."""

    jobs: dict[int, Any]  # id -> ``runtime.control.DaemonJob``
    counters: Counters
    cfg: Any

    def own_counters(self) -> list[Counters]: ...

    def engine_counters(self) -> list[Counters]: ...

    def occupancy(self) -> int: ...


def registry(daemon: Daemon) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonMetrics(daemon))
    return reg


async def serve_metrics(
    reg: CollectorRegistry, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        await reader.readline()
        body = generate_latest(reg)
        writer.write(
            f"HTTP/1.0 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


class DaemonMetrics:
    """The daemon's counters in Prometheus's exposition format, read when
    scraped (``prometheus_client``'s custom-collector protocol). Counters get
    the ``_total`` suffix; drops carry their reason and, where the datagram
    named a registered job, the job; the engines' own counters (per reason,
    not per job) are ``events``."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        rx = CounterMetricFamily(
            "gradfabric_switch_datagrams_received", "Datagrams accepted for a job", labels=["job"]
        )
        drops = CounterMetricFamily(
            "gradfabric_switch_dropped_datagrams",
            "Datagrams dropped, by reason; job is the registered job the datagram named, "
            "empty where it named none",
            labels=["job", "reason"],
        )
        events = CounterMetricFamily(
            "gradfabric_switch_events",
            "Events counted by the daemon and its engines (drops inside an engine included)",
            labels=["event"],
        )
        workers = GaugeMetricFamily(
            "gradfabric_switch_job_workers", "Workers of each registered job", labels=["job"]
        )
        unjobbed = Counters()  # the daemon's and the node's: no job to charge them to
        for c in d.own_counters():  # (first: a native node's counters are read now)
            for k, v in c.items():
                unjobbed[k] += v
        for k, v in unjobbed.items():
            if k.startswith("drop_"):
                drops.add_metric(["", k.removeprefix("drop_")], v)
        for job in d.jobs.values():
            name = str(job.job_id)
            rx.add_metric([name], job.counters.get("rx_datagrams", 0))
            workers.add_metric([name], job.workers)
            for k, v in job.counters.items():
                if k.startswith("drop_"):
                    drops.add_metric([name, k.removeprefix("drop_")], v)
        for counters in d.engine_counters():
            for k, v in counters.items():
                events.add_metric([k], v)
        yield rx
        yield drops
        yield events
        yield workers
        yield GaugeMetricFamily("gradfabric_switch_jobs", "Registered jobs", value=len(d.jobs))
        yield GaugeMetricFamily("gradfabric_switch_slots", "Aggregator slots", value=d.cfg.slots)
        yield GaugeMetricFamily(
            "gradfabric_switch_slots_occupied", "Aggregator slots held by jobs",
            value=d.occupancy(),
        )  # fmt: skip
        yield CounterMetricFamily(
            "gradfabric_switch_datagrams_sent", "Datagrams sent", value=unjobbed["tx_datagrams"]
        )
