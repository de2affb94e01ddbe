"""3.8's goal: your MoE layer's all-to-alls carry exactly the rows the census says, no more.

    uv run python -m tests.bench 3.8                    # your routing, dispatch and combine
    uv run python -m tests.bench 3.8 --impl solutions   # the reference
    uv run python -m tests.bench 3.8 --quick            # ep = 2 only

Your ``MoELayer`` (``template_moe_routing.py``, ``template_expert_parallel.py``) runs one training
step, forward and backward, on expert-parallel groups of ep = 2 and 4 ranks (4 and 8 experts,
k = 2, 8 of hidden size, float32), each rank with its own number of tokens, drawn off-centre so
that the router sends them unevenly: with capacity factor 1.0 some choices are dropped, with
capacity factor 8.0 none. A ``CommCounter`` counts the bytes each rank hands to
``all_to_all_single`` in that step (an all-to-all's input, this rank's own piece included), and
they are compared with the census formula (``solutions/phase3_multi_node/benchmarks/strategies_moe.py``):

    K_r = the choices rank r keeps;  R_r = the kept choices of every rank for r's experts
    all-to-all bytes = 8·E  +  2 · 4h · (K_r + R_r)      counts; dispatch and combine, fwd and bwd

with the kept choices worked out from the census (given: ``gather_expert_counts``) and the
capacity C: for each expert, the group's choices fill its C places first come, first served in
rank order. The goal is exact:
no byte off on any rank (a dropped choice that travels, a capacity counted per rank, a row sent
twice each show up here). Counted bytes cannot be flipped by the machine's load: the verdict is
``goal met`` or ``goal not met``. It needs only exercise 3.8.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benches import verdict
from course.comm_counter import CommCounter
from course.impl import load_impl, unwritten_todo
from course.results import Table
from course.world import RankFailed, WorldError, run_world
from phase3_multi_node.moe_experts import MoEConfig, build_moe
from phase3_multi_node.moe_layout import ExpertLayout
from solutions.phase3_multi_node.benchmarks.strategies_moe import kept_choices, traffic_formula

PHASE = "phase3_multi_node"
MODULES = ("moe_routing", "expert_parallel")
GOAL = (
    "3.8: bytes your MoE layer hands to all_to_all_single per rank and step (fwd and bwd) == "
    "the census formula 8·E + 2·4h·(rows kept out + rows kept in), 0 bytes off (ep = 2 and 4)"
)
HIDDEN, FFN_HIDDEN, K = 8, 16, 2
CAPACITY_FACTORS = (1.0, 8.0)  # drops choices; drops none (capacity >= every choice of the group)


def tokens_of(rank: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tokens: 24 + 5·rank of them (uneven), around a common offset so that the
    fresh router prefers a few experts (uneven routing, drops at capacity factor 1)."""
    offset = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))
    draw = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    return offset + torch.randn(24 + 5 * rank, HIDDEN, generator=draw)


def traffic_worker(impl: str, experts: int) -> list[dict[str, Any]]:
    """One step per capacity factor on this rank; every rank returns its counted bytes next to
    the formula's."""
    ep_mod = load_impl(PHASE, "expert_parallel", impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ExpertLayout.build(ep=world, dp=1)
    found = []
    for factor in CAPACITY_FACTORS:
        config = MoEConfig(HIDDEN, FFN_HIDDEN, experts, K, factor)
        layer = ep_mod.MoELayer(build_moe(config, seed=0), layout.ep_group)
        tokens = tokens_of(rank).requires_grad_()
        with CommCounter() as counter:
            output, aux = layer(tokens)
            (output.square().mean() + 0.01 * aux).backward()
        calls = [r for r in counter.records if r.op == "all_to_all_single"]
        last = layer.last
        census, capacity = last.census.cpu(), int(last.capacity)
        kept = kept_choices(census, capacity)
        formula = traffic_formula(census, capacity, rank, world, config)["all-to-all"]
        found.append(
            {
                "factor": factor,
                "rank": rank,
                "tokens": int(tokens.shape[0]),
                "capacity": capacity,
                "dropped": int(census.sum() - kept.sum()),
                "routed": int(census.sum()),
                "calls": len(calls),
                "counted": sum(r.nbytes for r in calls),
                "formula": int(formula),
            }
        )
    return found


def table_of(rows: Sequence[dict[str, Any]], ep: int, experts: int) -> tuple[Table, int]:
    table = Table(
        ["ep", "experts", "capacity factor", "capacity", "choices dropped", "rank", "tokens",
         "all-to-alls", "bytes counted", "formula", "bytes off"]
    )  # fmt: skip
    worst = 0
    for r in sorted(rows, key=lambda r: (r["factor"], r["rank"])):
        off = abs(r["counted"] - r["formula"])
        worst = max(worst, off)
        table.add(
            ep, experts, f"{r['factor']:g}", r["capacity"], f"{r['dropped']} of {r['routed']}",
            r["rank"], r["tokens"], r["calls"], r["counted"], r["formula"], off,
        )  # fmt: skip
    return table, worst


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0])
    args = p.parse_args(list(argv))
    for module in MODULES:
        missing = unwritten_todo(PHASE, module, args.impl)
        if missing:
            print(missing)
            return 2
    worst = 0
    tables = []
    for ep in (2,) if args.quick else (2, 4):
        experts = 2 * ep
        try:
            ranks = run_world(traffic_worker, ep, (args.impl, experts), {}, timeout=300)
        except RankFailed as err:
            if err.exc_type == "NotImplementedError":
                print(f"{err.message.replace(':', ' not written:', 1)} (rank {err.rank})")
            else:
                print(f"the measurement could not run (ep={ep}): {str(err).splitlines()[0]}")
            return 2
        except WorldError as err:
            print(f"the measurement could not run (ep={ep}): {str(err).splitlines()[0]}")
            return 2
        table, off = table_of([row for rank in ranks for row in rank], ep, experts)
        tables.append(table)
        worst = max(worst, off)
    print(
        f"3.8 expert parallelism ({args.impl}): bytes each rank hands to all_to_all_single in "
        f"one step (forward and backward), k = {K}, hidden {HIDDEN}, float32 rows, int64 counts\n"
    )
    for table in tables:
        print(table.to_markdown() + "\n")
    goal = verdict.Goal(
        "largest difference between a rank's all-to-all bytes and the census formula", 0,
        at_least=False, unit=" bytes",
    )  # fmt: skip
    print(goal.verdict(worst))
    return verdict.EXIT_MET if goal.met(worst) else verdict.EXIT_NOT_MET


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
