"""CPU time, read from Linux's ``/proc``: each thread's, a process tree's, the machine's.

Two questions of the course need CPU time rather than the clock. Is a rank of a world moving
(:mod:`course.rank_activity`: a computing thread's time grows, a blocked one's stays flat)? And
how much of the machine did *other* work take while a benchmark ran (:class:`course.verdicts.
LoadMeter`: the cores' busy time minus what this run's own processes used)? The load average
cannot answer the second: it counts runnable tasks, and a world's own gloo threads are runnable
in bursts (a 4-rank world's ``procs_running`` was sampled at a median of 4, bursts to 23), so a
quiet machine read busy.

proc(5): ``/proc/<pid>/task/<tid>/stat`` fields 14-15 are a thread's user and system time;
``/proc/<pid>/stat`` fields 14-17 a process's own (all its threads, exited ones included) and
its waited-for children's; ``/proc/<pid>/task/<tid>/children`` lists a thread's child processes;
``/proc/stat``'s ``cpuN`` lines each core's time by state, in clock ticks. A process this tree
started and already reaped is counted in its parent's children's time, so a tree's total keeps
the CPU of the ranks of worlds that have ended (the fork server reaps its ranks). Elsewhere than
Linux every reading is ``None`` or empty, and callers fall back to what they did before.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
PROC = Path("/proc")
# /proc/stat's columns after "cpuN": user nice system idle iowait irq softirq steal guest
# guest_nice; busy is everything but idle and iowait (guest time is inside user already).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def _stat_fields(text: str) -> list[str]:
    """The fields after the command name (which may hold spaces and parentheses): index 0 is
    field 3 of proc(5), so field n is index n - 3."""
    return text[text.rindex(")") + 2 :].split()


def tasks(pid: int) -> list[Path]:
    """The ``task`` folders of ``pid``'s threads (empty when it is gone)."""
    try:
        return list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    kids: list[int] = []
    for task in tasks(pid):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.append(current)
            todo += children(current)
    return found


def thread_ticks(pid: int) -> dict[tuple[int, int], int]:
    """CPU ticks of every live thread of ``pid`` and of its descendants, by (pid, tid)."""
    out: dict[tuple[int, int], int] = {}
    for process in tree(pid):
        for task in tasks(process):
            try:
                fields = _stat_fields((task / "stat").read_text())
                out[(process, int(task.name))] = int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended between the listing and the read
    return out


def tree_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds used by ``pid`` (default: this process) and everything it started: each live
    process's own time and its reaped children's."""
    total = 0
    for process in tree(os.getpid() if pid is None else pid):
        try:
            fields = _stat_fields((PROC / str(process) / "stat").read_text())
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))
        except (OSError, ValueError, IndexError):
            continue
    return total / TICK


def machine_busy_seconds() -> float | None:
    """Busy seconds of the cores this process may run on, since boot (None: not Linux)."""
    try:
        lines = (PROC / "stat").read_text().splitlines()
    except OSError:
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if allowed is not None and int(name[3:]) not in allowed:
            continue
        columns = rest.split()
        busy += sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
    return busy / TICK
