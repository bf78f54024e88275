"""``auto_hook``'s cost model and choice, without a process group."""

from __future__ import annotations

import itertools
import pickle
import random

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


def _step_cost(paths: tuple[str, ...], links: list[dict[str, int]], world: int,
               hop: float, per_byte: float) -> float:
    """A step's time as the model has it, written from its rules: each path
    used once (its tables together) at its hops, a counts round unless every
    table is all-gathered, every table's bytes."""
    hops = {"gather": 1, "sharded": 3, "dense": 2 * (world - 1)}
    used = set(paths)
    rounds = sum(hops[p] for p in used) + (used != {"gather"})
    return rounds * hop + sum(link[p] for link, p in zip(links, paths, strict=True)) * per_byte


@pytest.mark.parametrize("seed", range(20))
def test_a_steps_table_paths_are_the_brute_force_optimum(seed: int) -> None:
    """``_coo_paths`` against every assignment of paths to a step's tables."""
    rng = random.Random(seed)
    world, hop, per_byte = rng.choice((2, 4, 8)), rng.uniform(1e-4, 1e-2), 8e-9  # 1 Gbit/s
    state = AutoState()
    state._cost("dense").add(1e6, 1e6 * per_byte)
    state.hop_s.append(hop)
    links = [{"gather": rng.randint(1, 2_000_000), "sharded": rng.randint(1, 2_000_000),
              "dense": rng.randint(1, 20_000_000)} for _ in range(rng.randint(1, 5))]  # fmt: skip
    chosen = state._coo_paths(links, world)
    every = itertools.product(("gather", "sharded", "dense"), repeat=len(links))
    best = min(_step_cost(a, links, world, hop, per_byte) for a in every)
    assert _step_cost(tuple(chosen), links, world, hop, per_byte) == pytest.approx(best, rel=1e-12)


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


def test_a_pickled_state_checks_its_buckets_layout_again() -> None:
    """A state copied into another process (a checkpoint, a spawned rank)
    serves another DDP: the ranks' buckets are compared again there."""
    from gradfabric.collectives.rows import RowState
    from gradfabric.collectives.sparse import OmniState

    for state in (AutoState(), RowState(), OmniState()):
        state.layouts_checked[3] = state.layout_checks
        assert pickle.loads(pickle.dumps(state)).layouts_checked == {}
        assert state.layouts_checked == {3: state.layout_checks}  # (this one's are kept)
