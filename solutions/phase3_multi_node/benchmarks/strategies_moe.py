"""The expert-parallel row of ``benchmarks.strategies``: exercise 3.8's ``MoELayer`` in a model
of the benchmark's size class, its traffic counted against a formula, its loss against one
process.

**The model** ("MoE MLP"; another model than the dense rows', so its loss is compared with the
same model in one process, never with theirs): the benchmark's first and last
``Linear(width, width)``, and between them, where the dense MLP has its hidden layers, one
mixture-of-experts layer with a residual connection (the residual carries a token whose every
choice was dropped, as in Switch Transformer)::

    h = relu(first(x));  m, aux = moe(h);  y = last(h + m)

``moe`` has E experts ``ExpertMLP(width, expert_hidden)`` (``moe_experts``), top-k routing and a
capacity factor; the training loss is the MSE plus ``AUX_COEF`` (Switch Transformer's 0.01) times
the load-balancing loss. With the benchmark's defaults (width 1024, 4 experts of 256) the
experts together hold as many weights as the two hidden Linear layers they replace.

**Placement**: expert parallelism over the whole world (ep = world, dp = 1): each rank holds
E/world experts (3.8's ``MoELayer`` on ``ExpertLayout.build(ep=world, dp=1)``), a copy of
``first``, ``last`` and the router, and routes its own slice of the global batch. After backward,
3.8's ``sync_moe_gradients`` (the router summed over the world, the experts over their dp group,
here one rank, both divided by the world size), and the replicated Linear layers averaged
over the world by phase 1's ``average_gradients`` (one flat all-reduce). The gradients are then
those of the mean of the ranks' losses: what one process computes on the whole batch
(``one_process_losses``, with 3.8's plain-loop ``reference_group``).

**Traffic**, per rank and step (:func:`traffic_formula`): the bytes this rank hands to each
collective as ``course.comm_counter.CommCounter`` counts them (an all-to-all's input, this
rank's own piece included; an all-reduce's tensor; an all-gather's output), from the census
``c[s, e]`` (choices rank s routed to expert e) and the capacity C::

    kept  k[s, e] = min(c[s, e], max(0, C - sum_{s' < s} c[s', e]))   first come, first served
    K_r = sum_e k[r, e]  rows rank r dispatches;  R_r = sum_s sum_{e on r} k[s, e]  rows it gets
    all-to-all      8·E  +  2 · 4h · (K_r + R_r)    counts; dispatch and combine, fwd and bwd
    all-gather      8·N·E                           the census
    all-reduce      4 · (2(h² + h) + E·h)           first, last, router: on the world
                  + 4 · E/N · (2hf + f + h)         the experts: on their dp group (one rank)

(h the width, f the experts' hidden width, N the world, float32 rows, int64 counts). Dropped
choices are never sent: they are in c, not in k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.comm_counter import CommCounter, CommRecord
from course.impl import load_impl
from phase3_multi_node.moe_experts import DenseMoE, MoEConfig, build_moe, experts_of_rank
from phase3_multi_node.moe_layout import ExpertLayout
from solutions.phase3_multi_node.references.moe import reference_group

PHASE1, PHASE3 = "phase1_data_parallel", "phase3_multi_node"
AUX_COEF = 0.01  # Switch Transformer's coefficient of the load-balancing loss
ROW_ELEMENT = 4  # float32 rows
COUNT_ELEMENT = 8  # int64 counts


def loss_tolerance(device: str) -> float:
    """How far (relative) the expert-parallel loss may be from the one process's: float32, the
    experts run on batches of rows there and row by row here (the same CPU kernels: 1e-6); on
    a GPU the one process still runs on the CPU (1e-4). Leaving out the load-balancing loss on
    one side moves the tiny benchmark's loss by 2e-5."""
    return 1e-6 if device == "cpu" else 1e-4


TRAFFIC_KINDS = ("all-to-all", "all-gather", "all-reduce world", "all-reduce dp")


class MoEMLP(nn.Module):
    """``y = last(h + moe(h))``, ``h = relu(first(x))``; ``forward`` returns ``(y, aux_loss)``."""

    def __init__(self, first: nn.Linear, moe: Any, last: nn.Linear) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.moe: Any = moe  # 3.8's MoELayer (reference or template): forward -> (out, aux)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.first(x))
        mixed, aux = self.moe(hidden)
        return self.last(hidden + mixed), aux


def model_parts(config: MoEConfig) -> tuple[nn.Linear, nn.Linear, DenseMoE]:
    """``first``, ``last`` and the whole MoE layer from fixed seeds: the same on every rank and
    in the one process (built under a forked RNG: the caller's random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        first = nn.Linear(config.hidden, config.hidden)
        last = nn.Linear(config.hidden, config.hidden)
    return first, last, build_moe(config, seed=1)


def parameter_count(config: MoEConfig) -> int:
    """The whole MoE MLP's parameters (every expert once)."""
    first, last, dense = model_parts(config)
    return sum(p.numel() for m in (first, last, dense) for p in m.parameters())


@dataclass
class ExpertParallelRun:
    """This rank's model, optimizer and step; ``traffic`` reads one counted step."""

    model: MoEMLP
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], float]
    config: MoEConfig

    def traffic(self, records: Sequence[CommRecord]) -> dict[str, Any]:
        """The counted bytes of the step just run (``records``) next to the formula's, and the
        routing they come from."""
        last = self.model.moe.last
        census, capacity = last.census.cpu(), int(last.capacity)
        rank, world = dist.get_rank(), dist.get_world_size()
        kept = kept_choices(census, capacity)
        mine = list(experts_of_rank(self.config.num_experts, world, rank))
        return {
            "counted": counted_traffic(records, world),
            "formula": traffic_formula(census, capacity, rank, world, self.config),
            "census": census.tolist(),
            "capacity": capacity,
            "tokens": int(last.routing.experts.shape[0]),
            "sent_rows": int(kept[rank].sum()),
            "received_rows": int(kept[:, mine].sum()),
        }


def build_expert_parallel(
    config: MoEConfig, impl: str, lr: float, device: torch.device, mine: slice
) -> ExpertParallelRun:
    """The expert-parallel MoE MLP on this rank (a collective: it builds the layout's groups)."""
    ep_mod = load_impl(PHASE3, "expert_parallel", impl)
    replicated = load_impl(PHASE1, "trainer", impl).average_gradients
    layout = ExpertLayout.build(ep=dist.get_world_size(), dp=1)
    first, last, dense = model_parts(config)
    model = MoEMLP(first, ep_mod.MoELayer(dense, layout.ep_group), last).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        output, aux = model(x[mine])
        loss = F.mse_loss(output, y[mine])
        (loss + AUX_COEF * aux).backward()
        ep_mod.sync_moe_gradients(model.moe, layout)
        replicated(nn.ModuleList([model.first, model.last]))  # phase 1's average, world
        optimizer.step()
        return float(loss.detach())

    return ExpertParallelRun(model, optimizer, step, config)


@contextlib.contextmanager
def counting(enabled: bool) -> Iterator[CommCounter | None]:
    """A ``CommCounter`` around the block when ``enabled``, else nothing."""
    if not enabled:
        yield None
        return
    with CommCounter() as counter:
        yield counter


def counted_traffic(records: Sequence[CommRecord], world: int) -> dict[str, int]:
    """The counted bytes by kind (``TRAFFIC_KINDS``); an all-reduce is "world" when its group
    has every rank. Any other op is counted under its own name (the formula has none)."""
    totals = dict.fromkeys(TRAFFIC_KINDS, 0)
    for record in records:
        if record.op == "all_to_all_single":
            kind = "all-to-all"
        elif record.op == "all_gather_into_tensor":
            kind = "all-gather"
        elif record.op == "all_reduce":
            everyone = record.group_ranks is None or len(record.group_ranks) == world
            kind = "all-reduce world" if everyone else "all-reduce dp"
        else:
            kind = record.op
        totals[kind] = totals.get(kind, 0) + record.nbytes
    return totals


def kept_choices(census: torch.Tensor, capacity: int) -> torch.Tensor:
    """``k[s, e]``: how many of rank s's choices of expert e fit, first come first served in
    rank order (the census says how far each expert's queue is before rank s)."""
    before = torch.cumsum(census, dim=0) - census
    return torch.minimum(census, (capacity - before).clamp(min=0))


def traffic_formula(
    census: torch.Tensor, capacity: int, rank: int, world: int, config: MoEConfig
) -> dict[str, int]:
    """The bytes rank ``rank`` hands to each kind of collective in one step (module docstring)."""
    kept = kept_choices(census, capacity)
    h, f, experts = config.hidden, config.ffn_hidden, config.num_experts
    mine = list(experts_of_rank(experts, world, rank))
    sent = int(kept[rank].sum())
    received = int(kept[:, mine].sum())
    return {
        "all-to-all": COUNT_ELEMENT * experts + 2 * ROW_ELEMENT * h * (sent + received),
        "all-gather": COUNT_ELEMENT * world * experts,
        "all-reduce world": ROW_ELEMENT * (2 * (h * h + h) + experts * h),
        "all-reduce dp": ROW_ELEMENT * len(mine) * (2 * h * f + f + h),
    }


def one_process_losses(
    config: MoEConfig,
    lr: float,
    world: int,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[float]:
    """The same MoE MLP, data and AdamW in one process, every expert here: 3.8's plain-loop
    ``reference_group`` stands in for the expert-parallel layer, the global batch cut into the
    ranks' slices (capacity and load-balancing loss are per group and per rank there too).
    Returns the task loss (the mean of the slices' MSE) of every step."""
    first, last, dense = model_parts(config)
    params = [p for m in (first, last, dense) for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr)
    losses = []
    for x, y in batches:
        share = x.shape[0] // world
        hidden = [F.relu(first(x[r * share : (r + 1) * share].cpu())) for r in range(world)]
        group = reference_group(dense, hidden)
        task = torch.stack(
            [
                F.mse_loss(last(hidden[r] + group[r].output), y[r * share : (r + 1) * share].cpu())
                for r in range(world)
            ]
        )
        aux = torch.stack([rank.aux_loss for rank in group])
        optimizer.zero_grad(set_to_none=True)
        (task + AUX_COEF * aux).mean().backward()
        optimizer.step()
        losses.append(float(task.mean().detach()))
    return losses
