"""The framework's run, behind its command line (``lm/framework.py``, which loads this module
only once its arguments are read, so that ``--help`` answers before torch loads): validate the
config against the world, plan when asked, then train with ``lm.trainer.run``.

The command line, the config and the planner are described in ``lm/framework.py`` and on the
framework's page (``solutions/phase4_production/lm/README.md``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from course.cli import Refusal, refuse_before_start, refused
from course.config_files import ConfigError
from course.distributed import distributed_session, env_int
from course.language_model import LMConfig
from course.rank_logging import log0
from course.topology import Topology
from phase4_production.checkpoint_files import folder_problem
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm.checkpoint import CheckpointPlan
from solutions.phase4_production.lm.config import (
    FrameworkConfig,
    check_world,
    load_config,
)
from solutions.phase4_production.lm.framework import PLAN_WORLD
from solutions.phase4_production.lm.metrics import metrics_problem
from solutions.phase4_production.lm.planner import GIB, Machine, Prediction, plan
from solutions.phase4_production.lm.rates import (
    Rates,
    fit_links,
    link_times,
    measure_compute,
    measure_rates,
    rates_from,
    rates_timeout,
)
from solutions.phase4_production.lm.trainer import RunOptions, run, say

# the parameters' dtype of each precision (bf16-mixed: float32 parameters, bf16 autocast)
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16-mixed": torch.float32}


def machine_of(config: FrameworkConfig, world: int) -> Machine:
    per_node = config.planner.ranks_per_node or min(world, env_int("LOCAL_WORLD_SIZE", world))
    element = torch.finfo(DTYPES[config.precision]).bits // 8
    return Machine(world, per_node, config.planner.memory_per_rank_gib * GIB, element)


MEASURED_AT_MOST = 8  # ranks of the world --plan-only starts to measure the links


def options_of(config: FrameworkConfig, impl: str, metrics: str | None = None) -> RunOptions:
    t = config.train
    dtype = "float64" if config.precision == "fp64" else "float32"
    return RunOptions(t.batch, t.epochs, t.steps_per_epoch, t.eval_batches, dtype, t.seed,
                      t.sample_bytes, impl, metrics=metrics)  # fmt: skip


def checkpoint_plan(config: FrameworkConfig) -> CheckpointPlan:
    """Where the run resumes from and saves: with ``checkpoint.every: 0`` (the shipped default)
    it still resumes from a folder that holds checkpoints, and saves none (a folder full of
    checkpoints was ignored without a word before: issue 38)."""
    c = config.checkpoint
    return CheckpointPlan(c.dir, c.every, c.keep)


def plan_table(predictions: list[Prediction], rates: Rates, limit: int = 12) -> str:
    """The planner's ranking: each layout's predicted step and bytes, and what they come from
    (when ranks share cores, the step is every rank's CPU over the cores, and the critical
    path's parts are shown beside it)."""
    shared = any(p.shared is not None for p in predictions)
    cores = f" | all ranks' CPU / {rates.cores} cores ms" if shared else ""
    lines = [f"| rank | layout | step ms{cores} | critical path: pipeline / gradients / "
             "optimizer ms | held MiB per rank (states + activations) | fits |",
             "|---:|---|---:|" + ("---:|" if shared else "") + "---|---:|---|"]  # fmt: skip
    for index, p in enumerate(predictions[:limit], 1):
        parts = f"{p.pipeline * 1e3:.1f} / {p.gradients * 1e3:.1f} / {p.optimizer * 1e3:.1f}"
        busy = (f" | {p.shared * 1e3:.1f}" if p.shared is not None else " | -") if shared else ""
        held = f"{p.held.states / 2**20:.1f} + {p.held.activations / 2**20:.1f}"
        lines.append(f"| {index} | {p.settings.label()} | {p.seconds * 1e3:.1f}{busy} | {parts} | "
                     f"{held} | {'yes' if p.fits else 'no'} |")  # fmt: skip
    sources = "\n".join(f"- {k}: {v}" for k, v in rates.sources.items())
    more = f"\n({len(predictions) - limit} more layouts)" if len(predictions) > limit else ""
    return "\n".join(lines) + more + f"\n\nwhere the numbers come from:\n{sources}"


def rates_in_world(
    model: LMConfig,
    dtype: torch.dtype,
    per_node: int | None = None,
    deadline: float | None = None,
    batch: int | None = None,
) -> Rates:
    """Rates measured inside the running world: compute on rank 0, the links by every rank
    (inside and across nodes apart when the world spans nodes of ``per_node`` ranks); rank 0's
    broadcast, so that every rank plans alike; the anchor steps at ``batch``, the global batch
    to be planned. Each measurement within ``deadline`` seconds
    (default ``lm.rates.rates_timeout``), else ``MachineTooBusy`` (one line, every rank)."""
    deadline = rates_timeout() if deadline is None else deadline
    times = link_times(7, per_node, deadline, model, batch)
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        compute = measure_compute(model, dtype, deadline=deadline)
        links = fit_links(times, dist.get_world_size(), per_node)
        payload = [(compute, links, len(os.sched_getaffinity(0)))]
    dist.broadcast_object_list(payload, src=0)
    compute, links, cores = payload[0]
    sources = {"all": f"measured at launch in this world of {dist.get_world_size()} ranks"
               + (f", links inside and across nodes of {per_node} apart"
                  if links.inter_node is not None else "")}  # fmt: skip
    return rates_from(compute, links, cores, str(dtype).removeprefix("torch."), sources)


# what the config says of a run that is not its layout: the planner's choice keeps them
RUN_OPTIONS = ("weight_decay", "betas", "communication", "fused_adamw", "compile", "bf16_autocast")


def choose(config: FrameworkConfig, rates: Rates, world: int) -> list[Prediction]:
    """The planner's ranking for ``sharding: auto``, among the layouts the config's run options
    allow (a hand-made all-reduce: no ZeRO, which reduces with its own collectives), each
    carrying those options (:data:`RUN_OPTIONS`: a planned run trains with the config's weight
    decay, optimizer and precision)."""
    allowed: dict[str, Any] = {}
    if config.communication != "library":
        allowed["zeros"] = (0,)
    written = config.settings(world)
    options = {name: getattr(written, name) for name in RUN_OPTIONS}
    predictions = [
        replace(p, settings=replace(p.settings, **options))
        for p in plan(config.model.lm(), rates, machine_of(config, world), config.train.batch,
                      max_norm=config.train.max_norm, lr=config.train.lr, **allowed)
    ]  # fmt: skip
    if not predictions or not predictions[0].fits:
        raise ConfigError(
            f"sharding: auto found no layout of {world} ranks that fits "
            f"{config.planner.memory_per_rank_gib} GiB per rank: more ranks, a smaller model or "
            "batch, or a larger planner.memory_per_rank_gib"
        )
    return predictions


def validate(
    config: FrameworkConfig, world: int, plan_only: bool = False, metrics: str | None = None
) -> None:
    """Everything the run would be refused for on ``world`` ranks, before any process group:
    the layout, an odd world where links are measured by pairs, and for a training run the
    folders it writes (a checkpoint folder when ``checkpoint.every`` > 0, the metrics file);
    every problem at once, in one ConfigError."""
    problems = []
    try:
        check_world(config, world)
    except ConfigError as err:
        problems.append(str(err))
    measures = "--plan-only" if plan_only else "sharding: auto" if config.sharding == "auto" else ""
    if measures and world % 2:
        problems.append(f"{measures} measures the links by pairs of ranks: a world of {world} is "
                        "odd (fix: an even number of ranks)")  # fmt: skip
    c = config.checkpoint
    if not plan_only and c.every and (problem := folder_problem(c.dir, "checkpoint.dir")):
        problems.append(problem)
    if not plan_only and metrics and (problem := metrics_problem(metrics, "--metrics")):
        problems.append(problem)
    if problems:
        raise ConfigError("; ".join(problems))


def world_to_plan(world: int | None, plan_only: bool, under_torchrun: bool) -> int:
    """The world ``--plan-only`` plans for outside torchrun (``--world``, default 4), or
    ConfigError naming ``--world`` where it is not a world or would be ignored."""
    if world is None:
        return PLAN_WORLD
    if world < 2 or world % 2:
        raise ConfigError(
            f"--world {world}: --plan-only plans for an even number of ranks >= 2, as the links "
            f"are measured by pairs (fix: e.g. --plan-only --world {max(2, world + world % 2)})"
        )
    if not plan_only:
        raise ConfigError(
            f"--world {world}: only --plan-only reads it (fix: add --plan-only, or train on "
            f"{world} ranks with torchrun --nproc_per_node={world})"
        )
    if under_torchrun and world != int(os.environ["WORLD_SIZE"]):
        raise ConfigError(
            f"--world {world}: under torchrun the world is torchrun's {os.environ['WORLD_SIZE']} "
            f"ranks (fix: drop --world, or run torchrun --nproc_per_node={world})"
        )
    return world


def plan_here(config: FrameworkConfig, world: int) -> int:
    """``--plan-only`` outside torchrun: measure in worlds of this process's own, print the
    ranked plan for ``world`` ranks."""
    measured = min(world, MEASURED_AT_MOST)
    per_node = machine_of(config, world).ranks_per_node
    try:
        say(f"measuring this machine for the planner: one layer's compute, then the links in a "
            f"world of {measured} ranks (at most {rates_timeout():g} s each)")  # fmt: skip
        rates = measure_rates(
            config.model.lm(),
            DTYPES[config.precision],
            measured,
            per_node,
            batch=config.train.batch,
        )
        print(plan_table(choose(config, rates, world), rates))
    except Refusal as err:  # MachineTooBusy (exit 1), no layout fits or a bad DTFS_RATES_TIMEOUT
        return refused(err)
    return 0


def main(args: argparse.Namespace) -> int:
    """Run what ``lm/framework.py``'s parsed command line asks for; the exit code."""
    under_torchrun = "WORLD_SIZE" in os.environ
    try:
        config = load_config(args.config, args.set)
        world = world_to_plan(args.world, args.plan_only, under_torchrun)
    except ConfigError as err:
        return refused(err)
    if args.plan_only and not under_torchrun:
        try:
            validate(config, world, plan_only=True)
        except ConfigError as err:
            return refused(err)
        return plan_here(config, world)
    code = refuse_before_start(lambda world: validate(config, world, args.plan_only, args.metrics))
    if code is not None:
        return code
    with distributed_session():
        world = dist.get_world_size()
        settings: ParallelSettings = config.settings(world)
        if config.sharding == "auto" or args.plan_only:
            per_node = machine_of(config, world).ranks_per_node
            say(f"measuring this machine for the planner: the links of the {world} ranks, then "
                f"one layer's compute on rank 0 (at most {rates_timeout():g} s each)")  # fmt: skip
            rates = rates_in_world(
                config.model.lm(), DTYPES[config.precision], per_node, batch=config.train.batch
            )
            predictions = choose(config, rates, world)
            log0(plan_table(predictions, rates))
            if args.plan_only:
                return 0
            settings = predictions[0].settings
            log0(f"\nthe planner's choice: {settings.label()}\n")
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep)  # fmt: skip
        options = options_of(config, args.impl, args.metrics)
        run(config.model.lm(), settings, options, topology, checkpoint_plan(config))
    return 0

