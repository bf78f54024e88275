"""Hosts in Linux network namespaces on one shaped star (root only).

``shaped_star(n, link_gbps)`` creates ``n`` host namespaces and a switch
namespace holding a bridge; each host has a veth to the bridge shaped with
``tbf`` to ``link_gbps`` in both directions (the kernel has no netem here, so
only rate is shaped; ``drop_udp`` adds random loss with nftables). Host ``i``
gets ``10.77.<k>.<i+1>/24`` on ``gfh<i>``. ``tor_star`` is the same star and
also yields the switch namespace as a host (``10.77.<k>.254`` on the bridge):
a process there sits where the top-of-rack switch does, one shaped hop from
every host and behind no shaped link of its own, which is where in-network
aggregation runs (host-to-host traffic, such as gloo's ring, is bridged past
it over the same two links per hop).
Everything is deleted on exit, also after an error. ``available()`` tells
whether namespaces can be made at all (tests skip where not).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from gradfabric.core.errors import ConfigError

T = TypeVar("T")

MTU = 9000  # jumbo frames, as in a datacenter; up to MAX_MTU where a run asks
MAX_MTU = 65_535  # a veth's largest: per-packet costs out of the way (see tor_star)


@dataclass(frozen=True)
class NsHost:
    netns: str
    ip: str
    ifname: str


def ip(*args: str) -> None:
    """``ip ARGS``, raising ``CalledProcessError`` (with its output) on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True)


def listed() -> set[str]:
    """The names of the network namespaces that exist now (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


_MADE: set[str] = set()  # the namespaces this process's stars made and did not delete


def left_behind() -> set[str]:
    """The namespaces this process's stars made, did not delete and that
    still exist: none once every star is closed (another process's, a
    concurrent run's, are not this process's to count)."""
    return _MADE & listed()


def free_tag() -> int:
    """A star's tag (its names and subnet) that no namespace here uses: this
    process's pid picks the first try, and a star left by a killed run (SIGKILL
    deletes nothing) or a concurrent one moves it on rather than failing."""
    taken = listed()
    for k in range(250):
        tag = (os.getpid() + k) % 250
        if not any(re.fullmatch(rf"gf{tag}[a-z]+\d*", n) for n in taken):
            return tag
    raise ConfigError("netns", "every star tag (gf0..gf249) is in use here")


def usable() -> bool:
    """Whether this process may make network namespaces here (root, and
    ``ip netns add`` works)."""
    return os.geteuid() == 0 and available()


def available() -> bool:
    name = f"gfprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError):
        return False
    ip("netns", "del", name)
    return True


def nft_available() -> bool:
    return shutil.which("nft") is not None


def drop_udp(host: NsHost, share: float, table: str = "gf") -> None:
    """Drop ``share`` of the UDP datagrams arriving in ``host``'s namespace, at
    random (nftables ``numgen random``; the kernel's own loss, where the
    emulator's user-space impairment is not wanted). TCP (control, gloo) is
    left alone. Deleted with the namespace."""
    if not 0 <= share < 1:
        raise ConfigError("share", f"must be in [0, 1), got {share}")
    if not nft_available():
        raise ConfigError("nft", "nftables is not installed (apt-get install nftables)")
    per_mille = round(share * 1000)
    script = (
        f"add table inet {table}\n"
        f"add chain inet {table} in {{ type filter hook input priority 0; }}\n"
        f"add rule inet {table} in meta l4proto udp numgen random mod 1000 < "
        f"{per_mille} counter drop\n"
    )
    subprocess.run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=script.encode(),
                   check=True, capture_output=True)  # fmt: skip


def udp_dropped(host: NsHost, table: str = "gf") -> int:
    """Datagrams ``drop_udp`` has dropped so far in ``host``'s namespace."""
    out = subprocess.run(
        ["ip", "netns", "exec", host.netns, "nft", "list", "table", "inet", table],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    m = re.search(r"counter packets (\d+)", out)
    if m is None:  # the rule is gone or never took: say so, not "nothing dropped"
        raise RuntimeError(f"no drop counter in {host.netns}'s nftables table {table}:\n{out}")
    return int(m.group(1))


CLONE_NEWNET = 0x40000000


def enter(host: NsHost) -> None:
    """Move the calling process (its thread; call it before starting any
    other) into ``host``'s namespace, and point gloo at ``host``'s link
    (``GLOO_SOCKET_IFNAME``): sockets made from now on are made there. For
    a process already running, where ``ip netns exec`` cannot be used (a
    ``torch.multiprocessing`` child)."""
    join_thread(host)
    os.environ["GLOO_SOCKET_IFNAME"] = host.ifname


def call_in(host: NsHost, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own inside ``host``'s namespace (a
    network namespace is per thread), for a process that must stay where it
    is: the sockets ``fn`` makes are made there. Nothing that starts
    processes may run there: a child (a forkserver too) would inherit it."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            join_thread(host)
            out.append(fn(*args))
        except BaseException as e:  # handed to the caller
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def join_thread(host: NsHost) -> None:
    """Move only the calling thread into ``host``'s namespace: sockets it
    makes from now on are made there, the process's other threads stay
    where they are; threads and processes it starts inherit it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{host.netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {host.netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally below


# A strict-priority egress port (``tor_star(classes=True)``): htb serves
# these classes in order, each may take the whole link when those above it
# are idle; packets no rule places go to the middle one (``DEFAULT_CLASS``).
CLASSES = ("1:10", "1:11", "1:12")
DEFAULT_CLASS = CLASSES[1]


def _tc(where: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", where, "tc", *args], check=True, capture_output=True)


def _shape(where: str, dev: str, rate: str, burst: str, queue_kb: int) -> None:
    """``dev``'s egress at ``rate``: one tbf FIFO (``queue_kb`` 0: 20 ms of
    queue), or strict priority over ``CLASSES`` with a ``queue_kb`` FIFO each
    (htb: every class guaranteed a sliver, ceiling the link, spare rate
    lent in class order, which is strict priority)."""
    if not queue_kb:
        _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
            "latency", "20ms")  # fmt: skip
        return
    default = DEFAULT_CLASS.split(":")[1]
    _tc(where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", default,
        "r2q", "1000")  # fmt: skip
    _tc(where, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
        "ceil", rate, "burst", burst, "cburst", burst)  # fmt: skip
    for prio, cls in enumerate(CLASSES):
        shape = ("ceil", rate, "burst", burst, "cburst", burst, "prio", str(prio))
        _tc(where, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb", "rate",
            "100kbit", *shape)  # fmt: skip
        _tc(where, "qdisc", "add", "dev", dev, "parent", cls, "bfifo", "limit",
            str(queue_kb * 1024))  # fmt: skip


def prioritise(host: NsHost, rules: list[str], table: str = "gfprio") -> None:
    """Place packets in ``CLASSES`` in ``host``'s namespace: each rule is an
    nftables match and a class (``"meta l4proto tcp" + " meta priority set
    1:10"``), applied to what the namespace sends, routes (a fabric's leaves
    and spines) and bridges (the switch namespace's ports). Deleted with the
    namespace."""
    if not nft_available():
        raise ConfigError("nft", "nftables is not installed (apt-get install nftables)")
    script = ""
    for family, hook in (("inet", "output"), ("inet", "forward"), ("bridge", "forward")):
        script += (
            f"add table {family} {table}\n"
            f"add chain {family} {table} {hook} {{ type filter hook {hook} priority 0; }}\n"
        )
        script += "".join(f"add rule {family} {table} {hook} {r}\n" for r in rules)
    subprocess.run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=script.encode(),
                   check=True, capture_output=True)  # fmt: skip


def class_stats(host: NsHost, dev: str) -> dict[str, dict[str, int]]:
    """Per class of ``dev``'s strict-priority port: packets sent and dropped."""
    out = subprocess.run(
        ["ip", "netns", "exec", host.netns, "tc", "-s", "class", "show", "dev", dev],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    stats = {}
    for m in re.finditer(r"class htb (\S+) .*?Sent \d+ bytes (\d+) pkt \(dropped (\d+)", out,
                         re.S):  # fmt: skip
        if m.group(1) in CLASSES:
            stats[m.group(1)] = {"sent": int(m.group(2)), "dropped": int(m.group(3))}
    return stats


def class_totals(nodes: list[NsHost]) -> dict[str, dict[str, int]]:
    """``class_stats`` summed over every veth port of ``nodes``' namespaces
    (a star's hosts and switch, a fabric's hosts, leaves and spines)."""
    total: dict[str, dict[str, int]] = {c: {"sent": 0, "dropped": 0} for c in CLASSES}
    for node in nodes:
        out = subprocess.run(["ip", "-n", node.netns, "-o", "link", "show", "type", "veth"],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
        for dev in re.findall(r"^\d+: ([^@:]+)", out, re.M):
            for c, st in class_stats(node, dev).items():
                for k, v in st.items():
                    total[c][k] += v
    return total


def veth(a: tuple[str, str], b: tuple[str, str], mtu: int) -> None:
    """A veth pair: interface ``a[1]`` in namespace ``a[0]``, its peer
    ``b[1]`` in ``b[0]``, both at ``mtu``."""
    ip("link", "add", a[1], "netns", a[0], "mtu", str(mtu), "type", "veth",
        "peer", "name", b[1], "netns", b[0], "mtu", str(mtu))  # fmt: skip


def sysctl(ns: str, *settings: str) -> None:
    """``sysctl -w`` each ``key=value`` of ``settings`` in namespace ``ns``."""
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", *settings], check=True,
                   capture_output=True)  # fmt: skip


@contextmanager
def namespaces() -> Iterator[Callable[[str], str]]:
    """Yields ``add(name)``, which makes a namespace (loopback up) and
    returns its name; every one made is deleted on exit, after an error or a
    SIGTERM too (a killed benchmark, a CI timeout)."""
    made: list[str] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None

    def add(name: str) -> str:
        ip("netns", "add", name)
        made.append(name)
        _MADE.add(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    try:
        yield add
    finally:
        for ns in reversed(made):
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
                _MADE.discard(ns)
        if main:
            signal.signal(signal.SIGTERM, previous)


def shape(where: str, dev: str, mbps: float, mtu: int, queue_kb: int) -> None:
    """``dev``'s egress at ``mbps`` (``_shape``), with enough tokens for line
    rate at 1 ms and at least two of the largest packets."""
    burst = f"{max(160, int(mbps * 0.16), 2 * mtu // 1000 + 1)}kb"
    _shape(where, dev, f"{int(mbps)}mbit", burst, queue_kb)


def bridged(
    ns: str, ifname: str, port: tuple[str, str], addr: str, mtu: int, mbps: float,
    queue_kb: int, gateway: str | None = None,
) -> NsHost:  # fmt: skip
    """Host namespace ``ns`` on a port of a bridge (``br0`` in ``port[0]``,
    the port named ``port[1]``): ``ifname`` at ``addr``/24, both ends shaped
    at ``mbps`` (``shape``), the default route via ``gateway`` if given."""
    sw, dev = port
    veth((ns, ifname), port, mtu)
    ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
    ip("-n", ns, "link", "set", ifname, "up")
    if gateway is not None:
        ip("-n", ns, "route", "add", "default", "via", gateway)
    sysctl(ns, "net.ipv4.tcp_slow_start_after_idle=0")
    ip("-n", sw, "link", "set", dev, "master", "br0", "up")
    for where, d in ((ns, ifname), (sw, dev)):
        shape(where, d, mbps, mtu, queue_kb)
    return NsHost(ns, addr, ifname)


@contextmanager
def shaped_star(n: int, link_gbps: float, mtu: int = MTU) -> Iterator[list[NsHost]]:
    with tor_star(n, link_gbps, mtu) as (hosts, _tor):
        yield hosts


TOR_HOST = 254  # the bridge's address in the switch namespace: 10.77.<k>.254


def check_mtu(mtu: int) -> None:
    """A link MTU a star can take (IPv6's minimum up to a veth's largest)."""
    if not 1280 <= mtu <= MAX_MTU:
        raise ConfigError("mtu", f"must be in 1280..{MAX_MTU}, got {mtu}")


@contextmanager
def tor_star(
    n: int, link_gbps: float, mtu: int = MTU, classes: bool = False, queue_kb: int = 256
) -> Iterator[tuple[list[NsHost], NsHost]]:
    """``n`` hosts on the shaped star, and the switch namespace as a host.

    ``classes``: every link's egress is a strict-priority port instead of one
    FIFO (``_shape``): the classes ``CLASSES`` name, each a ``queue_kb`` FIFO
    that drops at its tail; ``prioritise`` says which packets go where.

    ``mtu`` is every link's, so TCP (gloo) and UDP (the switch) get the same.
    Above the 9000 of jumbo frames it is no datacenter's, but it shows what
    the kernel's per-packet cost takes: every datagram crosses the whole
    stack of both namespaces (on a veth, the receiver's side runs in the
    sender's system call), while TCP hands the veth 64 KB segments at any
    MTU; a hardware switch and kernel-bypass workers pay no such cost."""
    if not 1 <= n < TOR_HOST:
        raise ConfigError("n", f"a star has 1..{TOR_HOST - 1} hosts, got {n}")
    if link_gbps <= 0:
        raise ConfigError("link_gbps", f"must be > 0, got {link_gbps}")
    check_mtu(mtu)
    tag = free_tag()
    with namespaces() as add:
        sw = add(f"gf{tag}sw")
        # no IGMP snooping: the bridge floods a job's multicast results to every
        # port, as a switch replicates them (``SwitchConfig.multicast``)
        ip("-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", sw, "link", "set", "br0", "up")
        ip("-n", sw, "addr", "add", f"10.77.{tag}.{TOR_HOST}/24", "dev", "br0")
        tor = NsHost(sw, f"10.77.{tag}.{TOR_HOST}", "br0")
        hosts = [
            bridged(add(f"gf{tag}h{i}"), f"gfh{i}", (sw, f"gfs{tag}x{i}"), f"10.77.{tag}.{i + 1}",
                    mtu, link_gbps * 1000, queue_kb if classes else 0)
            for i in range(n)
        ]  # fmt: skip
        yield hosts, tor
