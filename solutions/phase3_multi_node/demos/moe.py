"""Demo of exercise 3.8: train one mixture-of-experts layer with expert x data parallelism.

Every rank builds the same MoE layer from one seed (``build_moe``), keeps the router and its own
experts (``MoELayer`` on its expert-parallel group), and trains a few SGD steps on its own random
tokens (rank r has ``--tokens + r`` of them: the ranks' batches differ in size) to imitate a fixed
random linear map, with the load-balancing loss added. It prints the layout, then per step the
loss, the load-balancing loss, how many token choices each expert received and how many were
dropped over capacity, and the rows each rank sent to and received from other ranks; the first
step's outputs are compared with one process running every expert on every token of the
replica. ``--impl templates`` runs your own ``phase3_multi_node/template_moe_routing.py`` and
``template_expert_parallel.py``.

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.moe
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.moe \
        --impl templates
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase3_multi_node.demos.moe \
        --ep 2 --dp 2

Settings that cannot run (an ep that does not divide the number of experts, ep x dp not the
world size, k larger than the number of experts, ...) are refused before the process group
exists, each named with a fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.cli import parse_config, refuse_before_start, run_main
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from phase3_multi_node.moe_experts import MoEConfig, build_moe, check_moe_config
from phase3_multi_node.moe_layout import ExpertLayout
from solutions.phase3_multi_node.references.moe import reference_group

PHASE = "phase3_multi_node"


@dataclass
class DemoConfig:
    """Flags of the demo; every rank must be given the same values."""

    ep: int = field(
        default=-1, metadata={"ge": -1, "help": "expert-parallel degree; -1: world / dp"}
    )
    dp: int = field(default=1, metadata={"ge": 1, "help": "replicas of the expert group"})
    hidden: int = field(default=16, metadata={"ge": 1})
    ffn_hidden: int = field(default=32, metadata={"ge": 1, "help": "each expert's inner width"})
    experts: int = field(default=4, metadata={"ge": 1, "help": "number of experts"})
    k: int = field(default=2, metadata={"ge": 1, "help": "experts per token"})
    capacity_factor: float = field(
        default=1.0, metadata={"gt": 0, "fix": "a positive factor, e.g. --capacity-factor 1.25"}
    )
    tokens: int = field(default=24, metadata={"ge": 1, "help": "tokens of rank 0; rank r: +r"})
    aux_coef: float = field(
        default=0.01, metadata={"ge": 0, "help": "weight of the load-balancing loss"}
    )
    steps: int = field(default=5, metadata={"ge": 1})
    lr: float = field(default=0.1, metadata={"gt": 0, "fix": "a positive learning rate"})
    seed: int = 0
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase3 templates"},
    )

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(self.hidden, self.ffn_hidden, self.experts, self.k, self.capacity_factor)


def degrees(config: DemoConfig, world_size: int) -> tuple[int, int]:
    """(ep, dp) for this world; ValueError naming the fix when they do not fill it."""
    ep = config.ep if config.ep != -1 else world_size // config.dp
    if config.ep == 0 or ep < 1 or ep * config.dp != world_size:
        raise ValueError(
            f"--ep {config.ep} x --dp {config.dp} does not fill the world of {world_size} "
            f"processes: ep x dp must equal --nproc_per_node (e.g. --ep {max(1, world_size)} "
            "--dp 1, or --ep -1 to take what dp leaves)"
        )
    return ep, config.dp


def validate(config: DemoConfig, world_size: int) -> None:
    """Every bad setting at once, naming each: raised before the process group exists."""
    ep, dp = degrees(config, world_size)
    check_moe_config(config.moe, ep, dp)


def tokens_of(config: DemoConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step`` and their targets (a fixed random linear map)."""
    g = torch.Generator().manual_seed(10_000 * config.seed + 100 * step + rank)
    x = torch.randn(config.tokens + rank, config.hidden, generator=g)
    teacher = torch.Generator().manual_seed(config.seed + 99)
    mapping = torch.randn(config.hidden, config.hidden, generator=teacher) / config.hidden**0.5
    return x, x @ mapping


def run_demo(config: DemoConfig, device: torch.device | None = None) -> dict[str, Any]:
    """Train and report, inside an initialised process group; returns rank 0's summary."""
    device = device or torch.device("cpu")
    ep_mod = load_impl(PHASE, "expert_parallel", config.impl)
    ep, dp = degrees(config, dist.get_world_size())
    layout = ExpertLayout.build(ep=ep, dp=dp)
    dense = build_moe(config.moe, seed=config.seed)
    layer = ep_mod.MoELayer(dense, layout.ep_group).to(device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=config.lr)
    rank = dist.get_rank()
    log0(
        f"expert parallelism ({config.impl}): {config.experts} experts {config.hidden} -> "
        f"{config.ffn_hidden} -> {config.hidden}, k={config.k}, capacity factor "
        f"{config.capacity_factor}, aux coefficient {config.aux_coef}; rank r has "
        f"{config.tokens} + r tokens; SGD lr {config.lr}"
    )
    log0(layout.describe(config.experts))
    log0(
        "\n| step | loss | aux loss | choices per expert (replica 0) | capacity | dropped |"
        "\n|---:|---:|---:|---|---:|---:|"
    )
    summary: dict[str, Any] = {"steps": []}
    for step in range(config.steps):
        x, target = (t.to(device) for t in tokens_of(config, rank, step))
        optimizer.zero_grad(set_to_none=True)
        output, aux = layer(x)
        loss = F.mse_loss(output, target)
        (loss + config.aux_coef * aux).backward()
        ep_mod.sync_moe_gradients(layer, layout)
        optimizer.step()
        last = layer.last
        if step == 0:
            summary["max_diff"] = compare_with_one_process(config, layout, x, output, rank)
            summary["rows"] = rows_table(last.plan, layout)
        totals = torch.tensor([float(loss.detach()), float(aux.detach())], dtype=torch.float64)
        dist.all_reduce(totals)
        totals /= layout.world_size
        routed = last.census.sum(dim=0).cpu()
        dropped = int((routed - last.capacity).clamp(min=0).sum())
        row = (step, float(totals[0]), float(totals[1]), routed.tolist(), last.capacity, dropped)
        summary["steps"].append(row)
        log0(
            f"| {step} | {row[1]:.6f} | {row[2]:.4f} | {row[3]} | {row[4]} | "
            f"{dropped} of {int(routed.sum())} |"
        )
    log0(
        f"\nstep 0 outputs against one process running every expert on the replica's tokens: "
        f"max difference {summary['max_diff']:.1e}"
    )
    log0("\nrows of step 0 per rank (one row = one token choice, hidden x 4 bytes):\n")
    log0("| rank | (dp, ep) | rows sent to other ranks | rows received from other ranks |")
    log0("|---:|---|---:|---:|")
    for line in summary["rows"]:
        log0(line)
    log0(
        "\nthe backward sends the same rows' gradients the other way; sync_moe_gradients then "
        f"all-reduces the router over all {layout.world_size} ranks and each expert over its "
        f"dp group of {layout.dp_size}"
    )
    return summary


def compare_with_one_process(
    config: DemoConfig, layout: ExpertLayout, x: torch.Tensor, output: torch.Tensor, rank: int
) -> float:
    """Max difference between this step's outputs and one process running every expert on the
    tokens of this rank's replica (the weights before this step's update)."""
    everyone: list[Any] = [None] * layout.ep_size
    dist.all_gather_object(everyone, x.detach().cpu(), group=layout.ep_group)
    dense = build_moe(config.moe, seed=config.seed)
    with torch.no_grad():
        mine = reference_group(dense, everyone)[layout.ep_rank].output
    diff = torch.tensor([float((mine - output.detach().cpu()).abs().max())])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def rows_table(plan: Any, layout: ExpertLayout) -> list[str]:
    me = layout.ep_rank
    sent = sum(n for j, n in enumerate(plan.send_splits) if j != me)
    received = sum(n for j, n in enumerate(plan.recv_splits) if j != me)
    mine = f"| {dist.get_rank()} | ({layout.dp_rank}, {layout.ep_rank}) | {sent} | {received} |"
    lines: list[Any] = [None] * layout.world_size
    dist.all_gather_object(lines, mine)
    return [str(line) for line in lines]


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    with distributed_session() as info:
        run_demo(config, info.device)
    return 0


if __name__ == "__main__":
    run_main(main)
