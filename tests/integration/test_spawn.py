"""``spawn``: a rank killed by a fatal signal is named with where it was."""

from __future__ import annotations

import faulthandler

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from gradfabric.net.launch import spawn


def _crash_in_here() -> None:
    faulthandler._sigsegv()  # type: ignore[attr-defined]  # a real SIGSEGV, raised where this frame is


def _rank(rank: int, world: int) -> None:
    if rank == 1:
        _crash_in_here()
    dist.barrier()  # (rank 0 waits for the rank that is gone, until spawn ends it)


def test_a_rank_killed_by_a_signal_is_named_with_its_stack_where_it_died() -> None:
    with pytest.raises(ProcessExitedException) as info:
        spawn(_rank, 2, deadline_s=120)
    e = info.value
    assert e.error_index == 1 and e.signal_name == "SIGSEGV"
    text = str(e)
    # the thread that took the signal first, its innermost frame first
    stacks = text[text.index("Current thread"):]
    assert stacks.split("\n")[1].strip().endswith("in _crash_in_here"), stacks
