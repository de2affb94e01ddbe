"""``uv run python -m tests.bench N.M``, the learner's measuring command, works as its guides say.

Each exercise with a goal beyond right values has one command that measures the learner's code
against it (tests/bench.py, tests/benches/). These checks keep its promises: every goal is
listed; on untouched templates each command stops at its *own* exercise's TODO, in one line,
before any world starts; and it needs only that exercise: 3.1's ring measured with the ring
written and 3.2 (halving-doubling, the alpha-beta fit) still untouched prints the table and the
verdict, the case the phase 3 guide promises.

A timed verdict cannot be flipped by load (course/verdicts.py): fabricated repeats and load
readings check the three outcomes (met, not met on a quiet machine, inconclusive when the
machine is busy or the spread straddles the goal) and their exit codes (0, 1, 3), without a
world or a real load.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import bench
import pytest
from exercises import BY_ID

from course import template_maker, verdicts
from course.impl import unwritten_todo
from course.verdicts import Goal, Load, LoadMeter, Spread, interleave, pair_ratios

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("course", "phase1_data_parallel", "phase2_advanced", "phase3_multi_node",
          "phase4_production", "solutions", "tests")  # fmt: skip

pytestmark = pytest.mark.harness
VERDICT_STARTS = ("goal met:", "goal not met:", "inconclusive:")
RING = Goal("ring busbw / dist.all_reduce busbw", 0.95)  # at least
DDP = Goal("step time, your DDP / torch DDP", 1.05, at_least=False)  # at most
QUIET = Load(before=0.1, after=0.2, own=0.0, cores=2, needs=2)
BUSY = Load(before=3.4, after=3.9, own=0.0, cores=2, needs=2)


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
        pytest.skip(
            f"your templates of {exercise} are written: tests.bench {exercise} measures them"
        )
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
        # what is checked is which code runs and what is printed, not the figures: few repeats
        [sys.executable, "-m", "tests.bench", "3.1", "--repeats", "3"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode in (0, 1, 3), f"exit {done.returncode}, expected 0, 1 or 3:\n{out}"
    assert "| 16 MiB |" in out and "| 64 MiB |" in out, f"no 16 and 64 MiB rows:\n{out}"
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(VERDICT_STARTS), f"last line {verdict!r}:\n{out}"
    assert "TODO 3.2" not in out, f"3.1's measurement reached 3.2:\n{out}"


# ----------------------------------------------------------------------------- the verdict rule


def test_a_spread_on_the_right_side_is_met_even_on_a_busy_machine() -> None:
    for load in (QUIET, BUSY):
        v = RING.judge([1.02, 1.10, 0.99, 1.05, 1.20], load)
        assert (v.outcome, v.code) == ("met", 0), v.line
        assert v.line.startswith("goal met: ring busbw") and "over 5 pairs" in v.line, v.line
    v = DDP.judge([0.97, 1.01, 1.03, 0.99], BUSY)
    assert v.outcome == "met", v.line


def test_a_spread_on_the_wrong_side_is_not_met_only_on_a_quiet_machine() -> None:
    slow = [0.80, 0.86, 0.83, 0.85, 0.90]
    v = RING.judge(slow, QUIET)
    assert (v.outcome, v.code) == ("not met", 1), v.line
    assert v.line.startswith("goal not met: ring busbw") and "the machine was quiet" in v.line
    v = RING.judge(slow, BUSY)
    assert (v.outcome, v.reason, v.code) == ("inconclusive", "busy", 3), v.line
    assert v.line.startswith("inconclusive: the machine is busy (load 3.90 on 2 cores"), v.line
    assert ", re-run" in v.line, v.line


def test_a_spread_across_the_goal_is_inconclusive_with_more_repeats_asked() -> None:
    v = RING.judge([0.90, 0.99, 0.91, 1.00, 0.93, 0.98], QUIET, more="more repeats (--repeats 12)")
    assert (v.outcome, v.reason, v.code) == ("inconclusive", "straddles", 3), v.line
    assert v.line.startswith("inconclusive: the spread (0.91") and "straddles the goal" in v.line
    assert "re-run with more repeats (--repeats 12)" in v.line, v.line
    v = DDP.judge([1.0, 1.1, 1.02, 1.08], BUSY)  # straddling and busy: both said
    assert v.reason == "straddles" and "the machine is busy" in v.line, v.line


def test_the_spread_is_the_middle_half_so_one_outlier_does_not_decide() -> None:
    spread = Spread.of([1.10, 1.12, 1.08, 1.11, 0.40])  # one pair hit by a burst of load
    assert spread.median == pytest.approx(1.10)
    assert (spread.low, spread.high) == (pytest.approx(1.08), pytest.approx(1.11))
    assert RING.judge([1.10, 1.12, 1.08, 1.11, 0.40], QUIET).outcome == "met"
    assert Spread.of([1.5]) == Spread(1.5, 1.5, 1.5, 1)


def test_cells_any_not_met_decides_then_any_inconclusive() -> None:
    met, slow, across = [1.1, 1.2, 1.15], [0.7, 0.8, 0.75], [0.9, 1.0, 0.95, 0.97]
    overall, cells = RING.judge_cells({"16 MiB": met, "64 MiB": slow}, QUIET)
    assert overall.outcome == "not met" and overall.cell == "64 MiB", overall.line
    assert overall.line.endswith("[1 of 2 cells not met]"), overall.line
    assert [c.short for c in cells] == ["met", "not met"]
    overall, _ = RING.judge_cells({"16 MiB": met, "64 MiB": across}, QUIET)
    assert overall.outcome == "inconclusive" and overall.cell == "64 MiB", overall.line
    overall, _ = RING.judge_cells({"16 MiB": [1.3, 1.4], "64 MiB": met}, QUIET)
    assert overall.outcome == "met" and overall.cell == "64 MiB", overall.line
    assert verdicts.tally(cells) == "1 met, 1 not met of 2"


def test_pairs_alternate_and_give_one_ratio_each() -> None:
    calls: list[str] = []

    def run(name: str, seconds: float) -> Callable[[], float]:
        def timed() -> float:
            calls.append(name)
            return seconds

        return timed

    times = interleave({"ours": run("A", 2.0), "theirs": run("B", 4.0)}, 3)
    assert calls == ["A", "B", "A", "B", "A", "B"]
    assert pair_ratios(times["ours"], times["theirs"]) == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="as many repeats"):
        pair_ratios([1.0], [1.0, 2.0])


def fake_machine(monkeypatch: pytest.MonkeyPatch, loads: list[float], cores: int) -> list[float]:
    """os.getloadavg answers ``loads`` in turn; the affinity mask has ``cores`` CPUs; the
    returned list is the clock a LoadMeter reads (set clock[0] to move time)."""
    readings = iter(loads)
    monkeypatch.setattr(verdicts.os, "getloadavg", lambda: (next(readings), 0.0, 0.0))
    # no CPU reading: the fabricated runs take no time, and the real machine's other work
    # (another test worker) would be read as this run's surroundings
    monkeypatch.setattr(verdicts.cpu_time, "machine_busy_seconds", lambda: None)
    monkeypatch.setattr(verdicts.os, "sched_getaffinity", lambda pid: set(range(cores)))
    return [0.0]


@pytest.mark.parametrize(
    ("before", "after", "ranks", "cores", "busy"),
    [
        (0.1, 1.3, 2, 2, False),  # 2 ranks for 60 s add up to 2(1 - 1/e) = 1.26: only them
        (0.1, 3.5, 2, 2, True),  # 2.2 of other work while they ran
        (2.6, 2.6, 2, 2, True),  # busy the minute before
        (0.4, 0.4, 2, 2, False),  # a quiet machine: within half a core
        (0.1, 3.5, 2, 8, False),  # 2.2 of other work, on 6 spare cores
        (1.2, 1.2, 4, 2, True),  # 4 ranks on 2 cores: no spare core
    ],
)
def test_without_cpu_times_busy_is_the_load_beyond_the_spare_cores(
    monkeypatch: pytest.MonkeyPatch,
    before: float,
    after: float,
    ranks: int,
    cores: int,
    busy: bool,
) -> None:
    """Where /proc is missing, the load average alone: ``max(before, after - own)``."""
    clock = fake_machine(monkeypatch, [before, after], cores)
    meter = LoadMeter(clock=lambda: clock[0], busy_seconds=lambda: None)
    with meter.running(processes=ranks):
        clock[0] = 60.0
    load = meter.read()
    assert load.cores == cores and load.needs == ranks and load.other_cpu is None
    assert load.busy is busy, (load, load.others, load.spare)


@pytest.mark.parametrize(
    ("before", "busy_cpu", "own_cpu", "ranks", "cores", "others", "busy"),
    [
        # 4 ranks keep 2 cores full for 60 s and nothing else runs: quiet, whatever the load
        # average made of their gloo threads (the old estimate read 1.22 here, dc4409a)
        (0.09, 120.0, 120.0, 4, 2, 0.09, False),
        (0.1, 120.0, 80.0, 2, 2, 40 / 60, True),  # another process took 2/3 of a core
        (0.1, 120.0, 100.0, 2, 2, 20 / 60, False),  # a third of a core: within the margin
        (2.6, 120.0, 120.0, 2, 2, 2.6, True),  # busy the minute before
        (0.1, 240.0, 100.0, 2, 8, 140 / 60, False),  # 2.3 cores of other work, 6 spare cores
    ],
)
def test_other_work_is_the_cores_busy_time_minus_this_runs_own(
    monkeypatch: pytest.MonkeyPatch,
    before: float,
    busy_cpu: float,
    own_cpu: float,
    ranks: int,
    cores: int,
    others: float,
    busy: bool,
) -> None:
    clock = fake_machine(monkeypatch, [before, 5.0], cores)  # the load average after: ignored
    cpu = {"busy": 1000.0, "own": 10.0}
    meter = LoadMeter(
        clock=lambda: clock[0], busy_seconds=lambda: cpu["busy"], own_seconds=lambda: cpu["own"]
    )
    with meter.running(processes=ranks):
        clock[0] = 60.0
        cpu["busy"] += busy_cpu
        cpu["own"] += own_cpu
    load = meter.read()
    assert load.others == pytest.approx(others), load
    assert load.busy is busy, (load, load.others, load.spare)


def test_this_runs_own_cpu_counts_its_worlds_ranks_after_they_end() -> None:
    """A world's ranks are the fork server's children, reaped when they end: their CPU moves
    into the fork server's children's time and stays in this process tree's total."""
    from course import cpu_time
    from course.world import run_world

    run_world(_spin_for, 2, (0.0,))  # the fork server is up: its start is not counted
    before = cpu_time.tree_cpu_seconds()
    run_world(_spin_for, 2, (1.0,))
    used = cpu_time.tree_cpu_seconds() - before
    assert used >= 2.0, f"2 ranks used 1 CPU s each; the tree's CPU grew by {used:.2f} s"


def _spin_for(seconds: float) -> None:
    """Use ``seconds`` of CPU (not of the clock: a busy machine gives less CPU per second)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_sleeping_ranks_need_cores_but_add_no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = fake_machine(monkeypatch, [0.1, 1.3], 2)
    meter = LoadMeter(clock=lambda: clock[0], busy_seconds=lambda: None)
    with meter.running(processes=2, computing=False):
        clock[0] = 60.0
    load = meter.read()
    assert load.own == 0.0 and load.busy, load  # the 1.3 is other work


def fabricated_ring_run(
    monkeypatch: pytest.MonkeyPatch, ring_s: float, loads: tuple[float, float]
) -> tuple[int, str]:
    """tests.bench 3.1 on fabricated timings (no world): gloo's iterations take 10 ms, the
    ring's ``ring_s`` give or take 5%; the load reads ``loads`` (before, after)."""
    from benches import bench_3_1_ring

    from solutions.phase3_multi_node.benchmarks import collectives as collectives

    def run_benchmark(worlds: list[int], sizes: list[int], *args: object, **kwargs: object):
        rows = []
        for nbytes in sizes:
            gloo = tuple(0.010 for _ in range(8))
            ring = tuple(ring_s * (1 + 0.05 * ((-1) ** i) * (i % 3)) for i in range(8))
            for name, times in (("ring", ring), ("dist.all_reduce", gloo)):
                rows.append(collectives.Row(2, nbytes, name, sorted(times)[4], 8, times))
        return rows

    monkeypatch.setattr(collectives, "run_benchmark", run_benchmark)
    fake_machine(monkeypatch, list(loads), 2)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = bench_3_1_ring.main(["--impl", "solutions"])
    return code, buffer.getvalue()


@pytest.mark.parametrize(
    ("ring_s", "loads", "code", "start"),
    [
        (0.008, (0.1, 0.1), 0, "goal met:"),
        (0.0125, (0.1, 0.1), 1, "goal not met:"),
        (0.0125, (3.0, 3.2), 3, "inconclusive: the machine is busy (load 3.20 on 2 cores"),
        (0.0105, (0.1, 0.1), 3, "inconclusive: the spread ("),
    ],
)
def test_tests_bench_exits_0_1_or_3_with_the_verdict_last(
    monkeypatch: pytest.MonkeyPatch,
    ring_s: float,
    loads: tuple[float, float],
    code: int,
    start: str,
) -> None:
    got, out = fabricated_ring_run(monkeypatch, ring_s, loads)
    last = out.strip().splitlines()[-1]
    assert (got, last[: len(start)]) == (code, start), out
    assert "| 2 | 16 MiB |" in out and "middle half" in out, out


# ----------------------------------------------------------------------------- 3.8


def test_3_8_counts_the_reference_all_to_all_bytes_exactly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["3.8", "--impl", "solutions", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "| ep | experts | capacity factor |" in out and "| 2 | 4 | 1 |" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("goal met: largest difference") and "= 0 bytes" in last, out
