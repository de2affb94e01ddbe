"""4.7's goal: every axis of your composition moves exactly the bytes its cost table says.

    uv run python -m tests.bench 4.7                    # yours, 7 layouts on 4 ranks
    uv run python -m tests.bench 4.7 --impl solutions --quick   # 3 layouts

Right values are not the whole story: a composition that all-reduces where a reduce-scatter
would do, gathers the sequence twice, or sums a gradient on a group too many trains the same
model and pays for it on every step. Each layout here takes one warm-up step, then one step
under ``CommCounter``; every rank's messages, by group and op (calls and bytes), are compared
with the formulas of ``solutions/phase4_production/lm/traffic.py`` (the guide's cost table,
applied to the model's sizes), and the MoE rows, whose split follows the routing, per ep group.
The goal is exact: no byte and no call off. Counted bytes do not depend on the machine's load.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from benches import verdict
from course.impl import unwritten_todo
from course.results import Table
from course.world import WorldError, run_world
from phase4_production.lm_functions import COMPOSITION_MODULES

GOAL = "4.7: bytes and calls of every axis of one step == the cost table's formulas (0 off)"
LAYOUTS: list[tuple[str, dict[str, Any], bool]] = [
    ("dp2 x tp2+sp", {"dp": 2, "tp": 2, "sequence_parallel": True}, False),
    ("cp2 x pp2", {"cp": 2, "pp": 2, "microbatches": 2}, False),
    ("dp4 x ep4 (MoE)", {"dp": 4, "ep": 4}, True),
    ("tp4", {"tp": 4}, False),
    ("pp4 zb-h1", {"pp": 4, "schedule": "zb-h1", "microbatches": 4, "max_norm": 1.0}, False),
    ("dp2 x cp2 ZeRO-2", {"dp": 2, "cp": 2, "zero": 2, "max_norm": 1.0}, False),
    ("dp2 x pp2 ZeRO-1", {"dp": 2, "pp": 2, "zero": 1, "microbatches": 2, "max_norm": 1.0}, False),
]


def layout_worker(impl: str, layouts: list[tuple[str, dict[str, Any], bool]]) -> list[Any]:
    """On this rank: each layout's measured and expected traffic of its second step."""
    from dataclasses import replace

    from course.impl import load_impl
    from course.language_model import LMConfig, build_language_model
    from course.topology import Topology
    from phase4_production.lm_layout import ParallelSettings
    from solutions.phase4_production.lm import traffic as lm_traffic

    lm = load_impl("phase4_production", "lm_parallel", impl)
    base = LMConfig(width=32, heads=4, layers=4, ffn=64, seq_len=32, expert_ffn=32)
    out = []
    for name, options, moe in layouts:
        config = replace(base, moe_layers=(1, 2)) if moe else base
        settings = ParallelSettings(lr=1e-3, **options)
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep)  # fmt: skip
        model = lm.ParallelLanguageModel(build_language_model(config, 0), topology, settings)
        data = [lm_traffic_batch(step, config.seq_len) for step in range(2)]
        model.train_step(*data[0])
        got = lm_traffic.measure_step(model, *data[1])
        want = lm_traffic.expected_step(model, 8)
        diffs = [(f"{k[0]} {k[1]}", (g.calls, g.nbytes), (w.calls, w.nbytes))
                 for k, g, w in lm_traffic.differences(got, want)]  # fmt: skip
        rows = sum(t.nbytes for k, t in got.items() if k[1] == lm_traffic.ROWS)
        out.append({
            "name": name, "total": sum(t.nbytes for t in got.values()), "diffs": diffs,
            "rows": rows, "rows_expected": lm_traffic.moe_rows_expected(model, 8),
            "ep": topology.group_ranks("ep"),
        })  # fmt: skip
    return out


def lm_traffic_batch(step: int, seq_len: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, 256, (8, seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def table_of(per_rank: Sequence[list[Any]]) -> tuple[Table, int, list[str]]:
    table = Table(
        ["layout", "bytes per step (all ranks)", "calls and bytes off", "first difference"]
    )
    worst, notes = 0, []
    for index in range(len(per_rank[0])):
        rows = [r[index] for r in per_rank]
        off = sum(abs(g[1] - w[1]) + abs(g[0] - w[0]) for r in rows for _, g, w in r["diffs"])
        groups: dict[tuple[int, ...], int] = {}
        for r in rows:
            groups[tuple(r["ep"])] = groups.get(tuple(r["ep"]), 0) + r["rows"]
        if rows[0]["rows_expected"]:
            off += sum(abs(total - rows[0]["rows_expected"]) for total in groups.values())
        first = next(
            (
                f"rank {i}: {d[0]}: {d[1][0]} calls {d[1][1]} B, formula {d[2][0]} "
                f"calls {d[2][1]} B"
                for i, r in enumerate(rows)
                for d in r["diffs"]
            ),
            "-",
        )
        table.add(rows[0]["name"], sum(r["total"] for r in rows), off, first)  # fmt: skip
        worst = max(worst, off)
        if first != "-":
            notes.append(f"{rows[0]['name']}: {first}")
    return table, worst, notes


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0])
    args = p.parse_args(list(argv))
    own = [pm for pm in COMPOSITION_MODULES if pm[1].startswith("lm_")]
    for phase, module in own + [pm for pm in COMPOSITION_MODULES if pm not in own]:
        missing = unwritten_todo(phase, module, args.impl)
        if missing:
            print(missing if missing.startswith("TODO 4.7") else f"4.7 needs {missing}")
            return 2
    layouts = LAYOUTS[:3] if args.quick else LAYOUTS
    try:
        per_rank = run_world(layout_worker, 4, (args.impl, layouts), {}, timeout=600)
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    table, worst, _ = table_of(per_rank)
    print(f"4.7 ({args.impl}): one step's messages on 4 ranks, against the cost table\n")
    print(table.to_markdown())
    goal = verdict.Goal("calls and bytes off the formulas, every axis, every rank", 0,
                        at_least=False, unit="")  # fmt: skip
    print()
    print(goal.verdict(worst))
    return 0 if goal.met(worst) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
