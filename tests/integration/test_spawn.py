"""``spawn``: a rank killed by a fatal signal is named with where it was."""

from __future__ import annotations

import faulthandler
import time

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

from gradfabric.net.launch import spawn


def _crash_in_here() -> None:
    faulthandler._sigsegv()  # type: ignore[attr-defined]  # a real SIGSEGV, in this frame


def _rank(rank: int, world: int) -> None:
    if rank == 1:
        _crash_in_here()
    time.sleep(120)  # (rank 0 waits without a collective, which could fail first)


def test_a_rank_killed_by_a_signal_is_named_with_its_stack_where_it_died() -> None:
    with pytest.raises(ProcessExitedException) as info:
        spawn(_rank, 2, deadline_s=120, barrier_at_exit=False)
    e = info.value
    assert e.error_index == 1 and e.signal_name == "SIGSEGV"
    text = str(e)
    assert "Fatal Python error: Segmentation fault" in text and "Current thread" in text, text
    # the thread that took the signal first, its innermost frame first
    stacks = text[text.index("Current thread") :]
    assert stacks.split("\n")[1].strip().endswith("in _crash_in_here"), stacks
