"""DLCP's native worker (``net/native/dlcp_client.c``) and its driver.

``NativeDlcpEndpoint`` is a second implementation of what
``runtime.dlcp.DlcpClient`` runs: a ``proto.dlcp.DlcpEndpoint`` (one
receiver of the server's sums, one sender of the worker's gradients) behind
the UDP driver's envelope (``wire.envelope``: the job's token, then the
packet). It has the same datagram interface (``receive_datagram``,
``datagrams_to_send``, ``get_timer``, ``handle_timer``) and the same
counters under the same names, held equal to the reference datagram for
datagram by the differential harness (``tests/property/test_dlcp_native.py``).

``run`` serves it on a UDP socket with ``udp.c``'s ``gf_udp_run``, the GIL
released, until the next sum is in or nothing is left to do; ``begin`` on
another thread (DDP's, handing over its next bucket) wakes a run through an
eventfd. ``runtime.dlcp.DlcpClient`` keeps a thread in it.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net import datapath
from gradfabric.wire.envelope import TOKEN_BYTES

HERE = Path(__file__).parent
SOURCES = [HERE / "native" / f for f in ("dlcp_client.c", "switch_dlcp_classes.c", "dlcp.h",
                                         "wire.h")]  # fmt: skip
COUNTERS: Final = (
    "drop_foreign", "drop_malformed", "drop_bad_token", "duplicate", "probes_answered",
    "completed", "values_lost", "nacks", "packets", "resent_ranges", "probes",
    *(f"late_values_p{k}" for k in range(16)),
)  # fmt: skip (dlcp_client.c's C_* order)
# The finished sums a worker remembers (``DlcpReceiver``'s ``keep_done``): a
# probe of an older one, its ACK lost, reads as foreign.
KEEP_SUMS: Final = 64
DGRAM: Final = 65536

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_LIB, WHY_NOT = native.load(HERE / "_dlcp", SOURCES, (
    ("gf_dc_new", [_i64, _i64, _i64, _i64, _i64, ctypes.c_char_p], _p),
    ("gf_dc_free", [_p], None), ("gf_dc_counters", [_p, _p], None),
    ("gf_dc_begin", [_p, _i64, _p, _i64, _i64, ctypes.c_double, _p, _i64], ctypes.c_int),
    ("gf_dc_ready", [_p, _i64], ctypes.c_int), ("gf_dc_forget", [_p, _i64], None),
    ("gf_dc_idle", [_p], ctypes.c_int), ("gf_dc_settle", [_p], None),
    ("gf_dc_datagram", [_p, ctypes.c_char_p, _i64, _i64], ctypes.c_int),
    ("gf_dc_deadline", [_p], _i64), ("gf_dc_timer", [_p, _i64], ctypes.c_int),
    ("gf_dc_next", [_p, _p, _i64], _i64), ("gf_dc_ops", [], _p),
))  # fmt: skip
if _LIB is not None and datapath.UDP_WHY_NOT is not None:
    _LIB, WHY_NOT = None, f"its driver: {datapath.UDP_WHY_NOT}"
PATH = native.COMPILED if _LIB is not None else native.PYTHON


class NativeDlcpEndpoint:
    """Rank ``rank``'s DLCP endpoint in job ``job_id`` (see the module doc)."""

    def __init__(self, job_id: int, rank: int, per_packet: int, rto_ns: int, token: bytes,
                 keep: int = KEEP_SUMS) -> None:  # fmt: skip
        if _LIB is None:
            raise RuntimeError(f"the native DLCP client is not available: {WHY_NOT}")
        if len(token) != TOKEN_BYTES:
            raise ConfigError("token", f"{TOKEN_BYTES} bytes, got {len(token)}")
        self._lib = _LIB
        self.e = _LIB.gf_dc_new(job_id, rank, per_packet, rto_ns, keep, token)
        if not self.e:
            raise ConfigError("dlcp", f"no native endpoint for job {job_id} rank {rank}, "
                              f"{per_packet} values a packet, rto {rto_ns} ns, "
                              f"keep {keep}")  # fmt: skip
        self.ops = _LIB.gf_dc_ops()
        self.counters = Counters()
        self._buf = ctypes.create_string_buffer(DGRAM)
        # what C writes into, kept alive until the sum is in or given up
        self._held: dict[int, npt.NDArray[np.float32]] = {}

    def close(self) -> None:
        """Free the engine (no thread may be in it); its counters stay readable."""
        if self.e:
            self.fold()
            self._lib.gf_dc_free(self.e)
            self.e = None

    def _live(self) -> int:
        if not self.e:
            raise RuntimeError("the native DLCP endpoint is closed")
        return int(self.e)

    def begin(self, tensor: int, x: npt.NDArray[np.float32], back: bool, bound: float,
              out: npt.NDArray[np.float32], now_ns: int) -> None:  # fmt: skip
        """Push ``x`` (copied) as ``tensor``, its packets classed for the
        model's ``back`` half; ``tensor``'s sum goes to ``out`` once at
        least ``(1 - bound)`` of it is in (``ready``)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if out.dtype != np.float32 or not out.flags.c_contiguous or len(out) != len(x):
            raise ConfigError("out", f"a contiguous float32 array of {len(x)} values")
        if not 0 <= bound < 1:
            raise ConfigError("loss_bound", f"must be in [0, 1), got {bound}")
        rc = self._lib.gf_dc_begin(self._live(), tensor, x.ctypes.data, len(x), int(back), bound,
                                   out.ctypes.data, now_ns)  # fmt: skip
        if rc == -2:  # refused: an entry of that id keeps its own ``out``
            raise ConfigError("tensor", f"tensor id {tensor} of {len(x)} values")
        self._held[tensor] = out  # (C writes the sum there; it copied ``x``)
        if rc:
            raise MemoryError("the native DLCP client ran out of memory")

    def ready(self, tensor: int) -> bool:
        """Whether ``tensor``'s sum is in its ``out``."""
        done = bool(self._lib.gf_dc_ready(self._live(), tensor))
        if done:
            self._held.pop(tensor, None)
        return done

    def forget(self, tensor: int) -> None:
        """Give ``tensor`` up: its sum is no longer awaited, and a sum
        arriving later is foreign (``DlcpReceiver.forget``)."""
        self._lib.gf_dc_forget(self._live(), tensor)
        self._held.pop(tensor, None)

    # -- the datagram interface ------------------------------------------------
    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        if self._lib.gf_dc_datagram(self._live(), data, len(data), now_ns):
            raise MemoryError("the native DLCP client ran out of memory")

    def datagrams_to_send(self, now_ns: int) -> list[bytes]:
        out = []
        while (n := self._lib.gf_dc_next(self._live(), self._buf, DGRAM)) > 0:
            out.append(self._buf.raw[:n])
        return out

    def get_timer(self) -> int | None:
        d = int(self._lib.gf_dc_deadline(self._live()))
        return None if d < 0 else d

    def handle_timer(self, now_ns: int) -> None:
        if self._lib.gf_dc_timer(self._live(), now_ns):
            raise MemoryError("the native DLCP client ran out of memory")

    def fold(self) -> Counters:
        """The engine's counters, by the reference's names."""
        if self.e:
            c = np.zeros(len(COUNTERS), np.int64)
            self._lib.gf_dc_counters(self.e, c.ctypes.data)
            for name, v in zip(COUNTERS, c.tolist(), strict=True):
                self.counters[name] = v
        return self.counters

    # -- the driver --------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing queued, nothing unACKed, no sum awaited."""
        return bool(self._lib.gf_dc_idle(self._live()))

    def run(self, sock: socket.socket, peer: bytes, deadline_ns: int, abort: ctypes.c_int32,
            wake_fd: int, driver: Counters) -> int:  # fmt: skip
        """Serve every tensor in flight on ``sock`` (to ``peer``, a raw
        sockaddr) until a sum completes or the endpoint is idle
        (``datapath.DONE``), ``abort`` is raised or ``deadline_ns`` passes; a
        write to ``wake_fd`` sends what ``begin`` queued meanwhile."""
        self._lib.gf_dc_settle(self._live())
        rc = datapath.run_native(self.ops, self.e, sock, -1, wake_fd, peer, deadline_ns, abort,
                                 False, driver)  # fmt: skip
        if rc == datapath.OUT_OF_MEMORY:
            raise MemoryError("the native DLCP client ran out of memory")
        if rc == datapath.FAILED:  # (the engine never gives up on its server: a bug)
            raise RuntimeError("the native DLCP client's loop failed")
        return rc


def wake_fd() -> int:
    """An eventfd for ``run``'s ``wake_fd`` (``os.eventfd_write(fd, 1)`` wakes it)."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
