"""Command lines of every program in the course: flags from a config dataclass, errors once.

Every demo, benchmark and trainer is run as ``torchrun ... -m solutions.<phase>.<module> --flag
value`` (or plain ``python -m``). What is the same everywhere lives here once:

* :func:`parse_config`: a ``--flag`` for each field of the program's config dataclass
  (``snake_case`` -> ``--kebab-case``; booleans become ``--x/--no-x`` switches; a field's
  ``metadata`` may give ``choices`` and ``help``). Under torchrun every rank parses the same
  argv, so a usage error is printed by rank 0 (the others only as a backstop, see
  :func:`refuse_before_start`), and every rank exits with status 2.
* Every number is checked while it is parsed: a float must be finite (``inf``/``nan`` are
  refused for every flag), and a field's ``metadata`` may bound it with ``ge``, ``gt``, ``le``,
  ``lt`` (as pydantic's ``Field``) and say the fix with ``fix``: ``--lr -1.0: must be > 0
  (fix: a positive learning rate, e.g. --lr 0.05)`` is one line (rank 0's), exit 2, before any
  process group exists.
* :func:`refuse_before_start`: bad values are refused *before* the process group exists: each
  rank checks them against torchrun's WORLD_SIZE, rank 0 prints why, every rank exits with 2.
  Failing later, inside a collective, would leave the other ranks waiting. So that torchrun
  cannot swallow the line (it ends the other ranks when one exits), the other ranks print it too
  when rank 0 has not ended them within :data:`BACKSTOP_SECONDS` (:func:`say_refusal`).
* :class:`Refusal`: what a program raises for a setting or state it will not run with, before
  or inside the process group (a config error, a checkpoint folder where nothing verifies):
  :func:`run_main` prints it the same way, one line, exit 2 (or the class's ``exit_code``), no
  traceback.
* :func:`benchmark_main`: a benchmark's ``main``: flags, refusals, the measurement (one line
  when a world fails, e.g. on an unwritten TODO), the table, and how long it took.
* :func:`run_main`: the entry point. A template whose TODO is still ``raise
  NotImplementedError("TODO x.y: ...")`` prints one line on rank 0 ("TODO 2.5 not written: ...
  at phase2_advanced/template_pipeline_executor.py:120 in PipelineExecutor.step") instead of one
  traceback per rank followed by torchrun's ChildFailedError report.

Example::

    @dataclass
    class DemoConfig:
        steps: int = field(default=10, metadata={"ge": 1})
        impl: str = field(default="solutions", metadata={"choices": IMPLS, "help": "..."})

    def main(argv: Sequence[str] | None = None) -> int:
        config = parse_config(DemoConfig, argv, __doc__)
        ...

    if __name__ == "__main__":
        run_main(main)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from course.torchrun_env import env_int

ConfigT = TypeVar("ConfigT")
ResultT = TypeVar("ResultT")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


# A rank other than 0 waits this long before printing a refusal that rank 0 prints at once.
BACKSTOP_SECONDS = 2.0


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _under_torchrun_note(before_start: bool = True) -> str:
    """A second line under torchrun, where a refusal (exit 2) is followed by torchrun's own
    ChildFailedError report: say that the report adds nothing, so the reader stops at our line."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    when = "refused before training started: " if before_start else ""
    return f"\n({when}torchrun's failure report below only repeats it)"


class Refusal(ValueError):
    """A setting or a state a program will not run with, found before or inside the process
    group (e.g. a checkpoint folder where no checkpoint verifies): :func:`run_main` prints its
    message as one ``error: ...`` line that no launcher can swallow (:func:`say_refusal`) and
    exits with ``exit_code``, without a traceback. Subclasses say what was refused."""

    exit_code = 2


def say_refusal(line: str) -> None:
    """Print ``line`` on stderr, flushed, on rank 0 at once and on every other rank after
    :data:`BACKSTOP_SECONDS`.

    Every rank refuses the same settings, but one voice is enough, and torchrun ends the other
    ranks as soon as one exits: when rank 0 alone spoke and rank 1 exited first, torchrun could
    end rank 0 before it printed, and the refusal was lost (issue 38; a rank that exits has always
    printed first now). Normally rank 0 prints and exits within the backstop, torchrun ends the
    rest, and the line appears once; when rank 0 is slow, another rank prints the same line.
    """
    if not _is_rank_zero():
        time.sleep(BACKSTOP_SECONDS)
    print(line, file=sys.stderr, flush=True)


def refused(err: BaseException, before_start: bool = True) -> int:
    """Say ``err`` as one ``error: ...`` line (:func:`say_refusal`); the exit status to return."""
    say_refusal(f"error: {err}{_under_torchrun_note(before_start)}")
    return int(getattr(err, "exit_code", 2))


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser whose messages (usage, --help) appear once, on rank 0; an error line is
    printed by rank 0 at once and by the other ranks only as a backstop (:func:`say_refusal`)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _is_rank_zero():
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message and status:
            say_refusal(message.rstrip("\n"))
            sys.exit(status)
        super().exit(status, message)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


BOUNDS = {"ge": (">=", float.__ge__), "gt": (">", float.__gt__), "le": ("<=", float.__le__),
          "lt": ("<", float.__lt__)}


def setting_problem(flag: str, value: object, metadata: Any) -> str | None:
    """Why ``value`` is not acceptable for ``flag`` (one line naming both and the fix), or None.

    Floats must be finite; ``metadata`` may bound any number with ``ge``/``gt``/``le``/``lt``
    and give the fix with ``fix``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    fix = metadata.get("fix")
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag} {value}: must be a finite number" + (f" (fix: {fix})" if fix else "")
    for key, (sign, holds) in BOUNDS.items():
        if key in metadata and not holds(float(value), float(metadata[key])):
            bound = metadata[key]
            return f"{flag} {value}: must be {sign} {bound}" + (f" (fix: {fix})" if fix else "")
    return None


def parse_config(
    config_class: type[ConfigT], argv: Sequence[str] | None, description: str | None
) -> ConfigT:
    """Parse ``argv`` into ``config_class``, a dataclass whose defaults are the flags' defaults.

    Numbers are checked as they are parsed (see :func:`setting_problem`); a bad one exits with
    status 2 and one line, on rank 0 only.
    """
    summary = (description or "").strip().split("\n\n")[0]
    parser = RankZeroParser(description=summary)
    defaults: Any = config_class()
    for field in dataclasses.fields(defaults):
        value = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        shown = f"{help_text} (default: {value})" if help_text else f"default: {value}"
        if isinstance(value, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=value, help=help_text or None
            )
        else:
            parser.add_argument(
                flag,
                type=type(value),
                default=value,
                choices=field.metadata.get("choices"),
                help=shown,
            )
    values = vars(parser.parse_args(argv))
    for field in dataclasses.fields(defaults):
        flag = "--" + field.name.replace("_", "-")
        problem = setting_problem(flag, values[field.name], field.metadata)
        if problem:
            parser.exit(2, f"{parser.prog}: error: {problem}{_under_torchrun_note()}\n")
    return config_class(**values)


def refuse_before_start(validate: Callable[[int], object]) -> int | None:
    """Run ``validate(world_size)``; on ValueError say it (:func:`refused`: rank 0 at once, the
    others as a backstop) and return exit code 2.

    Returns None when the arguments are fine. Call it before ``setup_distributed()``.
    """
    try:
        validate(env_int("WORLD_SIZE", 1))
    except ValueError as err:
        return refused(err)
    return None


def benchmark_main(
    config_class: type[ConfigT],
    argv: Sequence[str] | None,
    description: str | None,
    *,
    validate: Callable[[ConfigT], object],
    measure: Callable[[ConfigT], ResultT],
    report: Callable[[ResultT, ConfigT], str],
) -> int:
    """The ``main`` of a benchmark that starts its own worlds (``run_world``), not torchrun.

    ``validate(config)`` raises ValueError for bad flags (exit 2, before any process starts);
    ``measure(config)`` runs the worlds; a :class:`WorldError` (a rank raised, e.g. on an
    unwritten TODO under ``--impl templates``, or hung) is one line on stderr and exit 1;
    otherwise ``report(results, config)`` is printed, then the seconds it took.
    """
    import torch

    from course.world import WorldError

    config = parse_config(config_class, argv, description)
    try:
        validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        results = measure(config)
    except WorldError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report(results, config))
    print(f"\n({time.perf_counter() - started:.0f} s; torch {torch.__version__})")
    return 0


def _learner_frame(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame inside the project (not torch's)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if PROJECT_ROOT in path.parents and ".venv" not in path.parts:
            return f"{path.relative_to(PROJECT_ROOT)}:{frame.lineno} in {frame.name}"
    return ""


def todo_line(exc: NotImplementedError) -> str:
    """One line for an unwritten TODO: what to write and where."""
    message = str(exc) or "a function still raises NotImplementedError"
    if message.startswith("TODO "):
        exercise, _, rest = message.partition(":")
        message = f"{exercise} not written:{rest}"
    where = _learner_frame(exc)
    return message + (f"\n  at {where}" if where else "")


def run_main(
    main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None
) -> NoReturn:
    """Run ``main(argv)`` and exit with its status; an unwritten TODO is one line, not a crash.

    Under torchrun the exit status is 0 after an unwritten TODO: the line above says what
    happened, and a non-zero status would make torchrun add its ChildFailedError report (tens of
    lines per rank) under it. Started without torchrun, the status is 1. A :class:`Refusal`
    (raised before or inside the process group) is one ``error: ...`` line and its
    ``exit_code`` (2).
    """
    try:
        code = main(argv)
    except NotImplementedError as exc:
        if _is_rank_zero():
            print(todo_line(exc), file=sys.stderr, flush=True)
        code = 0 if "TORCHELASTIC_RUN_ID" in os.environ else 1
    except Refusal as exc:  # raised inside the process group: one line, no traceback
        code = refused(exc, before_start=False)
    sys.exit(code)
