"""The monitor that plugs exercise 4.5 into the training loop (given, not an exercise).

:class:`TrainingMonitor` is a :class:`~course.training.Callback`: put it in
``TrainingLoop(callbacks=[...])`` and it times every step from the loop's timing points with your
:class:`StepTimer`, and every ``every_n_steps`` optimizer steps (a collective on ``group``):

* names the stragglers (your :func:`find_stragglers`) in the log, on the group's first rank;
* all-gathers each rank's breakdown over the window (mean ms per section, step, samples/s, MFU
  from your :func:`model_flops_utilization`, peak memory) and writes it, on the group's first
  rank, to ``<output_dir>/metrics.jsonl`` (one JSON object per rank and report, appended: a
  resumed run continues the file) and to TensorBoard
  scalars (``<output_dir>/tensorboard``, one tag per rank: ``step_ms/rank1``);
* profiles ``profile_steps`` (global step numbers) with ``torch.profiler`` on every rank and
  writes ``<output_dir>/trace_rank<r>.json`` (Chrome trace: chrome://tracing or
  https://ui.perfetto.dev);
* shows a progress bar on global rank 0 when ``progress_total`` is given and stderr is a
  terminal (tqdm).

:meth:`TrainingMonitor.summary` (collective) returns the whole run's breakdown per rank, and
:func:`breakdown_table` prints it. Call :meth:`TrainingMonitor.close` at the end (or use the
monitor as a context manager): it stops the profiler and closes the files.

Which implementation of exercise 4.5 runs is chosen by ``impl`` ("solutions" or "templates").
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch
import torch.distributed as dist

from course.impl import load_impl
from course.training import SECTIONS, Callback, StepEvent, TrainingLoop
from phase4_production.device_peaks import peak_flops_per_second, peak_memory_bytes

PHASE = "phase4_production"
# per rank, per report: the mean ms of each section, then these
_FIELDS = (*SECTIONS, "step_ms", "busy_ms", "samples_per_second", "mfu", "peak_memory_bytes")
Log = Callable[[str], None]


class TrainingMonitor(Callback):
    """Per-rank step breakdown, throughput, MFU, memory, stragglers, profiler traces.

    Args:
        output_dir: where ``metrics.jsonl``, ``tensorboard/`` and traces go (None: log only).
        group: the ranks compared with each other (None: the default group); its first rank
            writes the files and the log lines.
        every_n_steps: report (and look for stragglers) every N optimizer steps.
        straggler_threshold: a rank whose median step is above this x the median rank's.
        wait_sections: sections in which a rank waits for the others, left out of the time
            compared between ranks (``sync``: the explicit gradient all-reduce; under torch's
            DDP the wait is inside ``backward``, see the guidelines).
        tensorboard, jsonl: write TensorBoard scalars / the JSONL file (with ``output_dir``).
        flops_per_step: this rank's training FLOPs per step (``count_training_flops``); None:
            no MFU.
        peak_flops: the device's peak FLOP/s; None: the datasheet table or a measurement
            (``peak_flops_per_second``).
        device: where the step computes (CUDA: the timer synchronizes); None: the loop's.
        dtype: the compute precision, to pick the datasheet's peak (bf16 under autocast).
        profile_steps: global steps to profile with ``torch.profiler`` (e.g. ``range(5, 8)``).
        progress_total: steps expected, for the progress bar (None: no bar).
        log: where log lines go on the writing rank (default: print, or ``tqdm.write``).
        impl: "solutions" or "templates": whose exercise 4.5 does the measuring.
    """

    def __init__(
        self,
        output_dir: Path | str | None,
        *,
        group: dist.ProcessGroup | None = None,
        every_n_steps: int = 10,
        straggler_threshold: float = 1.5,
        wait_sections: Sequence[str] = ("sync",),
        tensorboard: bool = True,
        jsonl: bool = True,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        profile_steps: range | None = None,
        progress_total: int | None = None,
        log: Log | None = None,
        impl: str = "solutions",
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: must be at least 1")
        if straggler_threshold <= 1.0:
            raise ValueError(f"straggler_threshold={straggler_threshold}: must be > 1")
        if profile_steps is not None and (len(profile_steps) == 0 or profile_steps.start < 1):
            raise ValueError(
                f"profile_steps={profile_steps}: give a non-empty range of global steps >= 1"
            )
        self.ex = load_impl(PHASE, "monitoring", impl)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.group = group
        self.every = every_n_steps
        self.threshold = straggler_threshold
        self.wait_sections = tuple(wait_sections)
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.peak_source = "given" if peak_flops is not None else ""
        self.dtype = dtype
        self.profile_steps = profile_steps
        self.rank = dist.get_rank()
        self.writes = dist.get_rank(group) == 0
        self.world = dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else None
        self.timer: Any = None
        self.window: list[Any] = []  # StepTimes of the steps since the last report
        self.window_samples = 0
        self.run: list[Any] = []  # every StepTimes of the run, for the summary
        self.run_samples: list[int] = []  # samples of each step of the run
        self.stragglers: list[tuple[int, Any]] = []  # (step, Straggler) of every report
        self.reports: list[dict[str, Any]] = []  # the JSONL rows (on the writing rank)
        self.profiler: torch.profiler.profile | None = None
        self.traces: list[Path] = []
        self._jsonl: TextIO | None = None
        self._tensorboard: Any = None
        self._bar: Any = None
        self._external_log = log
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if self.writes and jsonl:
                self._jsonl = open(self.output_dir / self.jsonl_name(), "a")  # noqa: SIM115
            if self.writes and tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))
        if progress_total is not None and self.rank == 0:
            from tqdm import tqdm

            self._bar = tqdm(
                total=progress_total, unit="step", disable=not sys.stderr.isatty(), leave=False
            )

    # ----------------------------------------------------------------- plumbing

    def jsonl_name(self) -> str:
        """``metrics.jsonl`` for the whole world; one file per group otherwise."""
        if self.group is None or self.world == dist.get_world_size():
            return "metrics.jsonl"
        return f"metrics_group{dist.get_global_rank(self.group, 0)}.jsonl"

    def log(self, line: str) -> None:
        if self._external_log is not None:
            self._external_log(line)
        elif self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def _ensure_device(self, loop: TrainingLoop) -> torch.device:
        if self.device is None:
            self.device = torch.device(loop.device)
        if self.timer is None:
            self.timer = self.ex.StepTimer(self.device)
            if self.flops_per_step is not None and self.peak_flops is None:
                self.peak_flops, self.peak_source = peak_flops_per_second(self.device, self.dtype)
        return self.device

    # ----------------------------------------------------------------- the loop's hooks

    def on_step_begin(self, loop: TrainingLoop) -> None:
        self._ensure_device(loop)
        steps = self.profile_steps
        if steps is not None and self.profiler is None and loop.global_step + 1 == steps.start:
            self._start_profiler()
        self.timer.start()

    def on_section_end(self, loop: TrainingLoop, section: str) -> None:
        self.timer.mark(section)

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        self._ensure_device(loop)
        times = self.timer.finish()
        self.window.append(times)
        self.run.append(times)
        self.window_samples += event.output.samples
        self.run_samples.append(event.output.samples)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{event.output.loss:.4f}", ms=f"{1e3 * times.total:.1f}")
        steps = self.profile_steps
        if self.profiler is not None and steps is not None and event.global_step >= steps[-1]:
            self._stop_profiler(steps)
        if event.global_step % self.every == 0:
            self.report(event.global_step, loss=event.output.loss)

    # ----------------------------------------------------------------- measurements

    def busy_seconds(self, times: Any) -> float:
        """The step without the sections spent waiting on the others: compared between ranks."""
        waiting = sum(times.sections.get(s, 0.0) for s in self.wait_sections)
        return float(times.total - waiting)

    def _row(self, steps: list[Any], samples: int) -> list[float]:
        """This rank's mean breakdown over ``steps``, in the order of ``_FIELDS``."""
        n = max(len(steps), 1)
        sections = dict.fromkeys(SECTIONS, 0.0)
        for times in steps:
            for name, seconds in times.sections.items():
                sections[name if name in sections else "other"] += seconds
        total = sum(t.total for t in steps)
        busy = sorted(self.busy_seconds(t) for t in steps)
        mean_step = total / n
        mfu = math.nan
        if self.flops_per_step is not None and self.peak_flops and mean_step > 0:
            mfu = self.ex.model_flops_utilization(self.flops_per_step, mean_step, self.peak_flops)
        return [
            *(1e3 * sections[s] / n for s in SECTIONS),
            1e3 * mean_step,
            1e3 * busy[(len(busy) - 1) // 2] if busy else 0.0,
            samples / total if total > 0 else 0.0,
            mfu,
            float(peak_memory_bytes(self.device or "cpu")),
        ]

    def _gather_rows(self, row: list[float]) -> list[dict[str, Any]]:
        """Every rank's row (collective on the group), as dicts keyed by _FIELDS plus 'rank'."""
        device = self.ex.collective_device(self.group)
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = []
        for r, values in enumerate(gathered):
            entry: dict[str, Any] = dict(zip(_FIELDS, values.cpu().tolist(), strict=True))
            entry["rank"] = dist.get_global_rank(self.group, r) if self.group is not None else r
            entry["mfu"] = None if math.isnan(entry["mfu"]) else entry["mfu"]
            entry["peak_memory_bytes"] = int(entry["peak_memory_bytes"])
            rows.append(entry)
        return rows

    def report(self, step: int, loss: float | None = None) -> list[Any]:
        """Collective on the group: stragglers, the gathered breakdown, the files. Returns the
        stragglers found (the same on every rank). The loop calls it every N steps."""
        busy = [self.busy_seconds(t) for t in self.window]
        found = list(self.ex.find_stragglers(busy, threshold=self.threshold, group=self.group))
        rows = self._gather_rows(self._row(self.window, self.window_samples))
        self.stragglers += [(step, s) for s in found]
        slow = sorted(s.rank for s in found)
        if self.writes:
            for straggler in found:
                self.log(f"[step {step}] {straggler}")
            for row in rows:
                record = {
                    "step": step,
                    "rank": row["rank"],
                    "window_steps": len(self.window),
                    "step_ms": row["step_ms"],
                    "busy_ms": row["busy_ms"],
                    "breakdown_ms": {s: row[s] for s in SECTIONS},
                    "samples_per_second": row["samples_per_second"],
                    "mfu": row["mfu"],
                    "peak_memory_bytes": row["peak_memory_bytes"],
                    "straggler": row["rank"] in slow,
                    "stragglers": slow,
                    "time": time.time(),
                }
                self.reports.append(record)
                if self._jsonl is not None:
                    self._jsonl.write(json.dumps(record) + "\n")
            if self._jsonl is not None:
                self._jsonl.flush()
            self._write_tensorboard(step, rows, len(found), loss)
        self.window, self.window_samples = [], 0
        return found

    def _write_tensorboard(
        self, step: int, rows: list[dict[str, Any]], stragglers: int, loss: float | None
    ) -> None:
        writer = self._tensorboard
        if writer is None:
            return
        for row in rows:
            r = row["rank"]
            for section in SECTIONS:
                writer.add_scalar(f"breakdown_ms/{section}/rank{r}", row[section], step)
            writer.add_scalar(f"step_ms/rank{r}", row["step_ms"], step)
            writer.add_scalar(f"busy_ms/rank{r}", row["busy_ms"], step)
            writer.add_scalar(f"samples_per_second/rank{r}", row["samples_per_second"], step)
            writer.add_scalar(f"peak_memory_mib/rank{r}", row["peak_memory_bytes"] / 2**20, step)
            if row["mfu"] is not None:
                writer.add_scalar(f"mfu/rank{r}", row["mfu"], step)
        writer.add_scalar(
            "samples_per_second/all", sum(r["samples_per_second"] for r in rows), step
        )
        writer.add_scalar("stragglers", stragglers, step)
        if loss is not None:
            writer.add_scalar("loss/rank0", loss, step)
        writer.flush()

    def summary(self, skip_first: int = 0) -> list[dict[str, Any]]:
        """The run's mean breakdown per rank, leaving out the first ``skip_first`` steps (the
        warm-up: first collectives connect, allocators grow), collective on the group, the same
        on every rank: keys ``rank``, each section (ms), ``step_ms``, ``busy_ms``,
        ``samples_per_second``, ``mfu``, ``peak_memory_bytes``, ``straggler`` (named in any
        report)."""
        first = skip_first if len(self.run) > skip_first else 0
        rows = self._gather_rows(self._row(self.run[first:], sum(self.run_samples[first:])))
        named = {s.rank for _, s in self.stragglers}
        for row in rows:
            row["straggler"] = row["rank"] in named
        return rows

    # ----------------------------------------------------------------- profiler

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()

    def _stop_profiler(self, steps: range) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        if self.output_dir is not None:
            path = self.output_dir / f"trace_rank{self.rank}.json"
            profiler.export_chrome_trace(str(path))
            self.traces.append(path)
            if self.writes:
                self.log(f"profiled steps {steps.start}-{steps[-1]}: {path} (and one per rank)")

    # ----------------------------------------------------------------- the end

    def close(self) -> None:
        """Stop the profiler, close the progress bar and the files (idempotent)."""
        if self.profiler is not None and self.profile_steps is not None:
            self._stop_profiler(self.profile_steps)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ----------------------------------------------------------------------------- formatting


def breakdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :meth:`TrainingMonitor.summary`'s rows: one line per rank."""
    header = (
        "| rank | data ms | forward ms | backward ms | sync ms | optimizer ms | other ms "
        "| step ms | busy ms | samples/s | MFU | peak memory MiB | straggler |"
    )
    lines = [header, "|" + "---:|" * 12 + "---|"]
    for row in rows:
        mfu = "-" if row.get("mfu") is None else f"{100 * row['mfu']:.2f}%"
        cells = [
            str(row["rank"]),
            *(f"{row[s]:.2f}" for s in SECTIONS),
            f"{row['step_ms']:.2f}",
            f"{row['busy_ms']:.2f}",
            f"{row['samples_per_second']:.0f}",
            mfu,
            f"{row['peak_memory_bytes'] / 2**20:.0f}",
            "yes" if row.get("straggler") else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
