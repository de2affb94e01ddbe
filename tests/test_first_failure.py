"""Every first failure at the learner's line (issue 29, part 3): for every exercise, a raise planted
at the top of one of its template functions is the first failure its grader prints, at that
template's file and line, under a test whose name fits the function.

The planting and grading are tests/first_failure.py's (a scratch copy of the working tree with
every template completed; exercises of a phase that do not use each other's code are planted and
graded together, each stopping at its first failure). ``uv run python -m tests.first_failure``
plants every TODO function of the course, not only the one per exercise below.

The planted runs grade the whole course again (about two and a half minutes on 2 cores), so they
are marked ``first_failure`` and left out of ``uv run pytest`` (pyproject.toml); CI runs them as
their own step: ``uv run pytest tests/test_first_failure.py -m first_failure --impl solutions``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from exercises import BY_ID
from first_failure import (
    Outcome,
    Plant,
    check,
    make_scratch,
    name_fits,
    names_line,
    plant_line,
    plants,
    rounds,
)

pytestmark = pytest.mark.harness

# One function per exercise: one whose first failure comes early (the whole file stays cheap).
PLANTED = {
    "1.1": "DistributedShardSampler.epoch_indices",
    "1.2": "broadcast_parameters",
    "1.3": "reduce_broadcast_all_reduce",
    "1.4": "DataParallelLoop.reduce_totals",
    "2.1": "accumulate_gradients",
    "2.2": "DynamicLossScaler.update",
    "2.3": "CheckpointFunction.backward",
    "2.4": "split_sizes",
    "2.5": "balanced_partition",
    "2.6": "column_shard",
    "2.7": "merge_partials",
    "3.1": "chunk_bounds",
    "3.2": "ring_cost",
    "3.3": "hierarchical_all_reduce",
    "3.4": "assign_buckets",
    "3.5": "padded_size",
    "3.6": "counted_here",
    "3.7": "balanced_assignment",
    "3.8": "combine",
    "4.1": "atomic_write",
    "4.2": "advance",
    "4.3": "ElasticSampler.shard",
    "4.4": "cast_compress_hook",
    "4.5": "model_flops_utilization",
    "4.7": "token_positions",
}
# Words a test of a function may be named by, besides the function's, its class's and its
# module's: combine's outputs are what the outputs test compares.
ALSO = {"combine": ("outputs",)}


def chosen() -> list[Plant]:
    every = plants()
    picked = []
    for exercise, qualname in PLANTED.items():
        found = [p for p in every if p.exercise == exercise and p.qualname == qualname]
        assert found, f"{exercise}: no template function {qualname} holds a TODO of it"
        picked.append(found[0])
    return picked


def test_every_exercise_with_a_todo_has_a_planted_function() -> None:
    with_todos = sorted({p.exercise for p in plants()}, key=lambda e: tuple(map(int, e.split("."))))
    assert sorted(PLANTED) == sorted(with_todos), (
        f"exercises with TODO functions: {with_todos}; planted here: {sorted(PLANTED)}"
    )
    chosen()


def test_the_raise_goes_before_the_first_statement_and_its_line_is_returned() -> None:
    source = (
        "class A:\n"
        "    def f(self) -> int:\n"
        '        """Doc."""\n'
        "        # a comment\n"
        "        return 1\n"
    )
    text, line = plant_line(source, "A.f")
    assert text.splitlines()[line - 1].strip().startswith("raise RuntimeError("), text
    assert line == 5 and text.splitlines()[2].strip() == '"""Doc."""', text  # before `return`


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    scratch = make_scratch(Path(tmp_path_factory.mktemp("first-failure")) / "repo")
    found: dict[str, Outcome] = {}
    for group in rounds(chosen()):
        for outcome in check(scratch, group):
            found[outcome.plant.exercise] = outcome
    return found


@pytest.mark.first_failure
@pytest.mark.long_running
@pytest.mark.parametrize("exercise", list(PLANTED))
def test_a_raise_in_a_template_is_the_first_failure_at_its_line(
    outcomes: dict[str, Outcome], exercise: str
) -> None:
    outcome = outcomes[exercise]
    plant, failure = outcome.plant, outcome.failure
    what = f"{exercise} {BY_ID[exercise].title}: a raise planted at {plant.template}:{outcome.line} (in {plant.qualname})"
    assert failure is not None, f"{what} failed no test"
    assert names_line(failure, plant, outcome.line), (
        f"{what}: the first failure, {failure.test}, does not name that file and line:\n"
        f"{failure.text}"
    )
    assert name_fits(failure.test, plant, ALSO.get(plant.function, ())), (
        f"{what}: the first failure is reported under {failure.test}, a name that says "
        f"nothing of {plant.qualname}:\n{failure.text}"
    )
