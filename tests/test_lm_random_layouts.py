"""Randomized layouts of the language model against one process (issue 38; tests/lm_random_layouts.py).

In CI: a fixed seed and budget, ``BUDGET`` draws in a world of 2 and one of 4, picked to cover
the most option pairs, then the draws that once found a wrong training (``FOUND``: an MoE
expert no token chose, FSDP-style units with recompute). Any other::

    uv run pytest tests/test_lm_random_layouts.py --impl solutions --lm-seed 7 --lm-draws 16 \\
        --lm-worlds 2,4,8

A layout that differs from one process fails with what differs and the one line that reruns it.
"""

from __future__ import annotations

import pytest
from lm_random_layouts import DEFAULT_SEED, WORLD_ENV, check, draws_for, run_draws

from course.world import run_world, world_timeout

pytestmark = pytest.mark.harness
BUDGET = 8  # draws per world in CI: about 6 s of a world of 2 and 9 s of a world of 4, 2 cores


def _settings(config: pytest.Config) -> tuple[int, int, list[int]]:
    seed = config.getoption("--lm-seed")
    draws = config.getoption("--lm-draws")
    sizes = config.getoption("--lm-worlds")
    worlds = [int(w) for w in sizes.split(",")] if sizes else [2, 4]
    bad = [w for w in worlds if w not in (1, 2, 4, 8)]
    if bad or (draws is not None and draws < 1):
        raise pytest.UsageError(
            f"--lm-worlds {sizes} / --lm-draws {draws}: worlds among 1, 2, 4, 8 (comma-"
            "separated) and at least one draw"
        )
    return (DEFAULT_SEED if seed is None else seed), (draws or BUDGET), worlds


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "world" in metafunc.fixturenames:
        _, _, worlds = _settings(metafunc.config)
        metafunc.parametrize("world", worlds)


def test_randomized_layouts_train_like_one_process(world: int, request: pytest.FixtureRequest) -> None:
    """Every drawn layout: each step's report, every rank's pieces of every parameter and of
    AdamW's two moments after each of 3 steps, and full_state() at the end, against one process
    in float64 (relative 1e-10)."""
    seed, budget, _ = _settings(request.config)
    draws = draws_for(seed, world, budget)
    per_rank = run_world(
        run_draws, world, (draws,), timeout=max(world_timeout(), 6.0 * budget), env=WORLD_ENV
    )
    lines = check(seed, world, budget, draws, per_rank)
    if lines:
        pytest.fail(
            f"{len(lines)} of {len(draws)} randomized layouts of {world} ranks (seed {seed}) "
            "differ from one process in float64:\n  " + "\n  ".join(lines),
            pytrace=False,
        )


def test_full_state_refuses_replicas_that_differ() -> None:
    """Two data-parallel copies of a norm that differ (a reduction that left out a group) are
    not assembled into one model; equal copies are."""
    import torch

    from phase4_production.lm_runtime import ReplicasDiffer, assemble_state

    pieces = {"final_norm.weight": ("whole", 1)}
    same = [(0, {"final_norm.weight": torch.ones(4)}, pieces) for _ in range(2)]
    assert torch.equal(assemble_state(same, 1, False)["final_norm.weight"], torch.ones(4))
    differ = [*same[:1], (0, {"final_norm.weight": torch.tensor([1.0, 1.0, 1.5, 1.0])}, pieces)]
    with pytest.raises(ReplicasDiffer, match=r"final_norm.weight: rank 0 and rank 1 .* 5.000e-01"):
        assemble_state(differ, 1, False)
