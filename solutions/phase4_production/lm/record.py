"""Record exercise 4.7's real-text run: one model, one seed, two layouts, the same curve.

Trains the byte-level language model of ``lm/trainer.py`` on the Python documentation twice from
the same seed and the same batches, once per layout (each a world of its own on this machine),
and writes ``phase4_production/results/lm_text.json``: held-out bits per byte and the training
loss per epoch for both layouts side by side, their largest relative difference, tokens/s, and a
few lines sampled from the first layout's model. Every layout computes the same function in
float32 with its sums in other orders, so the two curves agree to float32's precision, not
bitwise (float64 tests check equality to 1e-10)::

    uv run python -m solutions.phase4_production.lm.record                  # print
    uv run python -m solutions.phase4_production.lm.record --record         # and record
    uv run python -m solutions.phase4_production.lm.record --epochs 1 --steps-per-epoch 5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from course.cli import benchmark_main, run_main
from course.results import Table, write_results
from course.topology import Topology
from course.world import run_world
from solutions.phase4_production.lm.trainer import History, TrainConfig, train, validate

RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results" / "lm_text.json"
LAYOUTS: dict[str, dict[str, Any]] = {
    "a": {"dp": 2, "tp": 2, "sequence_parallel": True},
    "b": {"dp": 1, "cp": 2, "pp": 2, "schedule": "1f1b"},
}


@dataclass
class RecordConfig(TrainConfig):
    """The trainer's flags, plus the two layouts' world size and whether to record."""

    world: int = field(default=4, metadata={"ge": 1, "le": 64, "fix": "e.g. 4"})
    record: bool = field(default=False, metadata={"help": f"write {RESULTS.name}"})


def layout_config(config: RecordConfig, which: str) -> TrainConfig:
    base = {f.name: getattr(config, f.name) for f in fields(TrainConfig)}
    layout: dict[str, Any] = LAYOUTS[which]
    return replace(TrainConfig(**base), **layout)


def _train_rank(config: TrainConfig) -> History:
    import torch.distributed as dist

    settings = config.settings(dist.get_world_size())
    topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                              ep=settings.ep)  # fmt: skip
    return train(config, topology)


def check(config: RecordConfig) -> None:
    for which in LAYOUTS:
        validate(layout_config(config, which), config.world)


def measure(config: RecordConfig) -> dict[str, History]:
    return {
        which: run_world(
            _train_rank, config.world, (layout_config(config, which),), {}, timeout=24 * 3600
        )[0]
        for which in LAYOUTS
    }


def largest_difference(a: History, b: History) -> float:
    pairs = [
        (x["bits_per_byte"], y["bits_per_byte"]) for x, y in zip(a.epochs, b.epochs, strict=True)
    ]
    pairs += list(zip(a.step_losses, b.step_losses, strict=True))
    return max(abs(x - y) / abs(y) for x, y in pairs)


def report(histories: dict[str, History], config: RecordConfig) -> str:
    a, b = histories["a"], histories["b"]
    labels = {w: layout_config(config, w).settings(config.world).label() for w in LAYOUTS}
    # no tokens/s here: two worlds on one small machine measure each other; see lm_benchmark
    table = Table(
        ["epoch", "steps", f"held-out bits/byte, {labels['a']}",
         f"held-out bits/byte, {labels['b']}", f"train loss, {labels['a']}",
         f"train loss, {labels['b']}"]
    )  # fmt: skip
    for x, y in zip(a.epochs, b.epochs, strict=True):
        table.add(
            int(x["epoch"]), int(x["epoch"]) * config.steps_per_epoch,
            f"{x['bits_per_byte']:.4f}", f"{y['bits_per_byte']:.4f}",
            f"{x['train_loss']:.4f}", f"{y['train_loss']:.4f}",
        )  # fmt: skip
    difference = largest_difference(a, b)
    bpb_gap = max(
        abs(x["bits_per_byte"] - y["bits_per_byte"])
        for x, y in zip(a.epochs, b.epochs, strict=True)
    )
    values: dict[str, Any] = {
        "largest_bits_per_byte_gap": f"{bpb_gap:.4f}",
        "final_bits_per_byte": f"{a.epochs[-1]['bits_per_byte']:.2f}",
        "first_bits_per_byte": f"{a.epochs[0]['bits_per_byte']:.2f}",
        "largest_relative_difference": f"{difference:.1e}",
        "steps": str(len(a.step_losses)),
        "parameters": f"{a.parameters:,}",
        "sample": a.sample,
        "layout_a": labels["a"],
        "layout_b": labels["b"],
    }
    if config.record:
        write_results(RESULTS, tables={"curves": table}, values=values)
    return (
        f"{table.to_markdown()}\n\nlargest relative difference between the two layouts (every "
        f"step's loss and every epoch's bits/byte): {difference:.1e}\n\nsample ({labels['a']}):\n"
        f"{a.sample}" + (f"\n\nrecorded in {RESULTS}" if config.record else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(RecordConfig, argv, __doc__, validate=check, measure=measure,
                          report=report)  # fmt: skip


if __name__ == "__main__":
    run_main(main)
