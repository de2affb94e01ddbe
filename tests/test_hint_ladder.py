"""The hint ladder (``uv run python -m tests.hint 3.1``) gives one rung of one TODO at a time.

Each test works on a scratch copy of the learner's template (under pytest's tmp_path) and a
state file there, so nothing is left behind in the project.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import hint
import pytest
from exercises import EXERCISES, Exercise
from hint_ladder import LadderState, TodoHints, exercise_todos, open_raises, unwritten_line

from course import template_maker

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = Path("phase3_multi_node/template_ring_allreduce.py")
RAISE = re.compile(r'raise NotImplementedError\((?:\s*"[^"]*")+\s*\)')
Capture = pytest.CaptureFixture[str]

pytestmark = pytest.mark.harness


@pytest.fixture
def learner(tmp_path: Path) -> Path:
    """A scratch project root holding an untouched copy of 3.1's template."""
    (tmp_path / TEMPLATE.parent).mkdir(parents=True)
    shutil.copy(ROOT / TEMPLATE, tmp_path / TEMPLATE)
    return tmp_path


def ask(learner: Path, capsys: Capture, *argv: str) -> tuple[int, str]:
    """Run ``tests.hint`` with ``argv`` on the scratch copy; (exit code, what it printed)."""
    code = hint.main(list(argv), root=learner, state_file=learner / ".hints" / "ladder.json")
    out, err = capsys.readouterr()
    return code, out + err


def write_todo(learner: Path, number: int) -> None:
    """Replace the raise of 3.1's TODO ``number`` in the scratch template, as a learner would."""
    todo = exercise_todos("3.1")[number - 1]
    line = unwritten_line(todo, learner)
    assert line is not None, f"TODO 3.1 #{number} is written already in {learner / TEMPLATE}"
    path = learner / TEMPLATE
    text = path.read_text()
    start = sum(map(len, text.splitlines(keepends=True)[: line - 1]))
    match = RAISE.search(text, start)
    assert match is not None
    path.write_text(text[: match.start()] + "pass  # written" + text[match.end() :])


def test_first_call_gives_hint_2_of_the_first_unwritten_todo_only(
    learner: Path, capsys: Capture
) -> None:
    code, out = ask(learner, capsys, "3.1")
    first = exercise_todos("3.1")[0]
    assert code == 0, out
    assert f"TODO 3.1 #1 of 5: {first.goal}" in out
    assert re.search(rf"in {re.escape(str(TEMPLATE))}:\d+", out), "the rung names the file:line"
    assert "Hint 2:" in out and "Hint 3:" not in out
    assert "#2 of 5" not in out, "one TODO at a time"
    assert "ask again (without --level) for Hint 3" in out, "the rung says how to get the next one"


def test_asking_again_climbs_one_rung_at_a_time_then_says_it_was_the_last(
    learner: Path, capsys: Capture
) -> None:
    levels = sorted(exercise_todos("3.1")[0].rungs)
    for level in levels:
        _, out = ask(learner, capsys, "3.1")
        assert f"Hint {level}:" in out, f"expected Hint {level}:\n{out}"
        others = [other for other in levels if other != level]
        assert not any(f"Hint {other}:" in out for other in others), "one rung at a time"
        assert ("last rung" in out) == (level == levels[-1]), out
    _, again = ask(learner, capsys, "3.1")
    top = levels[-1]
    assert f"Hint {top}:" in again and "last rung" in again, "the top rung stays the top rung"


def test_a_written_todo_moves_the_ladder_to_the_next_one(learner: Path, capsys: Capture) -> None:
    ask(learner, capsys, "3.1")
    write_todo(learner, 1)
    _, out = ask(learner, capsys, "3.1")
    assert "TODO 3.1 #2 of 5" in out and "Hint 2:" in out, "a new TODO starts at Hint 2"


def test_every_todo_written_says_so_and_points_at_todo(learner: Path, capsys: Capture) -> None:
    for number in range(1, 6):
        write_todo(learner, number)
    assert open_raises(learner / TEMPLATE) == []
    code, out = ask(learner, capsys, "3.1")
    assert code == 0
    assert "Every TODO of 3.1 is written" in out
    assert "--todo K" in out and "-m ex3_1" in out


def test_todo_and_level_pick_a_rung(learner: Path, capsys: Capture) -> None:
    _, out = ask(learner, capsys, "3.1", "--todo", "2", "--level", "3")
    assert "TODO 3.1 #2 of 5" in out and "Hint 3:" in out and "Hint 2:" not in out
    _, out = ask(learner, capsys, "3.1", "--todo", "3")
    assert "TODO 3.1 #3 of 5" in out and "Hint 2:" in out
    _, out = ask(learner, capsys, "3.1", "--todo", "3")
    assert "TODO 3.1 #3 of 5" in out and "Hint 3:" in out, "--todo keeps its own ladder"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["3.9"], "exercise '3.9' has no TODOs"),
        (["phase3"], "numbered like 2.5"),
        (["3.1", "--todo", "6"], "--todo 6: exercise 3.1 has TODOs 1 to 5"),
        (["3.1", "--todo", "0"], "--todo 0"),
        (["3.1", "--level", "1"], "Hint 1 of TODO 3.1 #1 is in your template"),
        (["3.1", "--level", "20"], "--level 20: TODO 3.1 #1 has Hints 2, 3"),
    ],
)
def test_bad_arguments_are_named_with_the_fix(
    learner: Path, capsys: Capture, argv: list[str], says: str
) -> None:
    code, out = ask(learner, capsys, *argv)
    assert code == 2, out
    assert says in out, out
    assert not (learner / ".hints").exists(), "a refused request records no rung"


def test_a_todo_with_hint_2_only_refuses_level_3() -> None:
    # every TODO of the course has Hints 2, 3 and 4 at least (tests/test_teaching_shape.py), so
    # the refusal is checked on a made-up one: a ladder being written must still answer clearly
    todo = TodoHints("9.9", 1, "a TODO being written", "guidelines.md#99", TEMPLATE, {2: ["x"]})
    with pytest.raises(hint.UsageError, match=r"#1 has Hint 2 only .* ask for --level 2"):
        hint.check_level(todo, 3)


def test_reset_starts_the_exercise_again_at_hint_2(learner: Path, capsys: Capture) -> None:
    ask(learner, capsys, "3.1")
    ask(learner, capsys, "3.1")
    _, out = ask(learner, capsys, "3.1", "--reset")
    assert "Forgot" in out
    _, out = ask(learner, capsys, "3.1")
    assert "Hint 2:" in out and "Hint 3:" not in out


def test_a_broken_state_file_is_an_empty_ladder(learner: Path, capsys: Capture) -> None:
    state = learner / ".hints" / "ladder.json"
    state.parent.mkdir()
    state.write_text("{not json")
    code, out = ask(learner, capsys, "3.1")
    assert code == 0 and "Hint 2:" in out
    assert LadderState(state).shown, "the rung shown is recorded again"


def test_all_prints_every_later_hint_for_instructors(learner: Path, capsys: Capture) -> None:
    code, out = ask(learner, capsys, "3.1", "--all")
    assert code == 0
    todos = exercise_todos("3.1")
    assert all(f"#{todo.number}: {todo.goal}" in out for todo in todos)
    assert out.count("Hint 2:") == len(todos)
    assert not (learner / ".hints").exists(), "--all is not a rung"


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_every_todo_has_a_ladder_without_gaps(ex: Exercise) -> None:
    for todo in exercise_todos(ex.id):
        levels = sorted(todo.rungs)
        assert levels == list(range(2, 2 + len(levels))), (
            f"TODO {ex.id} #{todo.number} ({todo.goal}) has later hints {levels}: number them "
            "Hint 2, Hint 3 in order, so that each rung leads to the next"
        )


MIN_RUNG_WORDS = 8  # a rung says something: a question to consider, or the answer in words


@pytest.fixture(scope="module")
def hint_1_in_templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bool]:
    """For each raise of every template the solutions make: does the comment block above it
    (what the learner reads beside the TODO) hold a Hint 1? Keyed by the raise's message."""
    folder = tmp_path_factory.mktemp("templates")
    found = {}
    for solution in template_maker.solution_files():
        template = folder / template_maker.template_path(solution).name
        template.write_text(template_maker.make_template(solution))
        lines = template.read_text().splitlines()
        for line, message in open_raises(template):
            above, block = line - 2, []
            while above >= 0 and lines[above].lstrip().startswith("#"):
                block.append(lines[above])
                above -= 1
            found[" ".join(message.split())] = any(re.search(r"#\s*Hint 1\s*:", b) for b in block)
    return found


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_every_todo_has_hint_1_and_rungs_that_say_something(
    ex: Exercise, hint_1_in_templates: dict[str, bool]
) -> None:
    """Hint 1 in the template, and every later rung (Hint 2, 3, ...: how many, and what each
    must be, tests/test_teaching_shape.py says) holds words, for every TODO of every
    exercise."""
    todos = exercise_todos(ex.id)
    assert todos, f"exercise {ex.id} has no TODOs"
    problems = []
    for todo in todos:
        where = f"TODO {ex.id} #{todo.number} ({todo.goal})"
        wanted = " ".join(f"TODO {ex.id}: {todo.goal}".split())
        has_1 = [ok for message, ok in hint_1_in_templates.items() if message.startswith(wanted)]
        if not has_1 or not all(has_1):
            problems.append(f"{where}: no '# Hint 1:' above its raise in {todo.template}")
        for level in sorted({2, 3} | set(todo.rungs)):
            words = " ".join(todo.rungs.get(level, [])).split()[2:]  # without "Hint N:"
            if len(words) < MIN_RUNG_WORDS:
                problems.append(
                    f"{where}: Hint {level} is missing or empty (has {len(words)} words); write "
                    "it above the '# See' line of the TODO's block in solutions/"
                )
    assert not problems, "\n".join(problems)


def test_the_state_file_stays_out_of_git() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/.hints/" in ignored, "add /.hints/ to .gitignore: the ladder is each learner's own"
