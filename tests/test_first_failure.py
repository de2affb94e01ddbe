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

import ast
from pathlib import Path

import pytest
from exercises import BY_ID, EXERCISES
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
from wrong_values import WRONG_VALUES, WrongValue, completed_template, first_plant, planted_text

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


@pytest.mark.parametrize("exercise", [ex.id for ex in EXERCISES])
def test_every_exercise_has_a_wrong_value_inside_its_first_function(exercise: str) -> None:
    """tests/learner_loop_bench.py times every exercise's first real failure: its plant must
    replace text the completed template holds, inside the exercise's first TODO function, with
    code that still parses (a syntax error would time the import, not a grader)."""
    assert exercise in WRONG_VALUES, f"{exercise}: tests/wrong_values.py plants no wrong value"
    plant, mistake = first_plant(exercise), WRONG_VALUES[exercise]
    assert mistake.right != mistake.wrong, f"{exercise}: the plant changes nothing"
    completed = completed_template(plant.template)
    planted = planted_text(completed, plant, mistake)  # raises when the reference text drifted
    ast.parse(planted, filename=plant.template)
    assert planted != completed, f"{exercise}: planting {mistake.wrong!r} changed nothing"


def test_a_plant_whose_reference_text_is_gone_or_elsewhere_is_refused() -> None:
    plant = first_plant("3.5")
    completed = completed_template(plant.template)
    gone = WrongValue("return numel * 2 ** 40", "return 0")
    with pytest.raises(ValueError, match="is not in"):
        planted_text(completed, plant, gone)
    elsewhere = WrongValue("from __future__ import annotations", "")
    with pytest.raises(ValueError, match=f"outside {plant.qualname}"):
        planted_text(completed, plant, elsewhere)


def test_the_bench_records_only_the_whole_default_set(capsys: pytest.CaptureFixture[str]) -> None:
    """The results file feeds the README's numbers: a partial run must not overwrite it."""
    from learner_loop_bench import main

    for partial in (["--wrong-only"], ["--exercises", "2.6"]):
        with pytest.raises(SystemExit) as info:
            main([*partial, "--record", "never-written.json"])
        assert info.value.code == 2, partial
        assert "--record writes every table and value the README quotes" in capsys.readouterr().err
    assert not Path("never-written.json").exists()


def test_the_bench_reports_a_wrong_value_that_no_test_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plant no test fails times nothing: the table says so and the verdict is not met (the
    runs are replaced: what is checked is the bookkeeping, not a time)."""
    import learner_loop_bench as bench

    for exercise in ("2.3", "3.5"):
        template = first_plant(exercise).template
        (tmp_path / template).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / template).write_text(completed_template(template))

    def graded(scratch: Path, exercise: str, needle: str) -> bench.Timing:
        planted = (scratch / first_plant(exercise).template).read_text()
        assert WRONG_VALUES[exercise].wrong in planted, "graded without the plant"
        if exercise == "2.3":
            return bench.Timing(float("inf"), 3.0, returncode=0)  # every test passed
        return bench.Timing(1.5, 4.0, "test_partition_pads", returncode=1)

    monkeypatch.setattr(bench, "timed_run", graded)
    table, values, met = bench.wrong_first_times(tmp_path, ["2.3", "3.5"], 1)
    assert not met
    assert values["wrong_first"] == "1.5 s", values
    assert values["wrong_verdict"].endswith("planted in 2.3"), values
    rows = {row[0]: row for row in table.rows}
    assert "NOT CAUGHT" in rows["2.3"][3] and rows["3.5"][3] == "test_partition_pads", rows
    for exercise in ("2.3", "3.5"):  # the templates are restored
        template = first_plant(exercise).template
        assert (tmp_path / template).read_text() == completed_template(template)


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
