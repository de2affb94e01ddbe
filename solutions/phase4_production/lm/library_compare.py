"""The library way beside exercise 4.7, compared: PyTorch's composition and the course's.

``lm/library.py`` trains the language model with PyTorch's own APIs; this program trains it and
the course composition (exercise 4.7, the reference or ``--impl templates``) from the same
one-process weights on the same batches (``course.language_model.uneven_batch``: uneven masks),
in float64, layout after layout in one world per size, and prints both losses per step, and, for
the layouts the library cannot run here, torch's reason (measured for context parallelism)::

    uv run python -m solutions.phase4_production.lm.library_compare             # print
    uv run python -m solutions.phase4_production.lm.library_compare --record    # and write
                                                  # phase4_production/results/lm_library.json
    uv run python -m solutions.phase4_production.lm.library_compare --impl templates   # yours
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from course.cli import benchmark_main, run_main
from course.impl import IMPLS, load_impl, unwritten_todo
from course.language_model import LMConfig, build_language_model, uneven_batch
from course.results import Table, write_results
from course.topology import Topology
from course.world import run_world
from phase4_production.lm_functions import COMPOSITION_MODULES
from phase4_production.lm_layout import ParallelSettings
from solutions.phase2_advanced.library.context_parallel import cp_mesh, cpu_refusal
from solutions.phase4_production.lm.library import LibraryLanguageModel, unsupported
from solutions.phase4_production.lm.library_cases import Case


def composition_class(impl: str = "solutions") -> Any:
    """Exercise 4.7's ``ParallelLanguageModel``, the learner's (``templates``) or the reference."""
    return load_impl("phase4_production", "lm_parallel", impl).ParallelLanguageModel


def compare_losses(
    config: LMConfig,
    settings: ParallelSettings,
    steps: int,
    seed: int,
    *,
    global_batch: int = 8,
    composition: Any = None,
) -> list[tuple[float, float]]:
    """Inside a world of ``settings.world_size`` ranks: the course composition and the library
    trained side by side from the same dense model on the same batches; per step (course's
    loss, library's loss), the same on every rank. ``composition`` defaults to the reference
    ``ParallelLanguageModel``."""
    topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                              ep=settings.ep)  # fmt: skip
    course = (composition or composition_class())(
        build_language_model(config, seed), topology, settings
    )
    library = LibraryLanguageModel(build_language_model(config, seed), topology, settings)
    out = []
    for step in range(steps):
        tokens, targets = uneven_batch(step, config, global_batch, seed)
        out.append((course.train_step(tokens, targets).loss, library.train_step(tokens, targets)))
    return out


@dataclass
class CaseResult:
    """What a world measured for one case: the losses per step, or why the library refused
    (for context parallelism, the error torch raised on this machine)."""

    label: str
    model: str
    losses: list[tuple[float, float]] = field(default_factory=list)
    refused: str | None = None


def compare_cases(
    cases: Sequence[Case], base: LMConfig, steps: int, seed: int, global_batch: int, impl: str
) -> list[CaseResult]:
    """Every case in turn in this world (a collective: every rank runs them all)."""
    # torch's advice, not problems here: a 2-D norm is all-reduced dim by dim (the clipping
    # norm), and no output of a fully_shard module is changed in place (the views it warns of)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    composition = composition_class(impl)
    out = []
    for case in cases:
        config, settings = case.config(base), case.settings
        result = CaseResult(case.label, case.model, refused=unsupported(settings, config))
        if settings.cp > 1:
            result.refused = measured_cp_refusal(settings) or result.refused
        elif result.refused is None:
            result.losses = compare_losses(
                config, settings, steps, seed, global_batch=global_batch, composition=composition
            )
        dist.barrier()
        out.append(result)
    return out


def measured_cp_refusal(settings: ParallelSettings) -> str | None:
    """The library's ring attention tried on this world's cp mesh: torch's error, or None."""
    topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                              ep=settings.ep)  # fmt: skip
    error = cpu_refusal(cp_mesh(topology.cp_group, "cpu"))
    if error is None:
        return None
    return f"cp > 1: torch.distributed.tensor.experimental.context_parallel raised {error}"


# ----------------------------------------------------------------------------- the program


RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results" / "lm_library.json"
CLIP = 0.05
WORLDS: dict[int, list[Case]] = {
    4: [
        Case(ParallelSettings(dp=2, tp=2, sequence_parallel=True, zero=3, max_norm=CLIP), True),
        Case(ParallelSettings(tp=2, pp=2, microbatches=2, max_norm=CLIP)),
        Case(ParallelSettings(dp=2, pp=2, schedule="gpipe", microbatches=2), moe=True),
        Case(ParallelSettings(tp=2, pp=2, schedule="interleaved", microbatches=2)),
        Case(
            ParallelSettings(tp=2, pp=2, sequence_parallel=True, schedule="zb-v", microbatches=2),
            tied=True,
        ),
        Case(ParallelSettings(pp=4, schedule="zb-h1", microbatches=4, max_norm=CLIP)),
        Case(ParallelSettings(cp=2, tp=2)),
        Case(ParallelSettings(dp=4, ep=4), moe=True),
        Case(ParallelSettings(dp=2, tp=2), moe=True),
        Case(ParallelSettings(tp=2, pp=2, microbatches=2), tied=True),
        Case(ParallelSettings(dp=2, pp=2, schedule="zb-v", microbatches=2), tied=True),
    ],
    8: [
        Case(
            ParallelSettings(
                dp=2, tp=2, pp=2, sequence_parallel=True, microbatches=2, max_norm=CLIP
            )
        ),
    ],
}


@dataclass
class LibraryConfig:
    """The model's sizes, the comparison's length, and whose composition runs beside torch."""

    width: int = field(default=64, metadata={"ge": 8})
    heads: int = field(default=4, metadata={"ge": 1})
    layers: int = field(default=4, metadata={"ge": 4, "fix": "4 or more: pp4 needs a layer each"})
    ffn: int = field(default=128, metadata={"ge": 2})
    seq_len: int = field(default=64, metadata={"ge": 4})
    global_batch: int = field(default=8, metadata={"ge": 8, "fix": "a multiple of 8"})
    steps: int = field(default=3, metadata={"ge": 1})
    seed: int = 0
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    record: bool = field(default=False, metadata={"help": f"write {RESULTS.name}"})

    def model(self) -> LMConfig:
        return LMConfig(width=self.width, heads=self.heads, layers=self.layers, ffn=self.ffn,
                        seq_len=self.seq_len, expert_ffn=self.ffn // 2)  # fmt: skip


def validate(config: LibraryConfig) -> None:
    """The model, then every case against it, checked before any process starts."""
    problems = [f"model: {p}" for p in config.model().problems()]
    for size, cases in WORLDS.items():
        for case in cases if not problems else []:
            found = case.settings.problems(case.config(config.model()), config.global_batch)
            problems += [f"{case.label} ({size} ranks): {p}" for p in found]
    if problems:
        raise ValueError("; ".join(problems))
    for phase, module in COMPOSITION_MODULES:
        todo = unwritten_todo(phase, module, config.impl)
        if todo is not None:
            raise ValueError(f"--impl {config.impl}: the course side needs {todo}")


def measure(config: LibraryConfig) -> list[CaseResult]:
    args = (config.model(), config.steps, config.seed, config.global_batch, config.impl)
    out: list[CaseResult] = []
    for size, cases in WORLDS.items():
        # gloo on CPU even where GPUs are: the course composition and this module run on CPU
        out += run_world(compare_cases, size, (cases, *args), {}, timeout=600, backend="gloo")[0]
    return out


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-300)


def report(results: list[CaseResult], config: LibraryConfig) -> str:
    losses = Table(["layout", "model", "step", "course composition", "torch library",
                    "relative difference"])  # fmt: skip
    refused = Table(["layout", "model", "why the library cannot run it here"])
    worst = 0.0
    for result in results:
        if result.refused is not None:
            refused.add(result.label, result.model, result.refused)
        for step, (course, library) in enumerate(result.losses):
            worst = max(worst, relative(course, library))
            losses.add(result.label, result.model, step, f"{course:.12f}", f"{library:.12f}",
                       f"{relative(course, library):.1e}")  # fmt: skip
    losses.note = (
        f"float64, width {config.width}, {config.layers} layers, seq_len {config.seq_len}, "
        f"global batch {config.global_batch} with uneven masks; the loss of each step before "
        "its update"
    )
    compared = len({r.label for r in results if r.losses})
    values = {"largest_relative_difference": f"{worst:.1e}", "compared": str(compared),
              "refused": str(len(refused.rows))}  # fmt: skip
    if config.record:
        write_results(RESULTS, tables={"losses": losses, "refused": refused}, values=values)
    return (
        f"{losses.to_markdown()}\n\n{refused.to_markdown()}\n\nlargest relative difference "
        f"over {compared} layouts: {worst:.1e}"
        + (f"\n\nrecorded in {RESULTS}" if config.record else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(LibraryConfig, argv, __doc__, validate=validate, measure=measure,
                          report=report)  # fmt: skip


if __name__ == "__main__":
    run_main(main)
