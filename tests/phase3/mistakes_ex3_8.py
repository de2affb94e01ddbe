"""What 3.8's namers know (issue 49, tests/mistake_tables.py): per judged function, its realistic
mistakes, the factor each is off by, and the graded case that tells it from the others.

Each mistake is planted the way a learner would write it (a mistaken ``route``, a mistaken
``keep_within_capacity``, a mistaken ``load_balancing_loss``, a mistaken divisor after
``sync_moe_gradients``'s all-reduce), run on the grader's own cases (imported from the grader,
not copied), and named by the very functions the grader words its failures with. Neighbours are
generated from each function's factors: every known mistake with one factor set otherwise.

One merge: at the graded ep2 x dp2 layout, a gradient divided by the dp group's size and one
divided by the ep group's size are the same numbers (dp = ep = 2; a world of 4 cannot hold
ep != dp with both above 1), so each is one row whose words list both divisors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import grade_3_8_expert_parallel as grader
from mistake_tables import KnownMistake, NamerTable, one_factor_away
from moe_helpers import (
    CASE_2D,
    CASES,
    HIDDEN,
    LAYOUT_DP,
    LAYOUT_EP,
    Case,
    CaseRun,
    Reference,
    case_model,
    case_tokens,
    reference,
)
from phase3_helpers import factor_neighbours

from phase3_multi_node.moe_comm import Routing

Settings = dict[str, Any]


def _table(
    function: str,
    factors: Mapping[str, Sequence[Any]],
    right: Settings,
    mistakes: Sequence[tuple[KnownMistake, Settings]],
    cases: tuple[str, ...],
    measure: Callable[[Settings], Any],
    name: Callable[[Any], str | None],
) -> NamerTable:
    """A table whose mistakes are ``right`` with a few factors changed (``mistakes``' settings)."""
    settings = {m.key: {**right, **changed} for m, changed in mistakes}
    return NamerTable(
        exercise="3.8",
        function=function,
        factors=tuple(f"{f}: {', '.join(map(str, vs))}" for f, vs in factors.items()),
        cases=cases,
        mistakes=tuple(m for m, _ in mistakes),
        right=lambda: measure(right),
        plant=lambda key: measure(settings[key]),
        name=name,
        neighbours=lambda key: factor_neighbours(settings[key], right, factors, measure),
    )


# ----------------------------------------------------------------------------- route


ROUTE_CASES = tuple(f"route {t} tokens x {e} experts, k={k}" for t, e, k in grader.ROUTE_CASES)
ROUTE_FACTORS = {
    "probs": ("softmax over experts", "softmax over tokens", "logits", "log_softmax"),
    "pick": ("most probable", "least probable"),
    "order": ("decreasing", "increasing", "expert index"),
    "weights": ("renormalized", "raw", "divided by k", "softmax of the chosen"),
    "detach": ("nothing", "weights", "probs", "both"),
}
ROUTE_RIGHT = {f: vs[0] for f, vs in ROUTE_FACTORS.items()}


def mistaken_route(logits: torch.Tensor, k: int, s: Settings) -> Routing:
    """route as a learner might write it, with the choices of ``s``."""
    probs = {
        "softmax over experts": lambda: torch.softmax(logits, dim=-1),
        "softmax over tokens": lambda: torch.softmax(logits, dim=0),
        "logits": lambda: logits,
        "log_softmax": lambda: torch.log_softmax(logits, dim=-1),
    }[s["probs"]]()
    top, experts = probs.topk(k, dim=-1, largest=s["pick"] == "most probable")
    if s["order"] == "increasing":
        top, experts = top.flip(-1), experts.flip(-1)
    elif s["order"] == "expert index":
        experts, where = experts.sort(-1)
        top = top.gather(-1, where)
    weights = {
        "renormalized": lambda: top / top.sum(-1, keepdim=True),
        "raw": lambda: top,
        "divided by k": lambda: top / k,
        "softmax of the chosen": lambda: torch.softmax(top, dim=-1),
    }[s["weights"]]()
    if s["detach"] in ("weights", "both"):
        weights = weights.detach()
    if s["detach"] in ("probs", "both"):
        probs = probs.detach()
    return Routing(experts, weights, probs)


def measure_route(s: Settings) -> list[dict[str, Any]]:
    """What the grader sees of each case: the three tensors and which carry a gradient."""
    out = []
    for logits, k in grader.route_inputs():
        got = mistaken_route(logits, k, s)
        out.append({
            "experts": got.experts.detach(),
            "weights": got.weights.detach(),
            "probs": got.probs.detach(),
            "gradient": (got.weights.requires_grad, got.probs.requires_grad),
        })  # fmt: skip
    return out


def name_route(measured: list[dict[str, Any]]) -> str | None:
    """The grader's words: its first failing case (route_message, as the test calls it)."""
    for (logits, k), m in zip(grader.route_inputs(), measured, strict=True):
        w_grad, p_grad = m["gradient"]
        got = Routing(
            m["experts"],
            m["weights"].clone().requires_grad_(w_grad),
            m["probs"].clone().requires_grad_(p_grad),
        )
        message = grader.route_message(got, logits, k)
        if message:
            return message
    return None


def _m(key: str, off_by: str, separated_by: str, says: str) -> KnownMistake:
    return KnownMistake(key, off_by, separated_by, says)


ROUTE = _table(
    "route",
    ROUTE_FACTORS,
    ROUTE_RIGHT,
    [
        (_m("probs_are_logits", "probs: the logits", ROUTE_CASES[0],
            "probs are the logits themselves"), {"probs": "logits"}),
        (_m("least_probable", "pick: the k least probable", ROUTE_CASES[0],
            "experts are the k LEAST probable"), {"pick": "least probable"}),
        (_m("increasing_order", "order: increasing probability", ROUTE_CASES[0],
            "ordered least probable first"), {"order": "increasing"}),
        (_m("index_order", "order: expert index", ROUTE_CASES[0],
            "in increasing expert index"), {"order": "expert index"}),
        (_m("not_renormalized", "weights: raw top-k probabilities", ROUTE_CASES[0],
            "they were not renormalized after top-k"), {"weights": "raw"}),
        (_m("weights_detached", "gradient: weights detached", ROUTE_CASES[0],
            "weights carry no gradient"), {"detach": "weights"}),
        (_m("probs_detached", "gradient: probs detached", ROUTE_CASES[0],
            "probs carry no gradient"), {"detach": "probs"}),
        (_m("both_detached", "gradient: weights and probs detached", ROUTE_CASES[0],
            "neither weights nor probs carry a gradient"), {"detach": "both"}),
    ],
    ROUTE_CASES,
    measure_route,
    name_route,
)  # fmt: skip


# ----------------------------------------------------------------------------- keep_within_capacity


KEEP_CASES = tuple(
    f"keep {tokens} tokens, {e} experts, k={k}, capacity {c}"
    for tokens, e, k, c in grader.KEEP_CASES
)
KEEP_FACTORS = {
    "ahead": ("ranks before", "none", "ranks before and this one", "ranks after"),
    "tokens": ("first first", "last first"),
    "reading": ("row by row", "column by column", "column by column, put back row by row"),
    "threshold": ("place < capacity", "place <= capacity", "place < capacity - 1"),
}
KEEP_RIGHT = {f: vs[0] for f, vs in KEEP_FACTORS.items()}


def mistaken_keep(
    experts: torch.Tensor, census: torch.Tensor, rank: int, capacity: int, s: Settings
) -> torch.Tensor:
    """keep_within_capacity as a learner might write it: a queue per expert, started at the
    choices ``s["ahead"]`` counts, run in the order ``s`` reads the (T, k) choices."""
    tokens, k = experts.shape
    ahead = {
        "ranks before": census[:rank].sum(0),
        "none": torch.zeros_like(census[0]),
        "ranks before and this one": census[: rank + 1].sum(0),
        "ranks after": census[rank + 1 :].sum(0),
    }[s["ahead"]].clone()
    if s["reading"] == "row by row":
        order = [(t, j) for t in range(tokens) for j in range(k)]
    else:
        order = [(t, j) for j in range(k) for t in range(tokens)]
    if s["tokens"] == "last first":
        order = order[::-1]
    limit = {"place < capacity": capacity, "place <= capacity": capacity + 1,
             "place < capacity - 1": capacity - 1}[s["threshold"]]  # fmt: skip
    verdicts = []
    for t, j in order:
        e = int(experts[t, j])
        verdicts.append(bool(ahead[e] < limit))
        ahead[e] += int(verdicts[-1])
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    if s["reading"] == "column by column, put back row by row":
        keep.view(-1)[:] = torch.tensor(
            verdicts if s["tokens"] == "first first" else verdicts[::-1]
        )
        return keep
    for (t, j), v in zip(order, verdicts, strict=True):
        keep[t, j] = v
    return keep


def _census(choices: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    return torch.stack([torch.bincount(c.flatten(), minlength=num_experts) for c in choices])


def measure_keep(s: Settings) -> list[list[torch.Tensor]]:
    out = []
    for (_, e, _, capacity), choices in zip(grader.KEEP_CASES, grader.keep_inputs(), strict=True):
        census = _census(choices, e)
        out.append([mistaken_keep(c, census, r, capacity, s) for r, c in enumerate(choices)])
    return out


def name_keep(measured: list[list[torch.Tensor]]) -> str | None:
    cases = zip(grader.KEEP_CASES, grader.keep_inputs(), measured, strict=True)
    for (tokens, e, k, capacity), choices, masks in cases:
        problems = grader.keep_problems(masks, choices, e, capacity)
        if problems:
            header = grader.keep_header(tokens, e, k, capacity, _census(choices, e))
            return header + "\n  " + "\n  ".join(list(dict.fromkeys(problems))[:6])
    return None


KEEP = _table(
    "keep_within_capacity",
    KEEP_FACTORS,
    KEEP_RIGHT,
    [
        (_m("per_rank", "ahead: no earlier rank counted", KEEP_CASES[0],
            "capacity counted per rank"), {"ahead": "none"}),
        (_m("own_row_counted", "ahead: this rank's row too", KEEP_CASES[0],
            "this rank's own choices were counted among those ahead"),
         {"ahead": "ranks before and this one"}),
        (_m("later_ranks_first", "ahead: the ranks after", KEEP_CASES[0],
            "later ranks were served first"), {"ahead": "ranks after"}),
        (_m("last_tokens_first", "token order reversed", KEEP_CASES[0],
            "the LAST choices were kept"), {"tokens": "last first"}),
        (_m("one_too_many", "threshold: one place more", KEEP_CASES[0],
            "one choice too many per expert"), {"threshold": "place <= capacity"}),
        (_m("column_order", "reading: column by column", KEEP_CASES[0],
            "the queue ran choice by choice (every token's first choice before any token's "
            "second)"), {"reading": "column by column"}),
        (_m("column_order_put_back_by_row", "reading: column by column, put back by row",
            KEEP_CASES[0], "its verdicts were put back row by row"),
         {"reading": "column by column, put back row by row"}),
    ],
    KEEP_CASES,
    measure_keep,
    name_keep,
)  # fmt: skip


# ----------------------------------------------------------------------------- load_balancing_loss


AUX_CASES = tuple(f"aux {t} tokens, {e} experts, k={k}" for t, e, k in grader.AUX_CASES)
AUX_FACTORS = {
    "fraction": ("all choices / (T x k)", "all choices / T", "first choices / T",
                 "mean probabilities", "all choices / k"),
    "factor": ("num_experts", "none", "mean over experts"),
    "P": ("mean over tokens", "sum over tokens"),
    "gradient": ("through P", "detached"),
}  # fmt: skip
AUX_RIGHT = {f: vs[0] for f, vs in AUX_FACTORS.items()}


def mistaken_aux(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, s: Settings
) -> torch.Tensor:
    """load_balancing_loss as a learner might write it."""
    tokens, k = experts.shape
    counts = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype)
    first = torch.bincount(experts[:, 0], minlength=num_experts).to(probs.dtype)
    p = probs.detach() if s["gradient"] == "detached" else probs
    fraction = {
        "all choices / (T x k)": lambda: counts / (tokens * k),
        "all choices / T": lambda: counts / tokens,
        "first choices / T": lambda: first / tokens,
        "mean probabilities": lambda: p.mean(0),
        "all choices / k": lambda: counts / k,
    }[s["fraction"]]()
    mean_p = p.mean(0) if s["P"] == "mean over tokens" else p.sum(0)
    terms = fraction * mean_p
    return {
        "num_experts": lambda: num_experts * terms.sum(),
        "none": lambda: terms.sum(),
        "mean over experts": lambda: terms.mean(),
    }[s["factor"]]()


EVEN = (
    torch.full((4, 4), 0.25, dtype=torch.float64),
    torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]),
)


def measure_aux(s: Settings) -> list[dict[str, Any]]:
    out = []
    for probs, experts, num_experts in grader.aux_inputs():
        loss = mistaken_aux(probs, experts, num_experts, s)
        grad = torch.autograd.grad(loss, probs)[0] if loss.requires_grad else None
        out.append({"value": float(loss.detach()), "grad": grad})
    out.append({"even": float(mistaken_aux(*EVEN, 4, s))})
    return out


def name_aux(measured: list[dict[str, Any]]) -> str | None:
    for (probs, experts, num_experts), m in zip(grader.aux_inputs(), measured[:-1], strict=True):
        problem = grader.aux_verdict(m["value"], m["grad"], probs, experts, num_experts)
        if problem:
            tokens, k = experts.shape
            return (
                f"3.8 load_balancing_loss({tokens} tokens, {num_experts} experts, k={k}): {problem}"
            )
    even = measured[-1]["even"]
    if abs(even - 1.0) > 1e-12:
        return f"3.8 load_balancing_loss of a perfectly even router is {even}; expected 1.0"
    return None


AUX = _table(
    "load_balancing_loss",
    AUX_FACTORS,
    AUX_RIGHT,
    [
        (_m("fraction_of_tokens", "a factor k: divided by T, not T x k", AUX_CASES[0],
            "the fraction divides by the number of tokens"), {"fraction": "all choices / T"}),
        (_m("first_choice_only", "k: only each token's first choice", AUX_CASES[0],
            "the fraction counts only each token's first choice"),
         {"fraction": "first choices / T"}),
        (_m("no_num_experts", "a factor num_experts missing", AUX_CASES[0],
            "the factor num_experts is missing"), {"factor": "none"}),
        (_m("mean_over_experts", "num_experts squared: averaged over the experts",
            AUX_CASES[0], "the loss is averaged over the experts"),
         {"factor": "mean over experts"}),
        (_m("both_mean_probs", "f: mean probabilities, not a count", AUX_CASES[0],
            "both factors are mean probabilities"), {"fraction": "mean probabilities"}),
        (_m("detached", "gradient: P detached", AUX_CASES[0],
            "the loss carries no gradient"), {"gradient": "detached"}),
    ],
    AUX_CASES,
    measure_aux,
    name_aux,
)  # fmt: skip


# ----------------------------------------------------------------------------- sync_moe_gradients


LAYOUT_2D = f"ep{LAYOUT_EP} x dp{LAYOUT_DP}"
WORLD = LAYOUT_EP * LAYOUT_DP
SYNC_FACTORS = {
    "router divisor": ("world", "none", "dp", "ep", "world squared"),
    "expert divisor": ("world", "none", "dp", "ep", "world squared"),
}
SYNC_RIGHT = {f: vs[0] for f, vs in SYNC_FACTORS.items()}
DIVISOR = {"world": WORLD, "none": 1, "dp": LAYOUT_DP, "ep": LAYOUT_EP, "world squared": WORLD**2}


def measure_sync(s: Settings) -> dict[str, float]:
    """The ratio of each gradient to the right one: the router's all-reduce on the world and an
    expert's on its dp group both leave the sum over all ranks' losses, then divided by the
    divisor ``s`` names (the right one: the world size)."""
    return {
        "router": WORLD / DIVISOR[s["router divisor"]],
        "expert": WORLD / DIVISOR[s["expert divisor"]],
    }


def name_sync(measured: dict[str, float]) -> str | None:
    """rank 0's problems as the grader words them: the router first, then an expert."""
    said = []
    if abs(measured["router"] - 1) > 1e-12:
        said.append(grader.ratio_words("the router's gradient", measured["router"],
                                       LAYOUT_EP, LAYOUT_DP, "world"))  # fmt: skip
    if abs(measured["expert"] - 1) > 1e-12:
        said.append(grader.ratio_words("the expert's gradient", measured["expert"],
                                       LAYOUT_EP, LAYOUT_DP, "dp group"))  # fmt: skip
    return "; ".join(said) or None


BOTH = f"the dp group's size ({LAYOUT_DP}) or by the ep group's size ({LAYOUT_EP})"
SYNC = _table(
    "sync_moe_gradients",
    SYNC_FACTORS,
    SYNC_RIGHT,
    [
        (_m("router_summed", "a factor world: not divided", LAYOUT_2D,
            f"the router's gradient is {WORLD:g} times the right one, no division"),
         {"router divisor": "none"}),
        (_m("router_by_a_group", "dp or ep for the world (equal at ep2 x dp2: one row)",
            LAYOUT_2D, f"the router's gradient is {WORLD // LAYOUT_DP:g} times the right one: "
            f"it was divided by {BOTH}"), {"router divisor": "dp"}),
        (_m("expert_summed", "a factor world: not divided", LAYOUT_2D,
            f"the expert's gradient is {WORLD:g} times the right one, no division"),
         {"expert divisor": "none"}),
        (_m("expert_by_a_group", "dp or ep for the world (equal at ep2 x dp2: one row)",
            LAYOUT_2D, f"the expert's gradient is {WORLD // LAYOUT_DP:g} times the right one: "
            f"it was divided by {BOTH}"), {"expert divisor": "dp"}),
    ],
    (LAYOUT_2D,),
    measure_sync,
    name_sync,
)  # fmt: skip

# ----------------------------------------------------------------------------- combine


COMBINE_CASES_RUN = [case for ep in grader.EP_SIZES for case in CASES[ep] if not case.idle]
COMBINE_CASES = tuple(case.label for case in COMBINE_CASES_RUN)
COMBINE_FACTORS = {
    "placement": ("the plan's order", "the order the rows travelled"),
    "dropped choices": ("left out", "mixed in"),
    "weights": ("Routing.weights", "none", "the raw top-k probabilities"),
}
COMBINE_RIGHT = {f: vs[0] for f, vs in COMBINE_FACTORS.items()}


@cache
def _reference(index: int) -> Reference:
    return reference(COMBINE_CASES_RUN[index])


def mistaken_combine(case: Case, ref: Reference, rank: int, s: Settings) -> torch.Tensor:
    """combine's output on ``rank`` as a learner's mistaken combine would leave it, from the
    one-process routing (the experts applied to this rank's tokens directly)."""
    dense = case_model(case)
    x = case_tokens(case, rank)
    want = ref.ranks[rank]
    tokens, k = len(want.experts), case.k
    with torch.no_grad():
        outs = [
            [dense.experts[e](x[t : t + 1])[0] for e in row] for t, row in enumerate(want.experts)
        ]
        weights = {
            "Routing.weights": want.weights.detach(),
            "none": torch.ones(tokens, k, dtype=torch.float64),
            "the raw top-k probabilities": torch.stack(
                [want.probs[t, row].detach() for t, row in enumerate(want.experts)]
            ),
        }[s["weights"]]
    kept = [
        (t, j) for t in range(tokens) for j in range(k)
        if want.keep[t][j] or s["dropped choices"] == "mixed in"
    ]  # fmt: skip
    slots = torch.zeros(tokens, k, HIDDEN, dtype=torch.float64)
    if s["placement"] == "the plan's order":
        for t, j in kept:
            slots[t, j] = outs[t][j]
    else:  # the rows as they came back (by expert, each expert's in token order), laid row-major
        travelled = sorted(kept, key=lambda tj: want.experts[tj[0]][tj[1]])
        flat = slots.view(tokens * k, HIDDEN)
        for i, (t, j) in enumerate(travelled):
            flat[i] = outs[t][j]
    return (slots * weights.unsqueeze(-1)).sum(1)


def measure_combine(s: Settings) -> dict[str, list[torch.Tensor]]:
    return {
        case.label: [mistaken_combine(case, _reference(i), r, s) for r in range(case.ep)]
        for i, case in enumerate(COMBINE_CASES_RUN)
    }


def name_combine(measured: dict[str, list[torch.Tensor]]) -> str | None:
    """The outputs test's words (output_problems) on the first case whose outputs differ."""
    for i, case in enumerate(COMBINE_CASES_RUN):
        ref = _reference(i)
        runs = [
            CaseRun(output=out, aux=want.aux_loss.detach(), probs=want.probs.detach())
            for out, want in zip(measured[case.label], ref.ranks, strict=True)
        ]
        problems = grader.output_problems(case, ref, runs)
        if problems:
            return grader._header(case) + "\n    " + "\n    ".join(problems[:4])
    return None


COMBINE = _table(
    "combine",
    COMBINE_FACTORS,
    COMBINE_RIGHT,
    [
        (_m("travel_order", "placement: the rows' travel order", COMBINE_CASES[0],
            "the outputs sit in the order the rows travelled"),
         {"placement": "the order the rows travelled"}),
        (_m("dropped_mixed_in", "dropped choices: mixed in", COMBINE_CASES[0],
            "dropped choices were mixed in"), {"dropped choices": "mixed in"}),
        (_m("unweighted", "weights: none (a factor of 1/weight)", COMBINE_CASES[1],
            "the outputs are not weighted"), {"weights": "none"}),
        (_m("raw_weights", "weights: the raw top-k probabilities", COMBINE_CASES[0],
            "the weights are the raw top-k probabilities"),
         {"weights": "the raw top-k probabilities"}),
    ],
    COMBINE_CASES,
    measure_combine,
    name_combine,
)  # fmt: skip

# ----------------------------------------------------------------------------- sync's groups


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


_DENSE_2D = case_model(CASE_2D)
ROUTER_BYTES = _bytes(_DENSE_2D.router)
EXPERT_BYTES = sum(_bytes(e) for e in _DENSE_2D.experts) // LAYOUT_EP  # one rank's experts
EP_RANKS, DP_RANKS = (0, 1), (0, 2)  # rank 0's groups at ep2 x dp2 (ep fastest)
GROUPS_FACTORS = {
    "router on": ("world", "dp", "ep", "nothing", "world twice", "world, then dp"),
    "experts on": ("dp", "ep", "world", "nothing", "dp twice"),
}
GROUPS_RIGHT = {f: vs[0] for f, vs in GROUPS_FACTORS.items()}


def measure_groups(s: Settings) -> dict[str, int]:
    """The bytes rank 0's sync_moe_gradients all-reduces on each of its groups."""
    out: dict[str, int] = {}
    router = {"world": ["world"], "dp": ["dp"], "ep": ["ep"], "nothing": [],
              "world twice": ["world", "world"], "world, then dp": ["world", "dp"]}  # fmt: skip
    experts = {"dp": ["dp"], "ep": ["ep"], "world": ["world"], "nothing": [],
               "dp twice": ["dp", "dp"]}  # fmt: skip
    for group in router[s["router on"]]:
        out[group] = out.get(group, 0) + ROUTER_BYTES
    for group in experts[s["experts on"]]:
        out[group] = out.get(group, 0) + EXPERT_BYTES
    return out


def name_groups(measured: dict[str, int]) -> str | None:
    return grader.sync_groups_problem(measured, ROUTER_BYTES, EXPERT_BYTES, EP_RANKS, DP_RANKS)


GROUPS = _table(
    "sync_moe_gradients (groups)",
    GROUPS_FACTORS,
    GROUPS_RIGHT,
    [
        (_m("experts_on_ep", "the group: ep for dp", LAYOUT_2D,
            "the experts' gradients were all-reduced on the ep group"), {"experts on": "ep"}),
        (_m("experts_on_world", "the group: the world for dp", LAYOUT_2D,
            "the experts' gradients were all-reduced over every rank"), {"experts on": "world"}),
        (_m("experts_not_reduced", "no group", LAYOUT_2D,
            "the experts' gradients were not all-reduced"), {"experts on": "nothing"}),
        (_m("router_on_dp", "the group: dp for the world", LAYOUT_2D,
            "the router's gradient was all-reduced on the dp group"), {"router on": "dp"}),
        (_m("router_on_ep", "the group: ep for the world", LAYOUT_2D,
            "the router's gradient was all-reduced on the ep group"), {"router on": "ep"}),
        (_m("router_not_reduced", "no group", LAYOUT_2D,
            "the router's gradient was not all-reduced"), {"router on": "nothing"}),
        (_m("router_reduced_again", "the world, then dp again", LAYOUT_2D,
            "the router's gradient was all-reduced also on the dp group"),
         {"router on": "world, then dp"}),
    ],
    (LAYOUT_2D,),
    measure_groups,
    name_groups,
)  # fmt: skip

# ----------------------------------------------------------------------------- bytes sent

BYTES_CASES_RUN = [case for ep in grader.EP_SIZES for case in CASES[ep]]  # idle ones too
BYTES_CASES = tuple(case.label for case in BYTES_CASES_RUN)
BYTES_FACTORS = {
    "dispatch sends": ("kept choices", "every routed choice"),
    "combine returns": ("kept choices", "every routed choice"),
    "counts": ("int64 per expert", "int32 per expert", "int64 per rank"),
}
BYTES_RIGHT = {f: vs[0] for f, vs in BYTES_FACTORS.items()}
ROW_BYTES = HIDDEN * 8  # float64 rows


@cache
def _bytes_reference(index: int) -> Reference:
    return reference(BYTES_CASES_RUN[index])


def _rows_to(case: Case, ref: Reference, kept_only: bool) -> list[list[int]]:
    """rows[r][d]: the choices rank r's tokens route to rank d's experts (kept ones, or all),
    counted here apart from the grader's sends_between."""
    per = case.num_experts // case.ep
    rows = [[0] * case.ep for _ in range(case.ep)]
    for r, rank in enumerate(ref.ranks):
        for t, row in enumerate(rank.experts):
            for j, e in enumerate(row):
                if not kept_only or bool(rank.keep[t][j]):
                    rows[r][int(e) // per] += 1
    return rows


def measure_bytes(s: Settings) -> dict[str, list[list[int]]]:
    """Per case, per rank: the bytes the forward's three all-to-alls send to other ranks
    (counts, dispatch, combine), as a learner's choices ``s`` make them."""
    out = {}
    for i, case in enumerate(BYTES_CASES_RUN):
        ref = _bytes_reference(i)
        out_rows = _rows_to(case, ref, s["dispatch sends"] == "kept choices")
        back_rows = _rows_to(case, ref, s["combine returns"] == "kept choices")
        per_count = {"int64 per expert": case.num_experts // case.ep * 8,
                     "int32 per expert": case.num_experts // case.ep * 4,
                     "int64 per rank": 8}[s["counts"]]  # fmt: skip
        out[case.label] = [
            [
                (case.ep - 1) * per_count,
                sum(n for d, n in enumerate(out_rows[r]) if d != r) * ROW_BYTES,
                sum(back_rows[src][r] for src in range(case.ep) if src != r) * ROW_BYTES,
            ]
            for r in range(case.ep)
        ]
    return out


def name_bytes(measured: dict[str, list[list[int]]]) -> str | None:
    """The bytes test's words (forward_bytes_words) on the first case whose bytes differ."""
    want, routed = measure_bytes(BYTES_RIGHT), measure_bytes(
        {**BYTES_RIGHT, "dispatch sends": "every routed choice",
         "combine returns": "every routed choice"}
    )  # fmt: skip
    for case in BYTES_CASES_RUN:
        got = measured[case.label]
        words = grader.forward_bytes_words(
            list(got), want[case.label], routed[case.label], ROW_BYTES
        )
        if words:
            return (
                grader._header(case)
                + "\n    "
                + "\n    ".join(
                    f"rank {r}: sent {got[r]}, expected {want[case.label][r]}: {w}"
                    for r, w in words.items()
                )
            )
    return None


_BYTES_PLANTED = {"dispatch sends": "every routed choice", "combine returns": "every routed choice"}
BYTES = _table(
    "dispatch and combine (bytes sent)",
    BYTES_FACTORS,
    BYTES_RIGHT,
    [
        (_m("dropped_travelled", "dispatch and combine: every routed choice, not the kept ones",
            next(c.label for i, c in enumerate(BYTES_CASES_RUN)
                 if _rows_to(c, _bytes_reference(i), True) != _rows_to(c, _bytes_reference(i), False)),
            "dropped choices travelled"), _BYTES_PLANTED),
    ],
    BYTES_CASES,
    measure_bytes,
    name_bytes,
)  # fmt: skip
# every factor of the mistake set to each other value, its right ones too (dispatch alone or
# combine alone sending dropped choices, the counts' dtype or size): factor_neighbours varies
# only the factors a mistake got wrong, and each of those has one wrong value here
BYTES = replace(
    BYTES,
    neighbours=lambda key: one_factor_away(
        _BYTES_PLANTED, [_BYTES_PLANTED], BYTES_RIGHT, BYTES_FACTORS,
        lambda changed: measure_bytes({**BYTES_RIGHT, **changed}),
    ),
)  # fmt: skip

TABLES = (ROUTE, KEEP, AUX, SYNC, COMBINE, GROUPS, BYTES)
