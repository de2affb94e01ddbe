"""Verdicts on measured goals that the machine's load cannot flip: met, not met, or inconclusive.

A guide's speed goal compares your code with a baseline (your ring with ``dist.all_reduce``,
your DDP with torch's). On a shared machine one set of medians is not enough: a burst of other
work during your half of the run makes a correct ring look slow. So every timed goal is judged
the same way, by ``tests.bench`` (tests/benches/) and by the benchmarks whose results the
guides quote (``solutions/phase3_multi_node/benchmarks/collectives.py``, ``benchmarks/ddp.py``):

1. **Interleaved repeats** (:func:`interleave`): A, B, A, B, ... in the same processes, so that
   load which comes and goes hits both alike.
2. **One ratio per repeat pair** (:func:`pair_ratios`): repeat i of A against repeat i of B
   (for a goal without a baseline, one value per repeat: a step's bubble, a repeat's balance).
3. **Their spread** (:class:`Spread`): the median and the interquartile range, the middle half
   of the values (``statistics.quantiles(n=4, method="inclusive")``; one value: itself).
4. **Three outcomes** (:meth:`Goal.judge`):

   * ``goal met``: the whole spread is on the goal's side (at-least goals: the lower quartile
     reaches the target; at-most goals: the upper quartile stays within it);
   * ``goal not met``: the whole spread is on the wrong side, *and* the machine is not busy;
   * ``inconclusive``, otherwise: ``the machine is busy (load X on N cores), re-run`` when the
     spread is on the wrong side of a busy machine, ``the spread (a-b) straddles the goal,
     re-run with more repeats`` when the goal lies inside the spread.

   Exit codes (``tests.bench``): 0 met, 1 not met, 3 inconclusive; 2 stays "could not run".

**Busy**, exactly (:class:`Load`, :class:`LoadMeter`). Two readings, the larger wins:

* ``before``: the kernel's 1-minute load average (``os.getloadavg()[0]``, runnable tasks
  damped over a minute) read just before the first measured world starts: work that was
  running the minute before (the bench's own launcher, importing torch, adds a few hundredths);
* ``other_cpu``: the CPU other processes used while the measurement ran, in cores: the busy
  time of the cores this process may run on (``/proc/stat``) minus the CPU time of this run's
  own process tree (itself, its fork server, its ranks, alive or reaped: see
  :mod:`course.cpu_time`), over the wall time. The load average cannot give this: a world's own
  gloo threads are runnable in bursts (a 4-rank world sampled at a median of 4 runnable tasks,
  bursts to 23), so that ``after - own`` read 1.22 cores of "other work" on a machine whose
  load was 0.09 the minute before;
* **other work** ``= max(before, other_cpu)``; where ``/proc`` is missing (not Linux), or the
  measurement lasted less than ``MIN_CPU_WALL`` (1 s: a few clock ticks would read as cores),
  ``max(before, after - own)`` as before: ``after`` the 1-minute load when the last world has
  ended, ``own`` the most this run's worlds of P computing processes, from t0 to t1, can have
  added to it, ``P·(exp(-(now-t1)/60) - exp(-(now-t0)/60))``;
* **spare cores** ``= max(0, C - R)``: C the cores this process may run on
  (``len(os.sched_getaffinity(0))``), R the most processes the run needs at once (a world of 4
  ranks on 2 cores: none spare);
* **busy** when other work ``> spare cores + 0.5``: more than half a core's worth of runnable
  work beyond the cores the measurement leaves free.

``other_cpu`` is exact up to a clock tick per process; ``before`` covers the minute before. A
machine that was busy the minute before and quiet since reads busy: re-running a minute later
settles it.

    meter = LoadMeter()
    with meter.running(processes=2):
        times = interleave({"ours": ..., "torch": ...}, 20)  # each returns its seconds
    a, b = times["ours"], times["torch"]
    goal = Goal("step time, your DDP / torch DDP", 1.05, at_least=False)
    verdict = goal.judge(pair_ratios(a, b), meter.read())
    print(verdict.line)       # "goal met: ...", "goal not met: ...", "inconclusive: ..."
    sys.exit(verdict.code)

Exact goals (bytes equal to a formula) have one number and no load: :meth:`Goal.verdict`.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from course import cpu_time

MET, NOT_MET, INCONCLUSIVE = "met", "not met", "inconclusive"
EXIT_MET, EXIT_NOT_MET, EXIT_COULD_NOT_RUN, EXIT_INCONCLUSIVE = 0, 1, 2, 3
BUSY_MARGIN = 0.5  # cores' worth of other runnable work tolerated beyond the spare cores
DECAY_SECONDS = 60.0  # the 1-minute load average's time constant
# Below this many seconds of measurement the CPU reading is left out (the load average decides):
# a clock tick is 10 ms per process, and a short window turns a few ticks into cores' worth
MIN_CPU_WALL = 1.0


# ----------------------------------------------------------------------------- repeats


def interleave(runs: Mapping[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each function of ``runs`` once per repeat, in order, ``repeats`` times (A, B, A, B,
    ...): repeat i of every one runs before repeat i+1 of any. Each returns the seconds it
    measured (e.g. the slowest rank's); returns them by name, in repeat order."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(float(run()))
    return times


def pair_ratios(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
    """``top[i] / bottom[i]`` for each repeat pair i (your time / the baseline's for a time
    goal; the baseline's time / yours for a bandwidth goal)."""
    if len(top) != len(bottom) or not top:
        raise ValueError(f"pairs need as many repeats on both sides: {len(top)} and {len(bottom)}")
    return [t / b if b > 0 else math.inf for t, b in zip(top, bottom, strict=True)]


@dataclass(frozen=True)
class Spread:
    """The median of some values and their interquartile range (the middle half)."""

    median: float
    low: float  # lower quartile
    high: float  # upper quartile
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        values = [float(v) for v in values]
        if not values:
            raise ValueError("no values to judge")
        if len(values) == 1:
            return cls(values[0], values[0], values[0], 1)
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, len(values))

    def text(self, unit: str = "") -> str:
        """``1.02x`` (one value), or ``0.98-1.05x``."""
        if _num(self.low) == _num(self.high):
            return f"{_num(self.low)}{unit}"
        return f"{_num(self.low)}-{_num(self.high)}{unit}"


# ----------------------------------------------------------------------------- the load


def one_minute_load() -> float:
    """The kernel's 1-minute load average (``os.getloadavg()[0]``)."""
    return os.getloadavg()[0]


def usable_cores() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``; else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Load:
    """The load around a measurement (module docstring: "Busy, exactly")."""

    before: float  # 1-minute load when the measurement started
    after: float  # 1-minute load when it ended
    own: float  # the most this run's own processes can have added to ``after``
    cores: int  # cores this process may run on
    needs: int  # the most processes the run kept busy at once
    other_cpu: float | None = None  # cores' worth of other processes' CPU while it ran

    @property
    def others(self) -> float:
        """Other work, in cores: ``max(before, other_cpu)``; without a CPU reading,
        ``max(before, after - own)``."""
        if self.other_cpu is not None:
            return max(self.before, self.other_cpu, 0.0)
        return max(self.before, self.after - self.own, 0.0)

    @property
    def spare(self) -> int:
        """Cores the measurement leaves free: ``max(0, cores - needs)``."""
        return max(0, self.cores - self.needs)

    @property
    def busy(self) -> bool:
        return self.others > self.spare + BUSY_MARGIN

    def text(self) -> str:
        """``load 3.90 on 2 cores, 2.10 of it other work`` (the load: the larger reading)."""
        load = max(self.before, self.after)
        return f"load {load:.2f} on {self.cores} cores, {self.others:.2f} of it other work"

    @classmethod
    def quiet(cls, cores: int = 2, needs: int = 2) -> Load:
        """A machine with nothing else running (tests, and results without a reading)."""
        return cls(0.0, 0.0, 0.0, cores, needs)


@dataclass
class LoadMeter:
    """Reads the load before a measurement and after it, and remembers what the run itself ran
    (``with meter.running(processes=P): ...`` around each world) to take it out again."""

    clock: Callable[[], float] = time.monotonic
    before: float = field(default_factory=one_minute_load)
    # the CPU readings (None: course.cpu_time's, looked up when read, so a test can replace them)
    busy_seconds: Callable[[], float | None] | None = None
    own_seconds: Callable[[], float] | None = None
    _segments: list[tuple[float, float, int]] = field(default_factory=list)
    _needs: int = 0
    _start: tuple[float, float | None, float] = (0.0, None, 0.0)

    def __post_init__(self) -> None:
        self._start = (self.clock(), self._busy(), self._own())

    def _busy(self) -> float | None:
        return (self.busy_seconds or cpu_time.machine_busy_seconds)()

    def _own(self) -> float:
        return (self.own_seconds or cpu_time.tree_cpu_seconds)()

    @contextlib.contextmanager
    def running(self, processes: int, *, computing: bool = True) -> Iterator[None]:
        """Around a world of ``processes`` ranks. ``computing=False`` for ranks that mostly
        sleep (they still need their cores to wake on time, but add no load)."""
        started = self.clock()
        try:
            yield
        finally:
            self._segments.append((started, self.clock(), processes if computing else 0))
            self._needs = max(self._needs, processes)

    def read(self) -> Load:
        now, after = self.clock(), one_minute_load()
        own = sum(
            p * (math.exp(-(now - t1) / DECAY_SECONDS) - math.exp(-(now - t0) / DECAY_SECONDS))
            for t0, t1, p in self._segments
        )
        started, busy_then, own_then = self._start
        busy_now, wall = self._busy(), now - started
        other_cpu = None
        if busy_then is not None and busy_now is not None and wall >= MIN_CPU_WALL:
            others = (busy_now - busy_then) - (self._own() - own_then)
            other_cpu = max(0.0, others) / wall
        return Load(self.before, after, own, usable_cores(), max(1, self._needs), other_cpu)


# ----------------------------------------------------------------------------- the verdict


def _num(value: float) -> str:
    """3 significant digits; a whole number in full (2304 bytes, not 2.3e+03)."""
    if math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return f"{value:.3g}"


@dataclass(frozen=True)
class Verdict:
    """One cell's (or a whole run's) outcome, its reason, and the sentence that says it."""

    outcome: str  # MET, NOT_MET or INCONCLUSIVE
    reason: str  # "" (met, not met), "busy" or "straddles" (inconclusive)
    spread: Spread
    cell: str
    line: str

    @property
    def code(self) -> int:
        """The exit code: 0 met, 1 not met, 3 inconclusive."""
        return {MET: EXIT_MET, NOT_MET: EXIT_NOT_MET}.get(self.outcome, EXIT_INCONCLUSIVE)

    @property
    def short(self) -> str:
        """For a table's cell: ``met``, ``not met``, ``inconclusive (busy)``, ...``(spread)``."""
        if self.outcome != INCONCLUSIVE:
            return self.outcome
        return f"inconclusive ({'busy' if self.reason == 'busy' else 'spread'})"


@dataclass(frozen=True)
class Goal:
    """A goal a guide states: ``what`` compared with ``target`` (at least, or at most)."""

    what: str  # e.g. "ring busbw / dist.all_reduce busbw at 16 and 64 MiB"
    target: float
    at_least: bool = True  # True: measured >= target meets it; False: measured <= target
    unit: str = "x"

    def met(self, measured: float) -> bool:
        return measured >= self.target if self.at_least else measured <= self.target

    def _sign(self) -> str:
        return ">=" if self.at_least else "<="

    def verdict(self, measured: float) -> str:
        """An exact goal (bytes, counts), one number: ``goal met: ... = 0 bytes (goal <= 0
        bytes), by 0 bytes`` or ``goal not met: ..., short by ...``."""
        margin = abs(measured - self.target)
        shown = f"{_num(measured)}{self.unit} (goal {self._sign()} {_num(self.target)}{self.unit})"
        if self.met(measured):
            return f"goal met: {self.what} = {shown}, by {_num(margin)}{self.unit}"
        return f"goal not met: {self.what} = {shown}, short by {_num(margin)}{self.unit}"

    def judge(
        self,
        values: Sequence[float],
        load: Load,
        *,
        cell: str = "",
        per: str = "pair",
        more: str = "more repeats",
    ) -> Verdict:
        """The three-way verdict on one cell's values (one per repeat pair). ``per`` names a
        value ("pair", "step", "repeat"); ``more`` says how to re-run with more of them."""
        spread = Spread.of(values)
        if self.at_least:
            right, wrong = spread.low >= self.target, spread.high < self.target
        else:
            right, wrong = spread.high <= self.target, spread.low > self.target
        where = f" ({cell})" if cell else ""
        plural = per if spread.n == 1 else f"{per}s"
        shown = (
            f"{self.what}{where} = {_num(spread.median)}{self.unit} (middle half "
            f"{spread.text(self.unit)} over {spread.n} {plural}; goal {self._sign()} "
            f"{_num(self.target)}{self.unit})"
        )
        margin = f"{_num(abs(spread.median - self.target))}{self.unit}"
        if right:
            return Verdict(MET, "", spread, cell, f"goal met: {shown}, by {margin}")
        if wrong and not load.busy:
            line = (
                f"goal not met: {shown}, short by {margin}; the machine was quiet ({load.text()})"
            )
            return Verdict(NOT_MET, "", spread, cell, line)
        if wrong:
            line = f"inconclusive: the machine is busy ({load.text()}), re-run: {shown}"
            return Verdict(INCONCLUSIVE, "busy", spread, cell, line)
        busy = f" and the machine is busy ({load.text()})" if load.busy else ""
        line = (
            f"inconclusive: the spread ({spread.text(self.unit)}) straddles the goal{busy}, "
            f"re-run with {more}: {shown}"
        )
        return Verdict(INCONCLUSIVE, "straddles", spread, cell, line)

    def judge_cells(
        self,
        cells: Mapping[str, Sequence[float]],
        load: Load,
        *,
        per: str = "pair",
        more: str = "more repeats",
    ) -> tuple[Verdict, list[Verdict]]:
        """Every cell judged, and the run's verdict: not met if any cell is not met (the worst
        of them), else inconclusive if any cell is (the worst of them), else met (the cell
        nearest the goal). Returns (the run's, the cells' in order)."""
        verdicts = [
            self.judge(values, load, cell=cell, per=per, more=more)
            for cell, values in cells.items()
        ]
        if not verdicts:
            raise ValueError("no cells to judge")

        def badness(v: Verdict) -> float:  # further on the wrong side = worse
            return self.target - v.spread.median if self.at_least else v.spread.median - self.target

        for outcome in (NOT_MET, INCONCLUSIVE, MET):
            mine = [v for v in verdicts if v.outcome == outcome]
            if mine:
                worst = max(mine, key=badness)
                if len(verdicts) > 1:
                    count = f"{len(mine)} of {len(verdicts)} cells {outcome}"
                    if outcome == MET:
                        count = f"all {len(verdicts)} cells met, this one nearest the goal"
                    worst = Verdict(
                        worst.outcome, worst.reason, worst.spread, worst.cell,
                        f"{worst.line} [{count}]",
                    )  # fmt: skip
                return worst, verdicts
        raise AssertionError("unreachable")


def tally(verdicts: Sequence[Verdict]) -> str:
    """``3 met, 1 inconclusive (spread) of 4``: the cells' outcomes, for a results file."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.short] = counts.get(v.short, 0) + 1
    order = [MET, NOT_MET, "inconclusive (busy)", "inconclusive (spread)"]
    parts = [f"{counts[k]} {k}" for k in order if counts.get(k)]
    return f"{', '.join(parts)} of {len(verdicts)}"
