"""The language-model framework's configuration: one YAML file that picks every strategy.

A run of the language model of exercise 4.7 is described by one file
(``solutions/phase4_production/lm/configs/lm-*.yaml``; the default is ``lm-cpu-smoke``) plus
``key=value`` overrides, in the capstone's style (``course/config_files.py``): every section is a
pydantic model with unknown keys refused, and the whole is checked against the world size
(:func:`check_world`) before any process group exists, each problem named with its fix::

    model:          width, heads, layers, ffn, seq_len, tied, moe_layers, num_experts, top_k, ...
    parallel:       dp, tp, pp, cp, ep (one of dp/tp/pp/cp may be -1: what the others leave),
                    sequence_parallel
    zero:           0 (plain data parallel), 1, 2, 3, or fsdp (3.5's FSDP-style units)
    pipeline:       schedule (gpipe, 1f1b, interleaved, zb-h1, zb-v), microbatches, chunks
    communication:  the data-parallel gradients' all-reduce (with zero: 0): library (torch's),
                    ring (3.1's ring_all_reduce), tree (3.2's halving-doubling)
    sharding:       manual (the parallel section as written) or auto (the planner chooses)
    precision:      fp32, fp64, or bf16-mixed (float32 parameters and optimizer, the forward's
                    products in bfloat16 under torch.autocast)
    activation_checkpointing: true: each layer keeps only its input and recomputes its forward
                    in backward (2.3's checkpoint; not with zero-bubble schedules or MoE;
                    with sharding: auto the planner decides it)
    train:          batch, epochs, steps_per_epoch, lr, weight_decay, max_norm, seed, ...,
                    fused_adamw (AdamW's fused kernel), compile (each chunk, torch.compile)
    checkpoint:     dir, every (steps between saves; 0: none), keep; a run resumes from the
                    newest one in dir that verifies, at whatever layout it runs, with every: 0
                    too (lm/checkpoint.py)
    planner:        ranks_per_node, memory_per_rank_gib (what ``sharding: auto`` plans for)

Refused as well, by ``course/config_files.py``: a file that holds no settings (it would run on
every default unseen) and a key given twice (YAML keeps the last: ``train.lr is given twice
(lines 4 and 6)``); and by the framework before launch: a ``checkpoint.dir`` that cannot be
written when ``every`` > 0, and its command line's ``--world`` and ``--metrics FILE`` (one JSON
line per optimizer step, ``lm.metrics.step_record``) when they cannot be used.

``uv run python -m solutions.phase4_production.lm.config --config lm-8gpu`` prints a config as
the framework reads it (or its refusal).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from course import config_files
from course.config_files import ConfigError, Section
from course.language_model import LMConfig
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm.configs import CONFIG_DIR, DEFAULT_CONFIG


class ModelSection(Section):
    width: int = Field(default=64, ge=2, le=65536)
    heads: int = Field(default=4, ge=1, le=1024)
    layers: int = Field(default=4, ge=1, le=1024)
    ffn: int = Field(default=128, ge=1)
    seq_len: int = Field(default=128, ge=2)
    tied: bool = False
    moe_layers: list[int] = Field(default_factory=list)
    num_experts: int = Field(default=4, ge=1, le=4096)
    top_k: int = Field(default=2, ge=1, le=64)
    expert_ffn: int = Field(default=64, ge=1)
    aux_coefficient: float = Field(default=0.01, ge=0)

    def lm(self) -> LMConfig:
        return LMConfig(
            width=self.width, heads=self.heads, layers=self.layers, ffn=self.ffn,
            seq_len=self.seq_len, tied=self.tied, moe_layers=tuple(self.moe_layers),
            num_experts=self.num_experts, top_k=self.top_k, expert_ffn=self.expert_ffn,
            aux_coefficient=self.aux_coefficient,
        )  # fmt: skip


class ParallelSection(Section):
    dp: int = Field(default=-1, ge=-1)
    tp: int = Field(default=1, ge=-1)
    pp: int = Field(default=1, ge=-1)
    cp: int = Field(default=1, ge=-1)
    ep: int = Field(default=1, ge=1)
    sequence_parallel: bool = False

    @field_validator("dp", "tp", "pp", "cp")
    @classmethod
    def _no_zero(cls, value: int) -> int:
        """not 0 (-1: what the other degrees leave)"""
        if value == 0:
            raise ValueError("a degree is >= 1, or -1 for what the other degrees leave")
        return value


class PipelineSection(Section):
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"] = "1f1b"
    microbatches: int = Field(default=2, ge=1)
    chunks: int = Field(default=2, ge=1)  # virtual stages per rank, interleaved only


class TrainSection(Section):
    batch: int = Field(default=16, ge=1)  # sequences per step, all replicas
    epochs: int = Field(default=4, ge=1)
    steps_per_epoch: int = Field(default=100, ge=1)
    eval_batches: int = Field(default=4, ge=1)
    lr: float = Field(default=3e-3, gt=0, le=10)
    weight_decay: float = Field(default=0.0, ge=0)
    max_norm: float | None = Field(default=1.0, gt=0)
    seed: int = Field(default=0, ge=0)
    sample_bytes: int = Field(default=240, ge=0)
    fused_adamw: bool = False  # AdamW's fused kernel (fused=True)
    compile: bool = False  # each chunk compiled (torch.compile, Inductor)


class CheckpointSection(Section):
    dir: str = "checkpoints/lm"
    every: int = Field(default=0, ge=0)  # steps between saves; 0: none
    keep: int = Field(default=2, ge=1)


class PlannerSection(Section):
    ranks_per_node: int | None = Field(default=None, ge=1)
    memory_per_rank_gib: float = Field(default=16.0, gt=0)


class FrameworkConfig(Section):
    model: ModelSection = Field(default_factory=ModelSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    zero: Literal[0, 1, 2, 3, "fsdp"] = 0
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    communication: Literal["library", "ring", "tree"] = "library"
    sharding: Literal["manual", "auto"] = "manual"
    precision: Literal["fp32", "fp64", "bf16-mixed"] = "fp32"
    activation_checkpointing: bool = False
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    planner: PlannerSection = Field(default_factory=PlannerSection)

    @model_validator(mode="after")
    def _one_rest(self) -> FrameworkConfig:
        rest = [a for a in ("dp", "tp", "pp", "cp") if getattr(self.parallel, a) == -1]
        if len(rest) > 1:
            raise ValueError(
                f"parallel: {' and '.join(f'{a}=-1' for a in rest)}: only one degree can be "
                "'what the others leave'; give the others as numbers"
            )
        return self

    def settings(self, world_size: int) -> ParallelSettings:
        """The layout on ``world_size`` ranks (the one -1 degree resolved; 0 when nothing
        fits, which :func:`check_world` refuses)."""
        degrees = {a: getattr(self.parallel, a) for a in ("dp", "tp", "pp", "cp")}
        fixed = math.prod(v for v in degrees.values() if v != -1)
        for axis, value in degrees.items():
            if value == -1:
                degrees[axis] = world_size // fixed if world_size % fixed == 0 else 0
        return ParallelSettings(
            dp=degrees["dp"], cp=degrees["cp"], tp=degrees["tp"], pp=degrees["pp"],
            ep=self.parallel.ep, sequence_parallel=self.parallel.sequence_parallel,
            schedule=self.pipeline.schedule, microbatches=self.pipeline.microbatches,
            chunks=self.pipeline.chunks, zero=self.zero, max_norm=self.train.max_norm,
            lr=self.train.lr, weight_decay=self.train.weight_decay,
            communication=self.communication,
            activation_checkpointing=self.activation_checkpointing,
            fused_adamw=self.train.fused_adamw, compile=self.train.compile,
            bf16_autocast=self.precision == "bf16-mixed",
        )  # fmt: skip


def config_path(name_or_path: str) -> Path:
    return config_files.config_path(name_or_path, CONFIG_DIR)


def available_configs() -> list[str]:
    return config_files.available_configs(CONFIG_DIR, "lm-*.yaml")


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> FrameworkConfig:
    """The YAML config (default ``lm-cpu-smoke``) with ``key=value`` overrides, validated."""
    path = config_path(name_or_path or DEFAULT_CONFIG)
    data = config_files.read_yaml(path, available_configs())
    for assignment in overrides:
        config_files.apply_override(data, assignment, "parallel.tp=2 or zero=fsdp")
    source = f"--config {path.name}" + (" with overrides" if overrides else "")
    try:
        return FrameworkConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}:\n  {config_files.describe(err, FrameworkConfig)}") from None


def check_world(config: FrameworkConfig, world_size: int) -> ParallelSettings:
    """The layout the config asks for on ``world_size`` ranks, or ConfigError naming every
    problem (with ``sharding: auto`` the planner chooses the layout later; the model and the
    batch are still checked here)."""
    model = config.model.lm()
    problems = [f"model: {p}" for p in model.problems()]
    if config.sharding == "auto":
        if config.activation_checkpointing:  # it would be dropped without a word
            problems.append(
                "activation_checkpointing: true with sharding: auto: the planner turns recompute "
                "on for the layouts that need it to fit; set activation_checkpointing: false, or "
                "sharding: manual to recompute a layout of your own"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        return config.settings(world_size)
    settings = config.settings(world_size)
    degrees = (settings.dp, settings.tp, settings.pp, settings.cp)
    if 0 in degrees:
        fixed = {a: v for a, v in vars(config.parallel).items() if a in ("dp", "tp", "pp", "cp")}
        problems.append(
            f"parallel {fixed}: the fixed degrees do not divide the world of {world_size} ranks; "
            "choose degrees whose product divides it"
        )
    else:
        problems += settings.problems(model, config.train.batch)
        if not problems and settings.world_size != world_size:
            problems.append(
                f"parallel: {settings.label()} = {settings.world_size} ranks, but the world has "
                f"{world_size}: set one degree to -1, or run {settings.world_size} ranks"
            )
    if problems:
        raise ConfigError("; ".join(problems))
    return settings


def dump(config: FrameworkConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Print a language-model config as read.")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--world", type=int, default=None, help="also check it on N ranks")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        if args.world is not None and args.world < 1:
            raise ConfigError(f"--world {args.world}: a world has at least 1 rank (e.g. --world 4)")
        if args.world is not None:
            check_world(config, args.world)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(dump(config), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
