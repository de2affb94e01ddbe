"""How fast, and in which words, a world's trouble is reported: deadlock, hang, endless loop, slow.

The harness (course/world.py) must tell four worlds apart, each in its own words (issue 51):

* **a deadlock** the ranks' ledgers prove (rank 1 skips an all-reduce rank 0 waits in): reported
  at once, "deadlocked", ``DEADLOCK_SETTLE`` after it sets in;
* **a hang** the ledgers cannot see (every rank asleep: no message, no collective, no CPU):
  "still running after ... none of them using the CPU or communicating", at the deadline;
* **an endless loop** (rank 0 computes forever, rank 1 waits for it): "still computing", at the
  ceiling (10x the deadline), with the loop's line;
* **a slow world** (rank 1 computes for 1.5x the deadline beside one CPU hog per core, rank 0
  waits in an all-reduce): finished, no report.

Each is timed from ``run_world`` to the error (or the result), in worlds of 2 with the default
deadline (``world_timeout()``: 20 s, so the loop's row takes 200 s). ::

    uv run python -m tests.hang_report_bench
    uv run python -m tests.hang_report_bench --record tests/results/hang_reports.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python -m tests.hang_report_bench``
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from course.results import Table, write_results  # noqa: E402
from course.verdicts import LoadMeter  # noqa: E402
from course.world import (  # noqa: E402
    CEILING_FACTOR,
    WorldError,
    WorldHung,
    WorldStillComputing,
    run_world,
    world_timeout,
)


def skips_the_all_reduce() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


def sleeps_forever() -> None:
    time.sleep(3600)


def computes_forever() -> None:
    if dist.get_rank() == 0:
        while True:
            sum(range(1000))
    dist.all_reduce(torch.ones(1))


def computes_past_the_deadline(seconds: float) -> float:
    if dist.get_rank() == 1:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def timed(work: Callable[[], Any]) -> tuple[float, str]:
    """Seconds from the call to its end, and the first line of what it reported."""
    start = time.monotonic()
    try:
        work()
        said = "finished, no report"
    except WorldError as exc:
        kind = {WorldHung: "WorldHung", WorldStillComputing: "WorldStillComputing"}.get(
            type(exc), type(exc).__name__
        )
        said = f"{kind}: {str(exc).splitlines()[0]}"
    return time.monotonic() - start, said


def with_cpu_hogs(work: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        cores = len(os.sched_getaffinity(0))
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        try:
            return work()
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", metavar="PATH", help="write the results file")
    args = parser.parse_args(argv)
    deadline = world_timeout()
    run_world(computes_past_the_deadline, 2, (0.0,))  # the fork server starts outside the timing
    cases: list[tuple[str, str, str, Callable[[], Any]]] = [
        ("deadlock", "rank 1 skips an all-reduce", "deadlocked",
         lambda: run_world(skips_the_all_reduce, 2)),
        ("hang", "every rank asleep", "none of them using the CPU",
         lambda: run_world(sleeps_forever, 2)),
        ("slow", f"rank 1 computes {1.5 * deadline:g} s beside a CPU hog per core",
         "finished, no report",
         with_cpu_hogs(lambda: run_world(computes_past_the_deadline, 2, (1.5 * deadline,)))),
        ("loop", "rank 0 computes forever", "still computing: not a deadlock",
         lambda: run_world(computes_forever, 2)),
    ]  # fmt: skip
    table = Table(
        ["world of 2", "planted", "reported after, s", "first line of the report"],
        note=f"deadline {deadline:g} s (DTFS_WORLD_TIMEOUT), ceiling {CEILING_FACTOR:g}x it",
    )
    values: dict[str, str] = {"deadline": f"{deadline:g} s"}
    right = True
    meter = LoadMeter()
    with meter.running(processes=2):
        for key, planted, words, work in cases:
            seconds, said = timed(work)
            right = right and words in said
            table.add(key, planted, f"{seconds:.1f}", said[:150])
            values[f"{key}_s"] = f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
            print(f"{key}: {seconds:.1f} s: {said[:150]}", flush=True)
    print()
    print(table.to_markdown())
    print(f"each in its own words: {'yes' if right else 'NO'}; {meter.read().text()}")
    if args.record:
        path = write_results(args.record, tables={"reports": table}, values=values)
        print(f"recorded {path.relative_to(ROOT) if ROOT in path.parents else path}")
    return 0 if right else 1


if __name__ == "__main__":
    raise SystemExit(main())
