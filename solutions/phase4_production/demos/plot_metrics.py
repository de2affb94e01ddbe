"""Plot the per-rank step breakdown from the monitor's JSONL file (exercise 4.5) to a PNG.

Left: each rank's mean step split into its sections (data, forward, backward, sync, optimizer,
other), stacked, the stragglers' bars labelled. Right: each rank's step and busy time (the step
without waiting on the others) at every report; a straggler's busy time stands out while every
rank's step time is the same (the others wait for it inside the all-reduce).

    uv run python -m solutions.phase4_production.demos.plot_metrics \\
        --jsonl runs/monitoring/metrics.jsonl
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course.cli import parse_config, run_main
from course.training import SECTIONS

COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "sync": "#dd8452",
    "optimizer": "#8172b3",
    "other": "#ccb974",
}


@dataclass
class PlotConfig:
    jsonl: str = field(
        default="runs/monitoring/metrics.jsonl", metadata={"help": "the monitor's metrics file"}
    )
    out: str = field(default="", metadata={"help": "the PNG to write (default: beside the JSONL)"})


def load_records(path: Path | str) -> list[dict[str, Any]]:
    """The JSONL's objects, in file order; a clear error for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--jsonl {path}: no such file (run the monitoring demo first)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from err
        missing = [k for k in ("step", "rank", "breakdown_ms", "step_ms") if k not in record]
        if missing:
            raise ValueError(f"{path}:{number}: the record lacks {missing}")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def mean_breakdown(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per rank, the mean over its reports of each section's ms."""
    sums: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SECTIONS, 0.0))
    counts: dict[int, int] = defaultdict(int)
    for record in records:
        rank = int(record["rank"])
        counts[rank] += 1
        for section in SECTIONS:
            sums[rank][section] += float(record["breakdown_ms"].get(section, 0.0))
    return {r: {s: v / counts[r] for s, v in sums[r].items()} for r in sorted(sums)}


def plot(records: Sequence[dict[str, Any]], out: Path | str) -> Path:
    """Draw the two panels from ``records`` and save them to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    breakdown = mean_breakdown(records)
    stragglers = {int(r["rank"]) for r in records if r.get("straggler")}
    ranks = sorted(breakdown)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 2.5 + 0.7 * len(ranks)))
    positions = list(range(len(ranks)))
    lefts = [0.0] * len(ranks)
    for section in SECTIONS:
        widths = [breakdown[r][section] for r in ranks]
        left.barh(positions, widths, left=lefts, color=COLORS[section], label=section)
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    left.set_yticks(positions)
    left.set_yticklabels([f"rank {r}" + (" (straggler)" if r in stragglers else "") for r in ranks])
    for tick, r in zip(left.get_yticklabels(), ranks, strict=True):
        if r in stragglers:
            tick.set_color("#c44e52")
    left.invert_yaxis()
    left.set_xlabel("mean ms per step")
    left.set_title("step breakdown per rank")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(SECTIONS), fontsize=8)
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_rank[int(record["rank"])].append(record)
    for rank in ranks:
        steps = [r["step"] for r in by_rank[rank]]
        line = right.plot(steps, [r["step_ms"] for r in by_rank[rank]], label=f"rank {rank} step")
        if all("busy_ms" in r for r in by_rank[rank]):
            right.plot(
                steps,
                [r["busy_ms"] for r in by_rank[rank]],
                linestyle="--",
                color=line[0].get_color(),
                label=f"rank {rank} busy",
            )
    right.set_xlabel("optimizer step")
    right.set_ylabel("ms")
    right.set_title("step (solid) and busy (dashed) time")
    right.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PlotConfig, argv, __doc__)
    try:
        records = load_records(config.jsonl)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    out = Path(config.out) if config.out else Path(config.jsonl).with_name("breakdown.png")
    print(f"wrote {plot(records, out)}")
    return 0


if __name__ == "__main__":
    run_main(main)
