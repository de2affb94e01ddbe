"""How long a learner waits: the first message and the whole grading of one exercise, timed.

The loop a learner repeats hundreds of times is ``uv run pytest tests/test_phase3.py -m ex3_1``
(README, "Start here"). Issue 29 sets its goals on 2 idle cores: the first message within 5 s,
and one exercise's whole grading within 15 s where its worlds allow. This benchmark times that
command, as a learner meets it, in two scratch copies of the working tree (``.venv`` linked):

* **untouched**: the templates fresh from the solutions (``course.template_maker --write``), as
  a new learner finds them; the first message is the first line naming an unwritten TODO (the
  one tests/preflight.py prints before torch loads);
* **broken**: every template completed with the solution's code, then a raise planted as the
  first statement of the exercise's first TODO function (tests/first_failure.py's planting); the
  first message is the first line naming that raise (printed live by tests/preflight.py when the
  test that meets it fails).

**The first real failure, every exercise** (issue 49, item 7): a raise is found by the first
test that calls the function; a wrong value only by a test that checks it. So a fourth table
plants, in every exercise's first TODO function of the completed templates, one realistic wrong
VALUE (tests/wrong_values.py: a count rounded down, the buffers left out, a remainder on the
last rank, a missing all-reduce, ...), grades the exercise as a learner runs it, and times the
first failure the run streams (tests/preflight.py's line "the first failure, in ...", whose test
the table names) and the whole grading. A plant that no test fails is reported, and the run
exits 1. Goal on 2 quiet cores: within 10 s, every exercise. For exercise 4.7, whose functions
are all judged by their values, a third table plants one wrong value in each of its ten
functions (:data:`WRONG_4_7`: contiguous positions, a count over dp only, a missing dp x cp
factor, ...); beside it, the collection alone (``--collect-only``). Issue 41's goals on 2 quiet
cores: the first real failure within 10 s, collection within 5 s.

Each time is from starting the interpreter to the line (or to its exit), with
``python -m pytest`` run directly (``uv run`` adds the time it takes to check the environment,
about 0.05 s here). Repeats of the two cases alternate; the table shows medians, the slowest
repeat beside them, and the machine's load.

    uv run python -m tests.learner_loop_bench           # the loop of 3.1 2.7 3.8 2.5 4.2 4.7 and
                                                        # every exercise's wrong value, 3 repeats
    uv run python -m tests.learner_loop_bench --record tests/results/learner_loop.json
    uv run python -m tests.learner_loop_bench --exercises 2.6 --repeats 1   # one exercise
    uv run python -m tests.learner_loop_bench --wrong-only --repeats 1      # every wrong value
    uv run python -m tests.learner_loop_bench --collection --record tests/results/collection.json

``--record`` writes every table and value the README quotes, so it runs the default set (on 2
quiet cores, about half an hour with 3 repeats).
``--collection`` times only each phase's collection (``--collect-only``), quiet and then beside
one CPU hog per core (issue 51: on a busy machine a grader that imports torch's DTensor or
TorchDynamo at collection paid for it many times over).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python -m tests.learner_loop_bench``
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from exercises import BY_ID  # noqa: E402
from first_failure import PLANTED, make_scratch, planted  # noqa: E402
from wrong_values import WRONG_VALUES, first_plant, planted_wrong, substituted  # noqa: E402

from course.results import Table, write_results  # noqa: E402
from course.verdicts import LoadMeter  # noqa: E402

DEFAULT_EXERCISES = ("3.1", "2.7", "3.8", "2.5", "4.2", "4.7")
FIRST_FAILURE_LINE = "the first failure, in"  # tests/preflight.py's note under a live failure
FAILURE_NOTE = re.compile(r"\(the first failure, in (?P<test>\S+?);")
FIRST_FAILURE_LINES = 16  # tests/preflight.py prints at most 14 lines of a message, and a cut
# pytest's line of a test file's dots, a world's progress line, or a blank one
PROGRESS = re.compile(r"^(\S+\.py [.sFExX]*\s*$|\s+world of \d+: |\s*$)")
WRONG_GOAL = 10.0  # seconds to 4.7's first real failure (issue 41)
COLLECTION_GOAL = 5.0  # seconds to collect 4.7's tests (issue 41)
LM = "phase4_production/template_lm_parallel.py"
LSP = "phase4_production/template_lm_sequence_parallel.py"
# one realistic wrong value per 4.7 function: (function, template, the reference's text, the
# mistake's); the text is the reference's own, which a completed template holds
WRONG_4_7: tuple[tuple[str, str, str, str], ...] = (
    ("token_positions", LM, "cp, zigzag=True, dim=0)", "cp, zigzag=False, dim=0)"),
    ("count_valid_tokens", LM, 'dist.all_reduce(count, group=topology.group("dp_cp"))',
     "dist.all_reduce(count, group=topology.dp_group)"),
    ("loss_share", LM, 'return summed * topology.size_of("dp_cp") / global_valid',
     "return summed / global_valid"),
    ("balance_loss_share", LM, "dist.all_reduce(counts, group=topology.cp_group)\n", ""),
    ("finish_gradients", LM, 'all_reduce_flat(dense, topology.group("dp_cp"),',
     "all_reduce_flat(dense, topology.dp_group,"),
    ("gradient_placements", LM, 'axes.add("tp")', "pass"),
    ("all_gather_sequence", LSP, "return torch.cat(parts, dim=SEQUENCE_DIM)",
     "return torch.cat(parts, dim=0)"),
    ("reduce_scatter_sequence", LSP, "dist.reduce_scatter_tensor(out, front, group=group)",
     "dist.reduce_scatter_tensor(out, front)"),
    ("enter_tensor_parallel", LSP, "return GatherSequence.apply(x, group)",
     "return copy_to_tensor_parallel_region(x, group)"),
    ("leave_tensor_parallel", LSP, "return ReduceScatterSequence.apply(y, group)",
     "return reduce_from_tensor_parallel_region(y, group)"),
)  # fmt: skip
FIRST_MESSAGE_GOAL = 5.0  # seconds, issue 29 part 1
WHOLE_GRADING_GOAL = 15.0  # seconds, "where its worlds allow"
RUN_TIMEOUT = 300.0


@dataclass(frozen=True)
class Timing:
    first: float  # seconds to the first line that names the mistake; inf when none came
    whole: float  # seconds to the command's exit
    test: str = ""  # the test of the first failure, as tests/preflight.py names it
    said: str = ""  # the first line of that failure's message
    returncode: int = 0


def command(exercise: str) -> list[str]:
    major = exercise.split(".")[0]
    marker = BY_ID[exercise].marker
    return [sys.executable, "-m", "pytest", f"tests/test_phase{major}.py", "-m", marker]


def timed_run(scratch: Path, exercise: str, needle: str, extra: Sequence[str] = ()) -> Timing:
    """Run the learner's command in ``scratch``; when the first line holding ``needle`` came."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_XDIST_AUTO_NUM_WORKERS", None)
    start = time.perf_counter()
    first = float("inf")
    test = said = ""
    before: list[str] = []
    with subprocess.Popen(
        [*command(exercise), "-p", "no:cacheprovider", *extra],
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if first == float("inf") and needle in line:
                first = time.perf_counter() - start
                if (named := FAILURE_NOTE.search(line)) is not None:
                    test = named["test"]
                    said = before[0].strip() if before else ""
            # the lines since pytest's last progress line: the message the note is under
            before = [] if PROGRESS.match(line) else [*before[-FIRST_FAILURE_LINES:], line]
            if time.perf_counter() - start > RUN_TIMEOUT:
                process.kill()
                break
        process.wait()
    return Timing(first, time.perf_counter() - start, test, said, process.returncode)


def wrong_value_times(scratch: Path, repeats: int) -> tuple[Table, dict[str, str]]:
    """4.7's first real failure and whole grading with one wrong value planted per function,
    and the collection alone, in the completed ``scratch``; the table and its summary values."""
    table = Table(
        ["planted in", "the mistake", "first failure, s", "whole grading, s"],
        note="median (slowest); one wrong value per 4.7 function, the rest of the templates "
        "completed with the reference's code",
    )
    collect = [timed_run(scratch, "4.7", "tests collected", ["--collect-only", "-q"]).first
               for _ in range(repeats)]  # fmt: skip
    table.add("(collection only)", "-", seconds(collect), "-")
    firsts: list[float] = []
    for function, template, right, wrong in WRONG_4_7:
        with substituted(scratch, template, right, wrong):
            runs = [timed_run(scratch, "4.7", FIRST_FAILURE_LINE) for _ in range(repeats)]
        firsts.append(statistics.median(t.first for t in runs))
        shown = wrong.strip() or f"(removed) {right.strip()}"
        table.add(function, f"`{shown[:60]}`", seconds([t.first for t in runs]),
                  seconds([t.whole for t in runs]))  # fmt: skip
        print(f"4.7 {function}: {seconds([t.first for t in runs])} s", flush=True)
    slowest, collection = max(firsts), statistics.median(collect)
    values = {
        "wrong_first_4_7": span(firsts),
        "collection_4_7": f"{collection:.1f} s",
        "wrong_verdict_4_7": (
            f"4.7's first real failure within {WRONG_GOAL:.0f} s: "
            f"{'met' if slowest <= WRONG_GOAL else 'not met'} (slowest median {slowest:.1f} s); "
            f"collection within {COLLECTION_GOAL:.0f} s: "
            f"{'met' if collection <= COLLECTION_GOAL else 'not met'} ({collection:.1f} s)"
        ),
    }
    return table, values


def wrong_first_times(
    scratch: Path, exercises: Sequence[str], repeats: int
) -> tuple[Table, dict[str, str], bool]:
    """Every exercise's first real failure: its wrong value (tests/wrong_values.py) planted in
    its first function of the completed ``scratch``, graded as a learner runs it; the table,
    its summary values, and whether every plant failed a test."""
    table = Table(
        ["exercise", "planted in", "the mistake", "first failure, in", "first failure, s",
         "whole grading, s"],
        note="median (slowest) of the repeats; one realistic wrong value in the exercise's "
        "first TODO function (tests/wrong_values.py), the rest of the templates completed with "
        "the reference's code; the first failure as tests/preflight.py prints it",
    )  # fmt: skip
    firsts: dict[str, float] = {}
    missed: list[str] = []  # exercises where a run failed no test: the plant was not caught
    for exercise in exercises:
        plant = first_plant(exercise)
        with planted_wrong(scratch, plant) as mistake:
            runs = [timed_run(scratch, exercise, FIRST_FAILURE_LINE) for _ in range(repeats)]
        if any(t.first == float("inf") or t.returncode == 0 for t in runs):
            missed.append(exercise)
        else:
            firsts[exercise] = statistics.median(t.first for t in runs)
        test = runs[0].test or "NOT CAUGHT: no test failed"
        table.add(exercise, f"{plant.qualname}", f"`{mistake.shown}`", test,
                  seconds([t.first for t in runs]), seconds([t.whole for t in runs]))  # fmt: skip
        print(f"{exercise} {plant.qualname}: {seconds([t.first for t in runs])} s to {test} "
              f"({seconds([t.whole for t in runs])} s whole): {runs[0].said[:120]}",
              flush=True)  # fmt: skip
    slowest = max(firsts, key=lambda ex: firsts[ex], default="")
    met = not missed and firsts[slowest] <= WRONG_GOAL
    verdict = f"the first real failure within {WRONG_GOAL:.0f} s, every exercise: "
    verdict += "met" if met else "not met"
    if slowest:
        verdict += f" (slowest median {firsts[slowest]:.1f} s, {slowest})"
    if missed:
        verdict += f"; no test failed for the wrong value planted in {', '.join(missed)}"
    found = span(list(firsts.values())) if firsts else "none"
    return table, {"wrong_first": found, "wrong_verdict": verdict}, met


PHASES = (1, 2, 3, 4)


def collect_seconds(scratch: Path, phase: int) -> float:
    """Seconds to collect ``tests/test_phaseN.py`` (``--collect-only -n 0``) in ``scratch``,
    from starting the interpreter to pytest's "collected" line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", f"tests/test_phase{phase}.py", "--collect-only", "-q",
         "-n", "0", "-p", "no:cacheprovider"],
        cwd=scratch, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    if "collected" not in done.stdout:
        raise SystemExit(f"collecting phase {phase} failed:\n{done.stdout[-2000:]}{done.stderr}")
    return time.perf_counter() - start


@contextlib.contextmanager
def cpu_hogs() -> Iterator[int]:
    """One busy process per core this process may use, for the block's length; yields how many."""
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        yield cores
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def collection_times(scratch: Path, repeats: int) -> tuple[Table, dict[str, str]]:
    """Each phase's collection, quiet and beside one CPU hog per core (issue 51: a busy machine
    must not turn collection into a minute); the table and its summary values."""
    table = Table(
        ["phase", "quiet, s", "beside a CPU hog per core, s"],
        note="median (slowest) of the repeats; `python -m pytest tests/test_phaseN.py "
        "--collect-only -q -n 0` in a scratch copy, from starting the interpreter",
    )
    quiet = {phase: [collect_seconds(scratch, phase) for _ in range(repeats)] for phase in PHASES}
    with cpu_hogs() as cores:
        busy = {phase: [collect_seconds(scratch, phase) for _ in range(repeats)]
                for phase in PHASES}  # fmt: skip
    for phase in PHASES:
        table.add(str(phase), seconds(quiet[phase]), seconds(busy[phase]))
        print(f"phase {phase}: {seconds(quiet[phase])} quiet, {seconds(busy[phase])} loaded")
    return table, {
        "collection_quiet": span([statistics.median(v) for v in quiet.values()]),
        "collection_loaded": span([statistics.median(v) for v in busy.values()]),
        "collection_hogs": f"{cores} CPU hog(s) on {cores} core(s)",
    }


def seconds(values: Sequence[float]) -> str:
    if any(v == float("inf") for v in values):
        return "none"
    return f"{statistics.median(values):.1f} ({max(values):.1f})"


def span(values: Sequence[float]) -> str:
    """``0.8-1.2 s``: the medians of the exercises, lowest to highest."""
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return f"{low} s" if low == high else f"{low}-{high} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--exercises",
        nargs="+",
        help=f"only these (default: the loop of {' '.join(DEFAULT_EXERCISES)}, and every "
        "exercise's first real failure)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--wrong-only",
        action="store_true",
        help="only each exercise's first real failure (its wrong value planted)",
    )
    parser.add_argument(
        "--record",
        metavar="PATH",
        help="write a results file (course/results): the default set only, which pages quote",
    )
    parser.add_argument(
        "--collection",
        action="store_true",
        help="only each phase's collection, quiet and beside a CPU hog per core",
    )
    args = parser.parse_args(argv)
    if args.collection:
        with tempfile.TemporaryDirectory() as tmp:
            table, measured = collection_times(
                make_scratch(Path(tmp) / "fresh", complete=False), args.repeats
            )
        print()
        print(table.to_markdown())
        if args.record:
            path = write_results(args.record, tables={"collection": table}, values=measured)
            print(f"recorded {path.relative_to(ROOT) if ROOT in path.parents else path}")
        return 0
    unknown = [ex for ex in args.exercises or () if ex not in BY_ID]
    if unknown:
        parser.error(
            f"--exercises {' '.join(unknown)}: no such exercise; choose from {', '.join(BY_ID)}"
        )
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    if args.record and (args.exercises or args.wrong_only):
        parser.error(
            "--record writes every table and value the README quotes: run it without "
            "--exercises and --wrong-only"
        )
    loop_exercises = [] if args.wrong_only else list(args.exercises or DEFAULT_EXERCISES)
    wrong_exercises = list(args.exercises or [ex for ex in BY_ID if ex in WRONG_VALUES])

    table = Table(
        [
            "exercise",
            "untouched: first message, s",
            "untouched: whole grading, s",
            "broken: first message, s",
            "broken: whole grading, s",
        ],
        note=(
            "median (slowest) of the repeats; `python -m pytest tests/test_phaseN.py -m exN_M` "
            "in a scratch copy, from starting the interpreter"
        ),
    )
    worst_first = 0.0
    medians: dict[str, list[float]] = {"first_untouched": [], "whole_untouched": [],
                                       "first_broken": [], "whole_broken": []}  # fmt: skip
    meter = LoadMeter()
    tables: dict[str, Table] = {}
    values: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        untouched = make_scratch(Path(tmp) / "untouched", complete=False)
        broken = make_scratch(Path(tmp) / "broken", complete=True)
        with meter.running(processes=2):
            for exercise in loop_exercises:
                plant = first_plant(exercise)
                fresh: list[Timing] = []
                wrong: list[Timing] = []
                for _ in range(args.repeats):
                    fresh.append(timed_run(untouched, exercise, "not written yet"))
                    with planted(broken, plant):
                        wrong.append(timed_run(broken, exercise, PLANTED))
                cells = [
                    seconds([t.first for t in fresh]),
                    seconds([t.whole for t in fresh]),
                    seconds([t.first for t in wrong]),
                    seconds([t.whole for t in wrong]),
                ]
                table.add(f"{exercise} {BY_ID[exercise].title}", *cells)
                medians["first_untouched"].append(statistics.median(t.first for t in fresh))
                medians["whole_untouched"].append(statistics.median(t.whole for t in fresh))
                medians["first_broken"].append(statistics.median(t.first for t in wrong))
                medians["whole_broken"].append(statistics.median(t.whole for t in wrong))
                worst_first = max(worst_first, medians["first_untouched"][-1],
                                  medians["first_broken"][-1])  # fmt: skip
                print(f"{exercise}: " + " | ".join(cells), flush=True)
            if "4.7" in loop_exercises:
                tables["wrong_4_7"], found = wrong_value_times(broken, args.repeats)
                values.update(found)
            first_table, found, wrong_met = wrong_first_times(broken, wrong_exercises,
                                                              args.repeats)  # fmt: skip
            values.update(found)
    load = meter.read()
    met = worst_first <= FIRST_MESSAGE_GOAL
    if loop_exercises:
        print()
        print(table.to_markdown())
        values["verdict"] = (
            f"first message within {FIRST_MESSAGE_GOAL:.0f} s: "
            f"{'met' if met else 'not met'} (slowest median {worst_first:.1f} s); {load.text()}"
        )
        print(values["verdict"])
        values["slowest_first_message"] = f"{worst_first:.1f} s"
        values.update({key: span(found) for key, found in medians.items()})
        tables = {"loop": table, **tables}
    if "wrong_4_7" in tables:
        print()
        print(tables["wrong_4_7"].to_markdown())
        print(values["wrong_verdict_4_7"])
    tables["wrong_first"] = first_table
    values["wrong_verdict"] += f"; {load.text()}"
    print()
    print(first_table.to_markdown())
    print(values["wrong_verdict"])
    if args.record:
        path = write_results(args.record, tables=tables, values=values)
        print(f"recorded {path.relative_to(ROOT) if ROOT in path.parents else path}")
    return 0 if met and wrong_met else 1


if __name__ == "__main__":
    raise SystemExit(main())
