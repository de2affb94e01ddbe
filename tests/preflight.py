"""The first message in seconds: before torch loads, tell a learner which TODO of the exercise to write.

Grading one exercise starts by importing torch (3-4 s of CPU on a small machine) and the grader,
then starting its first world; on an untouched template every test then stops at the same
``raise NotImplementedError("TODO ...")``. The answer to "what do I write first?" does not need
any of that: it is in the template's text. So when a run selects one exercise of the learner's
templates (``uv run pytest tests/test_phase3.py -m ex3_1``, or its grader files), this plugin
reads the exercise's templates as text at session start and prints, before the first test:

* a template that does not parse: its file, line and the parser's message (the grader would
  report the same import failure only after torch and the collection);
* else the first ``raise NotImplementedError("TODO <id>: ...")`` still in the exercise's
  templates, with its file, line and function, and how many are left.

With ``--impl solutions`` (an instructor's run of one exercise) only the live first failure below
is printed.

The grading then runs as before, and its first failure is printed the moment it happens (a
grader's verdict whole, an error in two lines; in full at the end, with the scoreboard), unless it is an unwritten TODO and the line
above already named one (issue 29, part 1). Nothing here imports torch, and neither does tests/conftest.py at
import time, so the message comes about 1 s after the command on 2 cores.
"""

from __future__ import annotations

import ast
import contextlib
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from exercises import BY_ID, Exercise
from parallel_runs import one_exercise
from scoreboard import open_todos

ROOT = Path(__file__).resolve().parents[1]


def first_message(ex: Exercise, root: Path = ROOT) -> str | None:
    """What the learner should hear first about exercise ``ex``'s templates (under ``root``);
    None when every TODO of it is written and every template parses (the tests then have the
    first word). The TODO named is the first raise in the file, where the scoreboard's "Next"
    points too."""
    label = f"[{ex.id} {ex.title}]"
    for module in ex.modules:
        path = root / ex.phase / f"template_{module}.py"
        rel = path.relative_to(root)
        try:
            ast.parse(path.read_text(), filename=str(path))
        except OSError as exc:
            return f"{label} cannot read {rel}: {exc.strerror}"
        except SyntaxError as exc:
            return f"{label} {rel} does not parse: {exc.msg}\n  at {rel}:{exc.lineno}"
    sites = open_todos(ex, root)
    if not sites:
        return None
    path, line, where, _, text = sites[0]
    more = len(sites) - 1
    left = f" ({more} more TODO {ex.id} raise{'s' if more != 1 else ''} after it)" if more else ""
    return f"{label} not written yet: {text}\n  at {path.relative_to(root)}:{line} in {where}{left}"


STUCK_CAUSE = " never entered"  # course/world.py's line for a collective a member skipped


FIRST_FAILURE_LINES = 14  # a grader's whole first message, as a rule; longer ones are cut


def failure_headline(report: pytest.TestReport) -> str:
    """The first failure as the learner should see it at once: the harness's short message
    (``[3.1 ...] ...`` and its ``at`` line, plus, for a deadlock in a collective, the line naming
    the rank that never entered it); a grader's judgement (``pytest.fail``) whole, its header
    and every line under it up to :data:`FIRST_FAILURE_LINES` (a header alone, such as
    ``4.7 token_positions:``, says nothing); or an exception's first line and, when it was
    raised in the course's code (a template, a solution, the given modules), where."""
    text = report.longreprtext.strip()
    if text.startswith("["):
        lines = text.splitlines()
        # a deadlock's cause: the collective a rank never entered (the stuck line says where)
        cause = next((line for line in lines[2:] if line.endswith(STUCK_CAUSE)), None)
        return "\n".join(lines[:2] + ([cause] if cause else []))
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return text.splitlines()[-1] if text else "(no message)"
    message = crash.message or ""
    if message.startswith("Failed: "):  # a grader's verdict: all of it
        lines = message.removeprefix("Failed: ").splitlines() or ["(no message)"]
        if len(lines) > FIRST_FAILURE_LINES:
            cut = len(lines) - FIRST_FAILURE_LINES
            lines = [*lines[:FIRST_FAILURE_LINES], f"  ... ({cut} more lines when the run ends)"]
        return "\n".join(lines)
    headline = message.splitlines()[0] if message else "(no message)"
    path = Path(crash.path)
    if ROOT in path.parents and path.relative_to(ROOT).parts[0] not in ("tests", ".venv"):
        headline += f"\n  at {path.relative_to(ROOT)}:{crash.lineno}"
    return headline


PROGRESS_EVERY = 2.0  # seconds between two progress lines of one world


class FirstMessages:
    """Prints what a one-exercise run of the templates has to say as soon as it is known, and
    how far a long world has got (``world of 4: 3/8 layouts``), so that slow never looks hung."""

    def __init__(self, reporter: Any, capture: Any = None) -> None:
        self.reporter = reporter
        self.capture = capture  # pytest's capture manager: a world reports inside a test
        self.named_a_todo = False  # the preflight's line went out
        self.failure_shown = False
        self.listening = False
        self.last_progress = 0.0

    def progress(self, world_size: int, done: int, total: int, what: str) -> None:
        """A world's rank 0 got ``done`` of ``total``: a line every PROGRESS_EVERY s, and the last."""
        now = time.monotonic()
        if now - self.last_progress < PROGRESS_EVERY and done != total:
            return
        self.last_progress = now
        shown = (self.capture.global_and_fixture_disabled() if self.capture is not None
                 else contextlib.nullcontext())  # fmt: skip
        with shown:  # past the test's output capture, to the terminal
            self.reporter.ensure_newline()
            self.reporter.write_line(f"  world of {world_size}: {done}/{total} {what}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if not self.listening:  # course.world imports torch: only once the tests run
            from course.world import set_progress_sink

            set_progress_sink(self.progress)
            self.listening = True

    def say(self, text: str, note: str) -> None:
        self.reporter.ensure_newline()
        self.reporter.write_line(text)
        self.reporter.write_line(f"  ({note})")

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """The first failure, when it happens (the full report waits for the end of the run);
        not an unwritten TODO when the preflight already named one: the scoreboard's "Next"
        points where the preflight did (the first raise in the file), and a test may meet a
        later raise first (2.3's tests reach checkpoint_sequential before CheckpointFunction)."""
        if not report.failed or report.when not in ("setup", "call") or self.failure_shown:
            return
        self.failure_shown = True
        headline = failure_headline(report)
        if self.named_a_todo and "not written yet" in headline.splitlines()[0]:
            return
        test = report.nodeid.split("::")[-1]
        self.say(headline, f"the first failure, in {test}; in full when the run ends")


@pytest.hookimpl(wrapper=True)  # after the terminal reporter's session header
def pytest_sessionstart(session: pytest.Session) -> Generator[None, None, None]:
    yield
    config = session.config
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "no":
        return  # tests run in workers: several exercises, whose reports arrive in any order
    exercise_id = one_exercise(config.getoption("markexpr", ""), list(config.args))
    ex = BY_ID.get(exercise_id or "")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if ex is None or reporter is None:
        return
    messages = FirstMessages(reporter, config.pluginmanager.get_plugin("capturemanager"))
    config.pluginmanager.register(messages, "first_messages")
    message = first_message(ex) if config.getoption("--impl") == "templates" else None
    if message is not None:
        messages.say(message, "grading now; the failures below and the scoreboard say more")
        messages.named_a_todo = "not written yet" in message
