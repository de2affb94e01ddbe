"""The language-model framework: one YAML config picks every strategy, or the planner does.

Trains the language model of exercise 4.7 on the Python documentation (``lm_trainer.run``) with
the layout and strategies a config names (``lm_config.py``: model, parallel degrees, ZeRO stage,
pipeline schedule, communication, sharding ``manual`` or ``auto``, precision, training,
checkpoints that resume at any layout), checked
against the world size before any process group exists::

    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase4_production.lm_framework
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase4_production.lm_framework \\
        --set sharding=auto
    uv run python -m solutions.phase4_production.lm_framework --plan-only --world 8

With ``sharding: auto`` the planner (``lm_planner.py``) ranks every legal layout of the world
from rates measured on the machine (compute in one process, the links in the running world; rank
0's rates are broadcast so that every rank plans the same) and the run takes its first choice.
``--plan-only`` prints the ranked table and stops; outside torchrun it plans for ``--world``
ranks, measuring the links in a world of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from course.cli import refuse_before_start, run_main
from course.config_files import ConfigError
from course.distributed import distributed_session, env_int
from course.impl import IMPLS
from course.language_model import LMConfig
from course.rank_logging import log0
from course.topology import Topology
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm_checkpoint import CheckpointPlan
from solutions.phase4_production.lm_config import (
    DEFAULT_CONFIG,
    FrameworkConfig,
    check_world,
    load_config,
)
from solutions.phase4_production.lm_planner import GIB, Machine, Prediction, plan
from solutions.phase4_production.lm_rates import (
    Rates,
    fit_links,
    link_times,
    measure_compute,
    measure_rates,
)
from solutions.phase4_production.lm_trainer import RunOptions, run

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def machine_of(config: FrameworkConfig, world: int) -> Machine:
    per_node = config.planner.ranks_per_node or min(world, env_int("LOCAL_WORLD_SIZE", world))
    element = torch.finfo(DTYPES[config.precision]).bits // 8
    return Machine(world, per_node, config.planner.memory_per_rank_gib * GIB, element)


def options_of(config: FrameworkConfig, impl: str) -> RunOptions:
    t = config.train
    dtype = "float64" if config.precision == "fp64" else "float32"
    return RunOptions(t.batch, t.epochs, t.steps_per_epoch, t.eval_batches, dtype, t.seed,
                      t.sample_bytes, impl)  # fmt: skip


def plan_table(predictions: list[Prediction], rates: Rates, limit: int = 12) -> str:
    """The planner's ranking: each layout's predicted step and bytes, and what they come from."""
    lines = ["| rank | layout | step ms | pipeline / gradients / optimizer ms | held MiB per "
             "rank (states + activations) | fits |", "|---:|---|---:|---|---:|---|"]  # fmt: skip
    for index, p in enumerate(predictions[:limit], 1):
        parts = f"{p.pipeline * 1e3:.1f} / {p.gradients * 1e3:.1f} / {p.optimizer * 1e3:.1f}"
        held = f"{p.held.states / 2**20:.1f} + {p.held.activations / 2**20:.1f}"
        lines.append(f"| {index} | {p.settings.label()} | {p.seconds * 1e3:.1f} | {parts} | "
                     f"{held} | {'yes' if p.fits else 'no'} |")  # fmt: skip
    sources = "\n".join(f"- {k}: {v}" for k, v in rates.sources.items())
    more = f"\n({len(predictions) - limit} more layouts)" if len(predictions) > limit else ""
    return "\n".join(lines) + more + f"\n\nwhere the numbers come from:\n{sources}"


def rates_in_world(model: LMConfig, dtype: torch.dtype, per_node: int | None = None) -> Rates:
    """Rates measured inside the running world: compute on rank 0, the links by every rank
    (inside and across nodes apart when the world spans nodes of ``per_node`` ranks); rank 0's
    broadcast, so that every rank plans alike."""
    times = link_times(7, per_node)
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        compute = measure_compute(model, dtype)
        links = fit_links(times, dist.get_world_size(), per_node)
        payload = [(compute, links, len(os.sched_getaffinity(0)))]
    dist.broadcast_object_list(payload, src=0)
    compute, links, cores = payload[0]
    return Rates(
        layer_forward=compute["layer_forward"],
        layer_backward=compute["layer_backward"],
        norm_share=compute["norm_share"],
        head_per_token=compute["head_per_token"],
        activation_bytes_per_token=compute["activation_bytes_per_token"],
        norm_activation_bytes_per_token=compute["norm_activation_bytes_per_token"],
        optimizer_per_element=compute["optimizer_per_element"],
        all_reduce=links.all_reduce,
        point_to_point=links.point_to_point,
        cores=cores,
        dtype=str(dtype).removeprefix("torch."),
        sources={"all": f"measured at launch in this world of {dist.get_world_size()} ranks"
                 + (f", links inside and across nodes of {per_node} apart"
                    if links.inter_node is not None else "")},
        inter_node=links.inter_node,
    )  # fmt: skip


def choose(config: FrameworkConfig, rates: Rates, world: int) -> list[Prediction]:
    predictions = plan(config.model.lm(), rates, machine_of(config, world), config.train.batch,
                       max_norm=config.train.max_norm, lr=config.train.lr)  # fmt: skip
    if not predictions or not predictions[0].fits:
        raise ConfigError(
            f"sharding: auto found no layout of {world} ranks that fits "
            f"{config.planner.memory_per_rank_gib} GiB per rank: more ranks, a smaller model or "
            "batch, or a larger planner.memory_per_rank_gib"
        )
    return predictions


def validate(config: FrameworkConfig, world: int) -> None:
    check_world(config, world)
    if config.sharding == "auto" and world % 2:
        raise ConfigError(f"sharding: auto measures links by pairs of ranks: {world} is odd")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plan-only", action="store_true", help="print the plan and stop")
    parser.add_argument("--world", type=int, default=None, help="--plan-only outside torchrun")
    parser.add_argument("--impl", choices=IMPLS, default="solutions")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    under_torchrun = "WORLD_SIZE" in os.environ
    if args.plan_only and not under_torchrun:
        world = args.world or 4
        try:
            validate(config, world)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        measured = min(world, 8)
        per_node = machine_of(config, world).ranks_per_node
        rates = measure_rates(config.model.lm(), DTYPES[config.precision], measured, per_node)
        print(plan_table(choose(config, rates, world), rates))
        return 0
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    with distributed_session():
        world = dist.get_world_size()
        settings: ParallelSettings = config.settings(world)
        if config.sharding == "auto" or args.plan_only:
            per_node = machine_of(config, world).ranks_per_node
            rates = rates_in_world(config.model.lm(), DTYPES[config.precision], per_node)
            predictions = choose(config, rates, world)
            log0(plan_table(predictions, rates))
            if args.plan_only:
                return 0
            settings = predictions[0].settings
            log0(f"\nthe planner's choice: {settings.label()}\n")
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep)  # fmt: skip
        c = config.checkpoint
        plan = CheckpointPlan(c.dir, c.every, c.keep) if c.every else None
        run(config.model.lm(), settings, options_of(config, args.impl), topology, plan)
    return 0


if __name__ == "__main__":
    run_main(main)
