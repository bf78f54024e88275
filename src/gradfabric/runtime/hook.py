"""DDP communication hooks over the switch daemon.

``ina_hook``: each gradient bucket is summed through the software switch
with the job's policy (SwitchML, ATP or ESA) and averaged. Register it with
``model.register_comm_hook(InaClient.join(), ina_hook)`` in every rank.
``dlcp_hook``: the same over DLCP's bounded-loss transport to the job's server
behind the switch (``DlcpClient.join()``; the switch runs ``--policy dlcp``).

(No ``from __future__ import annotations`` here: DDP compares the hook's
``bucket`` annotation with ``dist.GradBucket`` itself, not its string.)
"""

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradfabric.runtime.dlcp import DlcpClient
from gradfabric.runtime.session import Session


def ina_hook(
    state: Session,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    """Each bucket summed through the switch and averaged, on the client's
    communication thread (``net.overlap``): the hook returns at once. The
    ranks agree on a bucket's block exponents on a stage thread ahead of
    it, while the switch sums the bucket before (``Overlapped.run_staged``)."""
    buf = bucket.buffer()
    return state.run_staged(
        buf, lambda group: state.agree(_flat(buf), group, bucket.index()),
        lambda _, agreed: _averaged(buf, state.sum_agreed(agreed, agreed.x), state.ticket.workers),
    )  # fmt: skip


def dlcp_hook(
    state: DlcpClient,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    """Each bucket pushed to the job's DLCP server as DDP hands it over and
    the sum pulled, within the job's loss bounds (lost values read as zero),
    then averaged on the client's communication thread. DLCP's wire carries finite floats only (a
    NaN or an infinity in a datagram is a counted drop, and under a loss bound
    would read as zero, hiding an overflow from AMP's scaler): a bucket that
    holds one raises ``ValueError`` naming the rank and the bucket, where the
    default hook would have summed it; ranks whose buckets are finite wait
    for it until their ``PeerTimeoutError``."""
    buf = bucket.buffer()
    if not bool(torch.isfinite(buf).all()):
        bad = int((~torch.isfinite(buf)).sum())
        raise ValueError(
            f"dlcp_hook: rank {state.rank}'s bucket {bucket.index()} holds {bad} NaN or "
            "infinite values, which DLCP's wire does not carry; train with DDP's default "
            "hook or ina_hook where gradients may overflow (AMP)"
        )
    # DDP's bucket 0 holds the model's last layers: DLCP serves front layers first
    state.buckets = max(state.buckets, bucket.index() + 1)
    layer = state.buckets - 1 - bucket.index()
    layers = state.buckets

    if buf.device.type != "cpu":  # the copy to the host would block backward here

        def job(group: Any) -> torch.Tensor:
            return _written(buf, state.allreduce(_flat(buf), layer, layers) / state.ticket.workers)

        return state.run(buf, job)
    # pushed now, on DDP's thread: this bucket's push overlaps the sums of the
    # buckets before it coming back (the communication thread waits for each
    # sum in turn, so a blocking all-reduce there would have serialised them)
    pending = state.begin(_flat(buf), layer, layers)

    def finish(group: Any) -> torch.Tensor:
        return _written(buf, state.finish(pending) / state.ticket.workers)

    return state.run(buf, finish)


def switch_sum(client: Session, buf: torch.Tensor, group: Any, divide_by: int = 1) -> torch.Tensor:
    """``buf`` summed over the job through the switch (divided by
    ``divide_by`` in float32 before it is written back), in place."""
    x = _flat(buf)
    return _averaged(buf, client.allreduce(x, group, out=x), divide_by)


def _flat(buf: torch.Tensor) -> np.ndarray:
    """The bucket's values as float32 (its own memory where it is a float32
    CPU tensor: the sum is decoded over them, no array made per call)."""
    return buf.detach().to(torch.float32).reshape(-1).cpu().numpy()


def _averaged(buf: torch.Tensor, total: np.ndarray, divide_by: int) -> torch.Tensor:
    """``total / divide_by`` (float32, in ``total``'s place) written into the bucket."""
    if divide_by != 1:
        np.divide(total, divide_by, out=total)
    return _written(buf, total)


def _written(buf: torch.Tensor, avg: np.ndarray) -> torch.Tensor:
    """``avg`` written into the bucket (nothing to copy where it is the bucket's memory)."""
    src = torch.from_numpy(avg).reshape(buf.shape)
    return buf if src.data_ptr() == buf.data_ptr() else buf.copy_(src)
