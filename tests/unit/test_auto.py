"""``auto_hook``'s cost model and choice, without a process group."""

from __future__ import annotations

import pickle

import pytest

from gradfabric.collectives.auto import AutoState, PathCost


def test_a_path_cost_recovers_a_line_it_was_fed() -> None:
    cost = PathCost(window=8)
    for nbytes in (1e6, 2e6, 4e6, 8e6):
        cost.add(nbytes, 0.002 + nbytes / 1.25e8)  # 2 ms fixed, 1 Gbit/s
    fitted = cost.fit()
    assert fitted is not None
    fixed, per_byte = fitted
    assert fixed == pytest.approx(0.002, rel=1e-9)
    assert per_byte == pytest.approx(1 / 1.25e8, rel=1e-9)
    assert cost.predict(16e6) == pytest.approx(0.002 + 16e6 / 1.25e8, rel=1e-9)


def test_one_size_seen_predicts_through_the_origin_and_the_window_forgets() -> None:
    cost = PathCost(window=3)
    assert cost.predict(1e6) is None
    for _ in range(5):
        cost.add(1e6, 0.01)
    assert len(cost.calls) == 3
    assert cost.predict(2e6) == pytest.approx(0.02)
    for _ in range(3):  # the link got twice as slow: the old calls are gone
        cost.add(1e6, 0.02)
    assert cost.predict(1e6) == pytest.approx(0.02)


def test_choice_follows_the_model_and_explores_the_runner_up() -> None:
    state = AutoState(explore_every=4, explore_ratio=2.0)
    link = {"dense": 8_000_000, "sparse": 4_000_000}
    # nothing measured: bytes, with the default margin (half the bytes: sparse)
    assert state._choose(0, link) == "sparse"
    # sparse measured slow on the host (40 ms for 4 MB), dense fast (20 ms for 8 MB)
    state._cost("sparse").add(4e6, 0.040)
    state._cost("dense").add(8e6, 0.020)
    picks = [state._choose(0, link) for _ in range(8)]
    # sparse is predicted 2x dense: within explore_ratio, so every 4th scan tries it
    assert picks == ["dense", "dense", "sparse", "dense", "dense", "dense", "sparse", "dense"]
    state._cost("sparse").add(4e6, 0.400)  # far slower now: never explored
    state._cost("sparse").add(4e6, 0.400)
    assert all(state._choose(0, link) == "dense" for _ in range(8))


def test_the_state_pickles_without_its_thread_or_switch() -> None:
    state = AutoState()
    state._cost("dense").add(1e6, 0.01)
    state.switch = object()  # type: ignore[assignment]  # stands for a client's socket
    clone = pickle.loads(pickle.dumps(state))
    assert clone.switch is None and clone._comm is None
    assert clone.costs["dense"].predict(1e6) == pytest.approx(0.01)


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError):
        AutoState(explore_ratio=0.5)
    with pytest.raises(ValueError):
        AutoState(block_size=0)
