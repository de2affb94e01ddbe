"""The first message of a one-exercise run, printed before torch loads (tests/preflight.py).

The live first failure it also prints is checked with the harness's other rules in
tests/test_harness.py; the seconds it takes are measured by tests/learner_loop_bench.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from exercises import BY_ID
from preflight import failure_headline, first_message

ROOT = Path(__file__).resolve().parents[1]
RING = BY_ID["3.1"]
GUIDE = "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"


def _template(root: Path, text: str) -> Path:
    path = root / RING.phase / f"template_{RING.modules[0]}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_it_names_the_first_unwritten_todo_its_line_and_function(tmp_path: Path) -> None:
    _template(
        tmp_path,
        "def written() -> int:\n"
        "    return 1\n"
        "\n"
        "\n"
        "class Ring:\n"
        "    def step(self) -> None:\n"
        f'        raise NotImplementedError("TODO 3.1: do the step {GUIDE}")\n'
        "\n"
        "\n"
        "def later() -> None:\n"
        f'    raise NotImplementedError("TODO 3.1: then this {GUIDE}")\n',
    )
    assert first_message(RING, tmp_path) == (
        f"[3.1 ring all-reduce] not written yet: TODO 3.1: do the step {GUIDE}\n"
        "  at phase3_multi_node/template_ring_allreduce.py:7 in Ring.step "
        "(1 more TODO 3.1 raise after it)"
    )


def test_written_todos_and_other_exercises_raises_say_nothing(tmp_path: Path) -> None:
    _template(
        tmp_path,
        "def written() -> int:\n"
        "    return 1\n"
        "\n"
        "\n"
        "def of_another_exercise() -> None:\n"
        '    raise NotImplementedError("TODO 3.2: not this exercise\'s")\n',
    )
    assert first_message(RING, tmp_path) is None


def test_a_template_that_does_not_parse_is_named_at_its_line(tmp_path: Path) -> None:
    _template(tmp_path, "def fine() -> None:\n    pass\n\n\ndef broken(:\n    pass\n")
    message = first_message(RING, tmp_path)
    assert message is not None and "template_ring_allreduce.py does not parse" in message, message
    assert message.endswith("at phase3_multi_node/template_ring_allreduce.py:5"), message


def test_a_missing_template_is_named(tmp_path: Path) -> None:
    message = first_message(RING, tmp_path)
    assert message == (
        "[3.1 ring all-reduce] cannot read phase3_multi_node/template_ring_allreduce.py: "
        "No such file or directory"
    )


@pytest.mark.harness
def test_a_deadlock_in_a_collective_is_told_with_the_rank_that_never_entered_it() -> None:
    report = SimpleNamespace(longreprtext="\n".join([
        "[1.2 broadcast] rank(s) 0 deadlocked (finished: 1): each waits ...",
        "  rank 0 stuck at phase1_data_parallel/template_trainer.py:89 in broadcast_parameters",
        "      called from tests/phase1/grade_1_2_averaging.py:85 in broadcast_worker",
        "  rank 0 waits in its collective number 1 on ranks (0, 1) (broadcast at "
        "phase1_data_parallel/template_trainer.py:89), which rank(s) 1 never entered",
    ]))  # fmt: skip
    lines = failure_headline(report).splitlines()  # type: ignore[arg-type]
    assert len(lines) == 3 and lines[2].endswith("which rank(s) 1 never entered"), lines
    report.longreprtext = "[3.1 ring] values differ\n  at template_ring_allreduce.py:90\n  more"
    assert failure_headline(report).splitlines() == [  # type: ignore[arg-type]
        "[3.1 ring] values differ", "  at template_ring_allreduce.py:90"
    ]


@pytest.mark.harness
def test_a_graders_verdict_is_streamed_whole_not_as_its_header() -> None:
    """A judged failure's first line is often a header ("4.7 token_positions:"); the lines under
    it are the substance, and they are streamed with it (issue 41: 3 of 8 planted mistakes
    showed the header alone for 37-150 s)."""
    verdict = "4.7 token_positions:\n  rank 1 of cp=2 returned [0, 1, 2, 3]; expected [4, 5, 10, 11]"
    crash = SimpleNamespace(message=f"Failed: {verdict}", path="tests/x.py", lineno=1)
    report = SimpleNamespace(longreprtext=verdict, longrepr=SimpleNamespace(reprcrash=crash))
    assert failure_headline(report).splitlines() == verdict.splitlines()  # type: ignore[arg-type]
    long = "header:\n" + "\n".join(f"  line {i}" for i in range(40))
    crash.message = f"Failed: {long}"
    lines = failure_headline(report).splitlines()  # type: ignore[arg-type]
    assert lines[0] == "header:" and lines[-1].endswith("more lines when the run ends)"), lines


def test_the_conftests_and_plugins_load_without_torch() -> None:
    # the message is printed at session start: anything imported before it delays it by the
    # seconds torch takes to import
    probe = (
        "import sys; sys.path[:0] = ['.', 'tests']\n"
        "import conftest, parallel_runs, scoreboard, phase_collection, preflight\n"
        "import importlib; importlib.import_module('tests.conftest')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", (
        f"importing the conftests and plugins imported torch: {done.stdout.strip()[:300]}"
    )


def test_the_loop_benchmark_refuses_an_unknown_exercise_before_copying_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from learner_loop_bench import main, span

    with pytest.raises(SystemExit) as info:
        main(["--exercises", "3.1", "9.9"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--exercises 9.9: no such exercise" in err and "3.8" in err, err
    assert span([0.84, 1.21, 0.95]) == "0.8-1.2 s" and span([4.0]) == "4.0 s"
