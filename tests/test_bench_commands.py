"""``uv run python -m tests.bench N.M``, the learner's measuring command, works as its guides say.

Each exercise with a goal beyond right values has one command that measures the learner's code
against it (tests/bench.py, tests/benches/). These checks keep its promises: every goal is
listed; on untouched templates each command stops at its *own* exercise's TODO, in one line,
before any world starts; and it needs only that exercise: 3.1's ring measured with the ring
written and 3.2 (halving-doubling, the alpha-beta fit) still untouched prints the table and the
verdict, the case the phase 3 guide promises.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import bench
import pytest
from exercises import BY_ID

from course import template_maker
from course.impl import unwritten_todo

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("course", "phase1_data_parallel", "phase2_advanced", "phase3_multi_node",
          "phase4_production", "solutions", "tests")  # fmt: skip

pytestmark = pytest.mark.harness


def test_the_list_names_every_goal(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if line.strip()]
    assert listed == list(bench.BENCHES), f"--list printed {lines}; expected one line per goal"
    for line in lines:
        assert len(line.split(None, 1)) == 2, f"{line!r}: a goal needs its text"


def test_an_exercise_without_a_goal_is_refused_with_the_ones_that_have_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["1.1"]) == 2
    out = capsys.readouterr().out
    assert "'1.1' has no goal to measure" in out and ", ".join(bench.BENCHES) in out, out


@pytest.mark.parametrize("exercise", list(bench.BENCHES))
def test_unwritten_templates_stop_at_the_exercises_own_todo(
    exercise: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ex = BY_ID[exercise]
    if not any(unwritten_todo(ex.phase, module, "templates") for module in ex.modules):
        pytest.skip(f"your templates of {exercise} are written: tests.bench {exercise} measures them")
    assert bench.main([exercise, "--quick"]) == 2, "an unwritten TODO is exit status 2"
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    first = out.splitlines()[0] if out else ""
    assert first.startswith(f"TODO {exercise} not written"), (
        f"tests.bench {exercise} on untouched templates should name its own TODO {exercise} "
        f"first, in one line; it printed:\n{out}"
    )


def test_the_ring_is_measured_with_3_2_untouched(tmp_path: Path) -> None:
    project = tmp_path / "course"
    for name in COPIED:
        shutil.copytree(
            ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.png")
        )
    # 3.1 written as a learner who got it right would leave it; every other template,
    # 3.2's included, as shipped (whatever the learner did to them in their own tree)
    ring = BY_ID["3.1"].modules
    for solution in template_maker.solution_files():
        written = solution.stem in ring
        target = project / solution.parent.name / f"template_{solution.name}"
        target.write_text(
            template_maker.make_completed_template(solution)
            if written
            else template_maker.make_template(solution)
        )
    for module in BY_ID["3.2"].modules:
        text = (project / BY_ID["3.2"].phase / f"template_{module}.py").read_text()
        assert "TODO 3.2:" in text, f"template_{module}.py should be untouched here"
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench", "3.1", "--quick"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode in (0, 1), f"exit {done.returncode}, expected 0 or 1:\n{out}"
    assert "| 16 MiB |" in out and "| 64 MiB |" in out, f"no 16 and 64 MiB rows:\n{out}"
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(("goal met:", "goal not met:")), f"last line {verdict!r}:\n{out}"
    assert "TODO 3.2" not in out, f"3.1's measurement reached 3.2:\n{out}"
