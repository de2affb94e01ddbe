"""An error raised inside given code or a test helper, reported at the learner's call that
caused it (issue 49, item 6).

A learner's ``_mark_ready`` that hands the given ``Bucket.slot`` a parameter's index where its
position in the bucket belongs raises ``IndexError`` in ``ddp_support.py``; the rank's report
then opens at the given code's line, and so does the scoreboard's "Next:". The learner's line is
among the rank's frames: the innermost one inside a function that holds ``# TODO <id>:``.
:func:`at_learner_call` puts it first, saying where the error was raised and from which of
the learner's calls.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from learner_sites import _todo_functions

from course.world import RankFailed

ROOT = Path(__file__).resolve().parents[1]
GIVEN_ERRORS = ("RuntimeError", "TypeError", "IndexError", "ValueError", "KeyError")


def _path(filename: str) -> Path:
    path = Path(filename)
    return (path if path.is_absolute() else ROOT / path).resolve()


def _todo_ids(filename: str) -> set[str]:
    """The exercises whose TODOs ``filename`` holds."""
    path = _path(filename)
    try:
        return set(re.findall(r"# TODO (\d+\.\d+):", path.read_text()))
    except OSError:
        return set()


def in_learner_function(filename: str, function: str, lineno: int, exercise_id: str) -> bool:
    """Whether the line ``filename:lineno`` lies in a function of ``exercise_id`` holding a
    TODO (a template's, or the reference's under --impl solutions)."""
    path = _path(filename)
    if not path.exists():
        return False
    for qualname, line in _todo_functions(path, exercise_id, path.stat().st_mtime):
        if qualname.rsplit(".", 1)[-1] == function and line <= lineno:
            return True
    return False


def learner_call_note(exc: RankFailed, exercise_id: str) -> str:
    """The first line for a rank's error raised outside the learner's functions but called from
    one of them ("" when it was raised in the learner's own code, or no learner frame is seen)."""
    frames = list(exc.frames)
    if exc.exc_type not in GIVEN_ERRORS or not frames:
        return ""
    inner = frames[-1]
    if any(
        in_learner_function(inner.filename, inner.function, inner.lineno, other)
        for other in _todo_ids(inner.filename)
    ):
        return ""  # raised in code a learner writes (of this exercise or an earlier one)
    caller = next(
        (
            f
            for f in reversed(frames[:-1])
            if in_learner_function(f.filename, f.function, f.lineno, exercise_id)
        ),
        None,
    )
    if caller is None:
        return ""
    try:
        rel = _path(inner.filename).relative_to(ROOT)
        kind = "a test helper" if rel.parts[0] == "tests" else "the given code"
    except ValueError:
        kind = "library code"
    first = exc.message.splitlines()[0] if exc.message else exc.exc_type
    return (
        f"{exercise_id}: rank {exc.rank} raised {exc.exc_type} in {kind} ({inner.location}: "
        f"{first}), called from your code at {caller.location}: look at what that line hands "
        "it (its shape, dtype, index or type)."
    )


def at_learner_call(exc: BaseException, exercise_id: str) -> None:
    """Put the learner's call first in a rank's error raised in given code (in place)."""
    if isinstance(exc, RankFailed):
        note = learner_call_note(exc, exercise_id)
        text = str(exc.args[0]) if exc.args else str(exc)
        if note and not text.startswith(note):  # once, however many wrappers it crosses
            exc.args = (f"{note}\n{text}",)


def learner_world(world: Any, exercise_id: str) -> Any:
    """``world`` (a function that runs ranks), reporting given-code errors at the learner's call."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return world(*args, **kwargs)
        except RankFailed as exc:
            at_learner_call(exc, exercise_id)
            raise

    return run
