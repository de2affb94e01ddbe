"""Which test fails each wrong answer to a guide's questions (issue 48: every question is graded).

A guide asks the questions whose answers are an exercise's design ("which group does this sum run
on?"). A question no test grades teaches nothing: a learner who answers it wrong still passes.
Each exercise lists its questions and the test that fails a wrong answer to each, in
``tests/phaseN/questions_exX_Y.py`` (``QUESTIONS``); tests/test_teaching_shape.py checks that every
question of every guide is listed and that every listed test exists. Whoever lists a question
plants its wrong answer in the reference solution and sees that test fail with a message about
that decision before listing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class GradedQuestion:
    """One question of a guide and the test that fails a wrong answer to it."""

    asks: str  # words of the question, verbatim (whitespace aside) in the guide's questions part
    wrong: str  # a realistic wrong answer, in words: what was planted in the reference
    caught_by: str  # "tests/phaseN/grade_x.py::test_name" (parameters in [...] may follow)


def registry_of(exercise: str) -> str:
    """Where an exercise's questions are listed: ``tests/phase2/questions_ex2_6.py``."""
    return f"tests/phase{exercise.split('.')[0]}/questions_ex{exercise.replace('.', '_')}.py"


def all_questions() -> dict[str, list[GradedQuestion]]:
    """Every ``tests/phase*/questions_*.py``'s ``QUESTIONS``, by exercise id."""
    found: dict[str, list[GradedQuestion]] = {}
    for path in sorted(ROOT.glob("tests/phase*/questions_*.py")):
        spec = importlib.util.spec_from_file_location(f"_questions_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for exercise, questions in module.QUESTIONS.items():
            found.setdefault(exercise, []).extend(questions)
    return found
