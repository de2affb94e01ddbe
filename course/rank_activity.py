"""Is a rank moving? Its threads' CPU time tells a rank that computes from one that waits.

A world's deadline (:func:`course.world.world_timeout`) cannot tell "slow" from "stuck" by the
clock alone: on a busy 2-core machine a rank tracing a compiled model (TorchDynamo) can take
longer than the deadline while making progress all along, and a rank blocked forever in a
receive looks the same from outside. Its CPU time does not: a blocked thread sleeps in the
kernel (a condition variable, ``epoll_wait``) and its CPU time stays flat, a computing one's
grows by whatever share of a core the machine gives it.

Linux keeps each thread's CPU time in ``/proc/<pid>/task/<tid>/stat`` (fields 14 and 15, user
and system, in clock ticks; proc(5)). A rank is *moving* when one of its threads, or of its child
processes' (Inductor compiles in worker processes), gained at least :data:`MOVING_SHARE` of a
core between two samples. The threshold is per thread because an idle process group is not idle
to the CPU: gloo runs one event loop per group, each waking every 10 ms
(gloo/transport/tcp/loop.cc, ``epoll_wait(..., 10)``), about 0.7 ms of CPU per second each;
dozens of them can add up to a few percent of a core between them while no single one comes
near the threshold. A computing thread on a machine with a CPU hog per core still gets a tenth
of a core or more. Where ``/proc`` is missing (not Linux) nothing is known, and no rank counts
as moving: the deadline alone decides, as before this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from course.cpu_time import PROC, TICK, thread_ticks

MOVING_SHARE = 0.03  # of one core, per thread, between two samples: "this rank is computing"


def available() -> bool:
    """Whether this system shows threads' CPU time (Linux's /proc)."""
    return (PROC / "self" / "task").is_dir()


@dataclass
class _Seen:
    ticks: dict[tuple[int, int], int] = field(default_factory=dict)
    at: float | None = None
    last_moved: float | None = None
    peak_share: float = 0.0  # the busiest thread's share of a core in the last interval


@dataclass
class RankActivity:
    """Samples the CPU time of each rank's process tree and remembers when each last moved.

    ``pids`` maps rank -> process id. Call :meth:`sample` now and then (about once a second:
    a tick is 10 ms, so shorter intervals read noise); :meth:`moved` also takes news from
    elsewhere (a message from the rank, a ledger that changed).
    """

    pids: Mapping[int, int]
    seen: dict[int, _Seen] = field(default_factory=dict)

    def sample(self, ranks: Iterable[int], now: float) -> None:
        for rank in ranks:
            pid = self.pids[rank]
            ticks = thread_ticks(pid)
            before = self.seen.setdefault(rank, _Seen())
            if before.at is not None and now > before.at:
                old = before.ticks
                gained = max((t - old[key] for key, t in ticks.items() if key in old), default=0)
                before.peak_share = gained / TICK / (now - before.at)
                if before.peak_share >= MOVING_SHARE:
                    before.last_moved = now
            before.ticks, before.at = ticks, now

    def moved(self, rank: int, now: float) -> None:
        """Something other than CPU time showed that ``rank`` made progress at ``now``."""
        self.seen.setdefault(rank, _Seen()).last_moved = now

    def last_moved(self, rank: int) -> float | None:
        seen = self.seen.get(rank)
        return None if seen is None else seen.last_moved

    def cpu_seconds(self, rank: int) -> float:
        """CPU seconds ``rank``'s process tree used so far (its live threads, as last sampled)."""
        seen = self.seen.get(rank)
        return 0.0 if seen is None else sum(seen.ticks.values()) / TICK

    def share(self, rank: int) -> float:
        """The busiest thread's share of one core over the last interval sampled."""
        seen = self.seen.get(rank)
        return 0.0 if seen is None else seen.peak_share
