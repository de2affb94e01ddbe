"""Failures point at the learner's line (tests/learner_sites.py) and long worlds say how far they
got (course.world.report_progress), issue 41."""

from __future__ import annotations

from pathlib import Path

import pytest
from exercises import BY_ID
from learner_sites import judged_site, todo_site
from scoreboard import open_todos

from course.world import report_progress, run_world, set_progress_sink

pytestmark = pytest.mark.harness
ROOT = Path(__file__).resolve().parents[1]
LM = BY_ID["4.7"]


def test_a_verdict_that_names_one_function_points_at_its_definition() -> None:
    site = judged_site("4.7 loss_share(8 tokens) returned 1.77; expected 7.06", LM, "templates")
    assert site.startswith("phase4_production/template_lm_parallel.py:"), site
    assert site.endswith(" in loss_share"), site
    line = int(site.split(":")[1].split()[0])
    assert "def loss_share(" in (ROOT / site.split(":")[0]).read_text().splitlines()[line - 1]
    solutions = judged_site("4.7 loss_share: off", LM, "solutions")
    assert solutions.startswith("solutions/phase4_production/lm_parallel.py:"), solutions


def test_a_verdict_naming_two_functions_or_a_line_already_gets_no_guess() -> None:
    both = "4.7 finish_gradients or gradient_placements: the norm differs"
    assert judged_site(both, LM, "templates") == ""
    located = "4.7 loss_share: off (at phase4_production/template_lm_parallel.py:12 in loss_share)"
    assert judged_site(located, LM, "templates") == ""
    assert judged_site("4.7 the 3 AdamW steps differ", LM, "templates") == ""


def test_a_todo_raised_again_by_harness_code_is_located_at_its_raise() -> None:
    path, line, where, _, message = open_todos(BY_ID["3.1"])[0]
    assert todo_site(message) == f"{path.relative_to(ROOT)}:{line} in {where}"
    assert todo_site(f"4.7 needs {message}").endswith(f":{line} in {where}")
    assert todo_site("TODO 9.9: nothing") == ""


def _counting_world(total: int) -> int:
    for done in range(1, total + 1):
        report_progress(done, total, "layouts")
    return total


def test_a_world_reports_its_progress_to_the_caller() -> None:
    seen: list[tuple[int, int, int, str]] = []
    set_progress_sink(lambda *report: seen.append(report))
    try:
        assert run_world(_counting_world, 2, (3,)) == [3, 3]
    finally:
        set_progress_sink(None)
    assert seen == [(2, 1, 3, "layouts"), (2, 2, 3, "layouts"), (2, 3, 3, "layouts")], seen


def test_an_error_raised_in_given_code_is_placed_at_the_learners_call() -> None:
    from grading import learner_line

    root = Path(__file__).resolve().parents[1]
    learner = root / "solutions/phase2_advanced/activation_checkpointing.py"
    given = root / "phase2_advanced/tensor_parallel_support.py"
    call = 68  # inside a function holding "# TODO 2.3:"
    namespace: dict[str, object] = {}
    exec(compile("\n" * 4 + "def given(x):\n    raise RuntimeError('shape')\n", str(given),
                 "exec"), namespace)  # fmt: skip
    exec(compile("\n" * (call - 2) + "def mine(given):\n    given(1)\n", str(learner), "exec"),
         namespace)  # fmt: skip
    mine = namespace["mine"]
    assert callable(mine)
    with pytest.raises(RuntimeError) as raised:
        mine(namespace["given"])
    where = learner_line(raised.value)
    assert where == f" (at solutions/phase2_advanced/activation_checkpointing.py:{call} in mine)", (
        f"expected the learner's call, got {where!r}"
    )
    with pytest.raises(RuntimeError) as raised:
        namespace["given"](1)  # type: ignore[operator]
    assert "tensor_parallel_support.py:6 in given" in learner_line(raised.value)
