"""DDP communication hooks over the emulator's switch.

``ina_hook``: each gradient bucket is summed through the software switch
with the job's policy (SwitchML, ATP or ESA) and averaged. Register it with
``model.register_comm_hook(InaClient.join(), ina_hook)`` in every rank.

(No ``from __future__ import annotations`` here: DDP compares the hook's
``bucket`` annotation with ``dist.GradBucket`` itself, not its string.)
"""

import torch
import torch.distributed as dist

from gradfabric.emu.client import InaClient


def ina_hook(
    state: InaClient,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    flat = buf.detach().to(torch.float32).reshape(-1).numpy()
    avg = state.allreduce(flat) / state.ticket.workers
    buf.copy_(torch.from_numpy(avg).reshape(buf.shape))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
