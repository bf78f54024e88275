"""DDP hooks that return at once: each hook state's collectives on a thread of its own.

Theory of operation. DDP calls a communication hook from the autograd thread
as soon as a bucket's gradients are ready, and keeps computing the next
bucket's gradients only once the hook returns. A hook that runs its whole
collective before returning (a blocking switch round trip, a sparse exchange
of several gloo steps planned on the host) serialises communication with the
rest of backward. Here the hook only hands the bucket over and returns a
``torch.futures.Future``; the work runs on one communication thread per hook
state, which serves buckets first come, first served.

Why this is safe on every rank alike:

- DDP launches buckets in index order, the same on every rank (a bucket waits
  for the ones before it), so every rank's thread runs the same collectives
  in the same order.
- The thread's collectives go on a process group of their own (``group``,
  made with ``dist.new_group`` at the state's first bucket, on the autograd
  thread, where every rank makes it in the same program order). Collectives
  the main thread issues meanwhile (DDP's unused-parameter map, the user's
  own ``all_reduce``, a ``Join``'s shadow rounds) go on the default group and
  can never interleave with the thread's in a rank-dependent order.
- Work that needs no host decision (a dense all-reduce) skips the thread: the
  autograd thread starts it asynchronously on the default group, in bucket
  order, exactly as PyTorch's own ``allreduce_hook`` does (see
  ``Overlapped.dense``; a group of its own measured no faster).
- An error on the thread (a dead peer named by ``PeerTimeoutError``, a
  switch that stopped answering) completes the bucket's future with it; DDP
  raises it from ``backward()`` (as a ``RuntimeError`` carrying its type and
  text: the type does not cross DDP's C++ side; ``state.failure`` keeps it),
  so nothing hangs and the peer is still named. The thread goes on serving.

On a CUDA device the future is created for that device and the thread runs on
its own stream after an event recorded on the autograd thread's stream, so
the bucket's values are complete before the thread reads them and DDP's
consumers wait on the thread's stream through the future (untested here: no
GPU on the machines that run the suite).

The thread and the groups are process-local: a state pickles without them and
makes them again at its next bucket. They stop before the default group is
torn down (``net.launch.end_group``) or at exit, so no group outlives the
interpreter's orderly shutdown.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gradfabric.net import launch

if TYPE_CHECKING:  # torch is imported where a hook first runs: daemons never load it
    import torch

Job = Callable[[Any], "torch.Tensor"]  # job(group) -> the bucket's result
SPANS = 4096  # job spans a thread keeps (a step's buckets are a few dozen at most)
T = TypeVar("T")


class CommThread:
    """One daemon thread serving jobs in submission order, on ``group``."""

    def __init__(self, name: str) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend=dist.get_backend())
        self.jobs: queue.SimpleQueue[
            tuple[Callable[[Any], Any], torch.futures.Future[Any], Any] | None
        ]
        self.jobs = queue.SimpleQueue()
        self.failure: Exception | None = None  # the last job's error, typed
        self.cpu_s = 0.0  # this thread's CPU seconds in its jobs (its waits cost none)
        # (start, work, end) of its latest jobs, ``time.perf_counter`` seconds: when
        # each bucket took this thread, began its own work (after waiting for its
        # first stage, ``run_staged``) and ended (``Overlapped.spans_since``)
        self.spans: collections.deque[tuple[float, float, float]]
        self.spans = collections.deque(maxlen=SPANS)
        self._work: float | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self.thread.start()
        _LIVE.add(self)

    def working(self) -> None:
        """Called by a job on this thread: its own work begins now (what it
        waited for before is done)."""
        self._work = time.perf_counter()

    def submit(self, job: Job, like: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Queue ``job``; the returned future completes with its result or error."""
        return self.submit_raw(job, like).then(_unwrap)

    def submit_raw(
        self, job: Callable[[Any], Any], like: torch.Tensor
    ) -> torch.futures.Future[Any]:
        """Queue ``job``; the future completes with its result or its error
        object (typed: ``then`` would carry an error as a ``RuntimeError``)."""
        import torch

        if like.is_cuda:
            raw: torch.futures.Future[Any] = torch.futures.Future(devices=[like.device])
            ready: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()  # on the autograd thread's current stream: the bucket is written
        else:
            raw, ready = torch.futures.Future(), None
        self.jobs.put((job, raw, ready))
        return raw

    def _serve(self) -> None:
        import torch

        stream: Any = None
        while (item := self.jobs.get()) is not None:
            job, raw, ready = item
            c0, t0, self._work = time.thread_time(), time.perf_counter(), None
            try:
                if ready is None:
                    out = job(self.group)
                else:
                    stream = stream or torch.cuda.Stream()  # type: ignore[no-untyped-call]
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        out = job(self.group)
            except Exception as e:  # every error goes to the bucket's waiter
                self.failure, out = e, e
            # (counted before the result is out: a waiter that reads it sees this job's)
            self.cpu_s += time.thread_time() - c0
            self.spans.append((t0, self._work or t0, time.perf_counter()))
            try:
                with contextlib.nullcontext() if ready is None else torch.cuda.stream(stream):
                    raw.set_result(out)  # (on CUDA the future records on this stream)
            except Exception as e:  # a result the future refuses: its waiter gets why
                self.failure = e
                raw.set_result(e)

    def stop(self) -> None:
        """Serve what is queued, then end; drop the groups."""
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
        self.group = None


def _unwrap(raw: torch.futures.Future[Any]) -> torch.Tensor:
    """The job's tensor, or its error raised. (Raised in a ``then`` callback,
    the error reaches DDP's C++ side; ``set_exception`` on the raw future would
    not: DDP would read the exception object as the bucket.) DDP re-raises it
    from ``backward()`` as a ``RuntimeError`` carrying the error's type and
    text; the typed error is kept as the state's ``failure``."""
    value = raw.value()
    if isinstance(value, Exception):
        raise value
    tensor: torch.Tensor = value
    return tensor


_LIVE: weakref.WeakSet[CommThread] = weakref.WeakSet()


def stop_all() -> None:
    for comm in list(_LIVE):
        comm.stop()
    _LIVE.clear()


launch.BEFORE_END.append(stop_all)
atexit.register(stop_all)


class Overlapped:
    """A hook state whose buckets run on its communication thread.

    ``run(bucket, job)`` hands ``job`` over and returns the future DDP waits
    on. Subclasses (dataclasses included) keep their own fields; the thread is
    kept out of pickling and made again after unpickling or ``stop_all``."""

    _comm: CommThread | None = None

    def comm(self) -> CommThread:
        if self._comm is None or self._comm.group is None:
            self._comm = CommThread(f"gradfabric-{type(self).__name__}")
        return self._comm

    @property
    def failure(self) -> Exception | None:
        """The last error a bucket ended with (DDP re-raised it from
        ``backward()`` as a ``RuntimeError`` with its text), e.g. a
        ``PeerTimeoutError`` whose ``peer`` names the rank that is gone."""
        return None if self._comm is None else self._comm.failure

    @property
    def thread_cpu_s(self) -> float:
        """CPU seconds the state's threads spent in its buckets' jobs so far
        (the work a hook does on the host besides backward's; 0 before its
        first bucket)."""
        return sum(c.cpu_s for c in (self._comm, self._ahead) if c is not None)

    def spans_since(self, t0: float) -> list[tuple[float, float, float]]:
        """When the communication thread served each job it started at or
        after ``t0`` (``time.perf_counter`` seconds): (start, work, end)
        seconds from ``t0``, in the order served (a step's buckets, in DDP's
        order); ``work`` is when the job's own work began: after its first
        stage (``run_staged``: the ranks' agreement, which waits for the last
        rank to reach the bucket), else at its start."""
        # (copied at once, under the GIL: the thread may be appending meanwhile)
        spans = [] if self._comm is None else list(self._comm.spans)
        return [(a - t0, w - t0, b - t0) for a, w, b in spans if a >= t0]

    def run(self, buf: torch.Tensor, job: Job) -> torch.futures.Future[torch.Tensor]:
        return self.comm().submit(job, buf)

    _ahead: CommThread | None = None

    def run_staged(
        self, buf: torch.Tensor, first: Callable[[Any], T], then: Callable[[Any, T], torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        """A bucket in two stages, each on a thread and process group of its
        own: ``first(group)`` on the stage thread, then ``then(group, its
        result)`` on the communication thread. While the communication thread
        serves one bucket, the stage thread runs the next one's first stage
        (the ranks' agreement on a bucket's exponents is a gloo round that
        needs nothing of the switch; serial, it cost 3-12 ms a bucket on
        shaped links, 10-15% of the switch's time). Both threads take buckets
        in submission order, the same on every rank, so their collectives pair
        up across ranks."""
        comm = self.comm()  # made first, in every rank's same order
        if self._ahead is None or self._ahead.group is None:
            self._ahead = CommThread(f"gradfabric-{type(self).__name__}-stage")
        staged = self._ahead.submit_raw(first, buf)

        def job(group: Any) -> torch.Tensor:
            value = staged.wait()
            comm.working()
            if isinstance(value, Exception):
                raise value
            return then(group, value)

        return comm.submit(job, buf)

    @staticmethod
    def later() -> tuple[torch.futures.Future[Any], torch.futures.Future[torch.Tensor]]:
        """A bucket to be finished by a later ``run_together``: (the future
        that job completes, the one DDP waits on)."""
        import torch

        raw: torch.futures.Future[Any] = torch.futures.Future()
        return raw, raw.then(_unwrap)

    def run_together(
        self, raws: list[torch.futures.Future[Any]], like: torch.Tensor,
        job: Callable[[Any], list[torch.Tensor]],
    ) -> None:  # fmt: skip
        """One job for several buckets (the tables of a step, ``auto_hook``):
        it completes each of ``raws`` (from ``later``) with its tensor, or all
        of them with its error."""
        comm = self.comm()

        def whole(group: Any) -> None:
            try:
                outs = job(group)
            except Exception as e:  # every bucket's waiter gets it, once ``failure`` holds it
                comm.failure = e
                for r in raws:
                    r.set_result(e)
                return
            for r, out in zip(raws, outs, strict=True):
                r.set_result(out)

        comm.submit_raw(whole, like)

    def dense(self, buf: torch.Tensor, divide_by: int) -> torch.futures.Future[torch.Tensor]:
        """Average ``buf`` with a plain all-reduce started here, on the
        autograd thread, as PyTorch's own ``allreduce_hook`` does (no host
        decision to wait for): divided first, so that the future completes with
        the reduced bucket itself."""
        import torch.distributed as dist

        work = dist.all_reduce(buf.div_(divide_by), group=None, async_op=True)
        assert work is not None  # async_op=True returns the work
        fut: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0])
        return fut

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_comm", None)
        state.pop("_ahead", None)
        return state
