"""What 3.3's namers know (issue 49; tests/mistake_tables.py runs these tables).

``hierarchical_all_reduce``: tests/phase3/grade_3_3_hierarchical.py runs it on simulated nodes
(2x2, 2x3 and 3x2: the node count and the ranks per node differ in two of them), on 600 and
601 float32 elements, and ``layout_problems`` says what each rank's result and bytes show,
naming a mistake only when exactly one it knows gives every rank's bytes inside and across
nodes. Each mistake is planted here by simulating the ranks' tensors and every message of the
three steps on the topology's groups (written apart from the grader's ``hierarchical_sends``);
every mistake one factor away from a named one is planted as its neighbour.

* ring_verdict describes, names no cause beyond its evidence: after the hierarchical all-reduce
  failed, 3.1's flat ring is run on the same world; it says whether that ring fails there too
  (then 3.1 is to be fixed first) or works (then it lists the causes that fit: a step on another
  group, the middle step on another tensor).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).parent),) if p not in sys.path]

import torch  # noqa: E402
from grade_3_3_hierarchical import (  # noqa: E402
    HIERARCHICAL_MISTAKES,
    SIMULATED_LAYOUTS,
    SIMULATED_NUMELS,
    layout_problems,
)
from mistake_tables import KnownMistake, NamerTable  # noqa: E402

Params = dict[str, Any]
Message = tuple[int, int, str, int]  # (from, to, group name, bytes)


class Ring:
    """The ring functions of 3.1 on a list of global ranks, acting on every member's tensor at
    once and noting every message (chunks as torch.tensor_split cuts them)."""

    def __init__(self, members: list[int], name: str, log: list[Message]) -> None:
        self.members, self.name, self.log = members, name, log

    def _cut(self, numel: int) -> list[tuple[int, int]]:
        bounds, start = [], 0
        for piece in torch.tensor_split(torch.arange(numel), len(self.members)):
            bounds.append((start, start + piece.numel()))
            start += piece.numel()
        return bounds

    def _send(self, place: int, nbytes: int) -> None:
        m = len(self.members)
        self.log.append((self.members[place], self.members[(place + 1) % m], self.name, nbytes))

    def reduce_scatter(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """In place: member i's chunk i becomes the members' sum; returns the chunks (views)."""
        m, bounds = len(self.members), self._cut(next(iter(tensors.values())).numel())
        for step in range(m - 1):
            for place in range(m):
                lo, hi = bounds[(place - 1 - step) % m]
                self._send(place, (hi - lo) * 4)
        total = torch.stack([tensors[r] for r in self.members]).sum(0)
        out = {}
        for place, r in enumerate(self.members):
            lo, hi = bounds[place]
            tensors[r][lo:hi] = total[lo:hi]  # the other chunks keep what they held
            out[r] = tensors[r][lo:hi]
        return out

    def all_gather(self, chunks: dict[int, torch.Tensor], outs: dict[int, torch.Tensor]) -> None:
        m, bounds = len(self.members), self._cut(next(iter(outs.values())).numel())
        for step in range(m - 1):
            for place in range(m):
                lo, hi = bounds[(place - step) % m]
                self._send(place, (hi - lo) * 4)
        for place, r in enumerate(self.members):
            lo, hi = bounds[place]
            for other in self.members:
                outs[other][lo:hi] = chunks[r]

    def all_reduce(self, tensors: dict[int, torch.Tensor]) -> None:
        chunks = self.reduce_scatter(tensors)
        self.all_gather({r: c.clone() for r, c in chunks.items()}, tensors)


def simulate(nodes: int, k: int, numel: int, params: Params) -> list[dict[str, Any]]:
    """Every rank's result dict (as check_hierarchical returns it) for a hierarchical
    all-reduce written with ``params``."""
    n = nodes * k
    data = {r: torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(100 + r))
            .double() for r in range(n)}  # fmt: skip
    total = torch.stack(list(data.values())).sum(0)
    node_sum = {r: torch.stack([data[(r // k) * k + i] for i in range(k)]).sum(0) for r in range(n)}
    intra = {r: [(r // k) * k + i for i in range(k)] for r in range(n)}
    inter = {r: [node * k + r % k for node in range(nodes)] for r in range(n)}
    log: list[Message] = []
    mine = {r: data[r].clone() for r in range(n)}
    if params["algorithm"] == "flat ring":
        Ring(list(range(n)), "world", log).all_reduce(mine)
    else:
        first, middle = (intra, inter) if params["groups"] == "right" else (inter, intra)
        names = ("intra_node", "inter_node") if params["groups"] == "right" else (
            "inter_node", "intra_node")  # fmt: skip
        chunks: dict[int, torch.Tensor] = {}
        for r in range(n):
            if r == first[r][0]:
                sub = {m: mine[m] for m in first[r]}
                chunks.update(Ring(first[r], names[0], log).reduce_scatter(sub))
        if params["step 2 on"] != "skipped":
            target = chunks if params["step 2 on"] == "chunk" else mine
            for r in range(n):
                if r == middle[r][0]:
                    Ring(middle[r], names[1], log).all_reduce({m: target[m] for m in middle[r]})
        if params["step 3"] == "all-gather":
            for r in range(n):
                if r == first[r][0]:
                    Ring(first[r], names[0], log).all_gather(
                        {m: chunks[m].clone() for m in first[r]}, {m: mine[m] for m in first[r]}
                    )
    flat_log: list[Message] = []
    Ring(list(range(n)), "world", flat_log).all_reduce({r: data[r].clone() for r in range(n)})
    results = []
    for r in range(n):

        def by_node(messages: list[Message], r: int = r) -> dict[str, int]:
            out = {"intra_node": 0, "inter_node": 0}
            for src, dst, _, nbytes in messages:
                if src == r:
                    out["intra_node" if dst // k == r // k else "inter_node"] += nbytes
            return out

        per_group = {"intra_node": 0, "inter_node": 0, "other": 0}
        for src, _, group, nbytes in log:
            if src == r:
                per_group[group if group in per_group else "other"] += nbytes
        pieces = zip(torch.tensor_split(mine[r], k), torch.tensor_split(total, k), strict=True)
        results.append({
            "rank": r, "node": r // k, "local_rank": r % k, "nodes": nodes, "per_node": k,
            "nbytes": numel * 4,
            "equal": bool(torch.equal(mine[r], total)),
            "node_sum_only": bool(torch.equal(mine[r], node_sum[r])) and nodes > 1,
            "wrong_chunks": [i for i, (a, b) in enumerate(pieces) if not torch.equal(a, b)],
            "ring_equal": True,
            "hierarchical": by_node(log), "per_group": per_group, "flat_ring": by_node(flat_log),
            "collectives": [],
        })  # fmt: skip
    return results


def measured(params: Params) -> dict[str, list[dict[str, Any]]]:
    """What the grader measures: every rank's results on both sizes, per simulated layout."""
    return {
        f"{nodes}x{k}": [r for numel in SIMULATED_NUMELS for r in simulate(nodes, k, numel, params)]
        for nodes, k in SIMULATED_LAYOUTS
    }


def _failure(problems: list[str], header: str, limit: int = 6) -> str:
    """As first_problems words a failure."""
    unique = list(dict.fromkeys(problems))
    more = f"\n  ... and {len(unique) - limit} more" if len(unique) > limit else ""
    return header + "\n  " + "\n  ".join(unique[:limit]) + more


def name(measurement: dict[str, list[dict[str, Any]]]) -> str | None:
    """What the learner reads: the failures of the three layout tests, in their order."""
    said = [
        _failure(problems, f"3.3 hierarchical_all_reduce on {layout}:")
        for layout, results in measurement.items()
        if (problems := layout_problems(results, layout))
    ]
    return "\n".join(said) or None


FACTORS: dict[str, Sequence[Any]] = {
    "algorithm": ("three steps", "flat ring"),
    "groups": ("right", "swapped"),
    "step 2 on": ("chunk", "tensor", "skipped"),
    "step 3": ("all-gather", "skipped"),
}
RIGHT: Params = {factor: values[0] for factor, values in FACTORS.items()}
PLANTED: dict[str, Params] = {
    "skip all-reduce": {"step 2 on": "skipped"},
    "skip all-gather": {"step 3": "skipped"},
    "groups swapped": {"groups": "swapped"},
    "whole tensor across": {"step 2 on": "tensor"},
    "flat ring": {"algorithm": "flat ring"},
}
SEPARATED_BY = {
    "skip all-reduce": "2x2",
    "skip all-gather": "2x2",
    "groups swapped": "2x2",  # crosses as much as the whole tensor; its bytes inside differ
    "whole tensor across": "2x2",
    "flat ring": "2x2",
}


def _neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**RIGHT, **PLANTED[key]}
    out = []
    for factor, values in FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                out.append((", ".join(f"{f}={v}" for f, v in params.items()), measured(params)))
    return out


HIERARCHICAL = NamerTable(
    exercise="3.3",
    function="hierarchical_all_reduce",
    factors=tuple(FACTORS),
    cases=tuple(f"{nodes}x{k}" for nodes, k in SIMULATED_LAYOUTS),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            SEPARATED_BY[key],
            HIERARCHICAL_MISTAKES[key],
        )
        for key, change in PLANTED.items()
    ),
    right=lambda: measured(RIGHT),
    plant=lambda key: measured({**RIGHT, **PLANTED[key]}),
    name=name,
    neighbours=_neighbours,
)

TABLES = (HIERARCHICAL,)
