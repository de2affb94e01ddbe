"""Exercise 3.8, expert parallelism: ``uv run pytest tests/test_phase3.py -m ex3_8``.

Everything is compared with one process that holds every expert and sees every rank's tokens
(``solutions/phase3_multi_node/references/moe.py``: a plain loop over tokens), in float64:

* in this process, the three decisions of part 1 on their own: ``route`` (the k most probable
  experts, weights renormalized), ``keep_within_capacity`` (first come first served over the whole
  group, in rank then token order) and ``load_balancing_loss`` (Switch Transformer's, with k
  choices per token); the usual mistakes are named;
* one world per expert-parallel size (ep = 2 with 4 experts, ep = 4 with 8), tokens per rank
  uneven, k = 1 and 2, capacity factors that drop choices and one that drops none: every rank's
  routing, kept choices, output, load-balancing loss and gradients (tokens, router, its experts);
  every ``all_to_all_single``'s splits checked against the peers' before it runs; the bytes each
  rank sends equal to the formula (counts, then only the kept rows, there and back, forward and
  backward);
* worlds where an expert, or a whole rank's experts, receive no token;
* ep = 2 x dp = 2 on 4 ranks: after ``sync_moe_gradients`` every gradient is that of the mean of
  the four ranks' losses, the router's reduced over every rank, each expert's over its dp group.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import Counter
from typing import Any

import pytest
import torch
from grading import exercise, impl, step_aside_unless_mine, world
from learner_calls import at_learner_call
from moe_helpers import (
    CASE_2D,
    CASES,
    ELEMENT,
    HIDDEN,
    LAYOUT_DP,
    LAYOUT_EP,
    TOLERANCE,
    Case,
    CaseRun,
    Reference,
    Run2D,
    case_model,
    case_tokens,
    max_diff,
    reference,
    reference_2d,
    routing_module,
    run_2d,
    run_cases,
    sends_between,
)
from phase3_helpers import fail, first_problems

from course.world import WorldHung
from phase3_multi_node.moe_experts import MoEConfig, check_moe_config

_RUNS: dict[Any, Any] = {}
EP_SIZES = [2, 4]

HANG_ADVICE = (
    "The ranks hung. In expert parallelism the usual causes are a collective that only some "
    "ranks call (a rank with no kept choice that skips the all-to-all: every rank must take "
    "part, with zero rows if need be), or one called on another group than the layer's "
    "expert-parallel group. Where each rank stood:\n"
)


# The test that grades each function of the learner's: when the ranks of a shared world raise
# in one of them, that test reports the error and the other tests of the world step aside.
ROUTING = "test_routing_and_kept_choices_match_one_process"
OUTPUTS = "test_outputs_and_load_balancing_loss_match_one_process"
AVERAGED = "test_2d_layout_gradients_are_averaged_on_the_right_groups"
EP_OWNERS = {
    "route": ROUTING,
    "keep_within_capacity": ROUTING,
    "load_balancing_loss": OUTPUTS,
    "dispatch": OUTPUTS,
    "combine": OUTPUTS,
}
LAYOUT_OWNERS = {"sync_moe_gradients": AVERAGED}
LEARNER_FILES = {"moe_routing.py", "expert_parallel.py"}  # solutions/ or template_<name>


def cached(key: Any, start: Any, owners: dict[str, str] | None = None) -> Any:
    """One world per key, shared by the tests below. A failure is re-raised by the test that
    grades the function it came from (``owners``); the world's other tests step aside."""
    if key not in _RUNS:
        try:
            _RUNS[key] = start()
        except WorldHung as exc:
            exc.args = (f"3.8 expert parallelism ({key}): {HANG_ADVICE}{exc}",)
            _RUNS[key] = exc
        except BaseException as exc:
            at_learner_call(exc, "3.8")
            _RUNS[key] = exc
    result = _RUNS[key]
    if isinstance(result, BaseException):
        step_aside_unless_mine(result, owners or {}, LEARNER_FILES)
        raise result
    return result


def ep_runs(ep: int) -> list[list[CaseRun]]:
    """runs[rank][case]."""
    return cached(("ep", ep), lambda: world(run_cases, ep, ep), EP_OWNERS)


def references(ep: int) -> list[Reference]:
    return cached(("reference", ep), lambda: [reference(case) for case in CASES[ep]])


# ----------------------------------------------------------------------------- what went wrong


def route_problem(got: Any, logits: torch.Tensor, k: int, gradient: bool = True) -> str | None:
    """What is wrong with ``route(logits, k)``'s result, or None (``gradient``: also check
    that weights and probs carry one)."""
    if not isinstance(got, tuple) or len(got) != 3:
        return f"returned {type(got).__name__}; expected a Routing(experts, weights, probs)"
    experts, weights, probs = got
    tokens, num_experts = logits.shape
    want_probs = torch.softmax(logits, dim=-1)
    top, want_experts = want_probs.topk(k, dim=-1)
    want_weights = top / top.sum(-1, keepdim=True)
    for name, tensor, shape in (
        ("experts", experts, (tokens, k)),
        ("weights", weights, (tokens, k)),
        ("probs", probs, (tokens, num_experts)),
    ):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            have = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            return f"{name} has shape {have}; expected {shape}"
    if max_diff(probs, want_probs) > TOLERANCE:
        sums = probs.detach().sum(-1)
        if max_diff(probs, logits) <= TOLERANCE:
            return "probs are the logits themselves: take the softmax over the experts"
        return (
            f"probs differ from the softmax of the logits over the experts by "
            f"{max_diff(probs, want_probs):.2e} (its rows sum to {sums[:3].tolist()}...; each "
            "row must be a distribution over the experts: softmax along the last dimension)"
        )
    if experts.dtype != torch.long:
        return f"experts has dtype {experts.dtype}; expected int64 expert indices"
    if not torch.equal(experts, want_experts):
        if torch.equal(experts.sort(-1).values, want_experts.sort(-1).values):
            return order_words(experts, want_experts)
        lowest = want_probs.topk(k, dim=-1, largest=False).indices
        if torch.equal(experts, lowest):
            return "experts are the k LEAST probable: the router keeps the most probable ones"
        return (
            f"expected experts {want_experts[:3].tolist()}... (the k most probable, most probable "
            f"first), got {experts[:3].tolist()}..."
        )
    if max_diff(weights, want_weights) > TOLERANCE:
        if max_diff(weights, top) <= TOLERANCE:
            return (
                "weights are the raw probabilities of the chosen experts: they were not "
                "renormalized after top-k. Each token's k weights must sum to 1 (rescale the "
                f"chosen probabilities by their total); sums seen: "
                f"{[round(float(s), 4) for s in weights.detach().sum(-1)[:4]]}"
            )
        sums = [round(float(x), 4) for x in weights.detach().sum(-1)[:4]]
        ratio = weights.detach() / want_weights.detach()
        same = bool((ratio - ratio[0, 0]).abs().max() <= 1e-9)
        return (
            f"weights {weights.detach()[:2].tolist()}... differ from the chosen probabilities "
            f"rescaled to sum to 1 per token, {want_weights.detach()[:2].tolist()}...; each "
            f"token's weights sum to {sums}..., not 1"
            + (f", every weight {float(ratio[0, 0]):.4g} times the right one" if same else "")
        )
    if gradient and (not weights.requires_grad or not probs.requires_grad):
        which = (
            "neither weights nor probs carry a gradient"
            if not weights.requires_grad and not probs.requires_grad
            else f"{'weights' if not weights.requires_grad else 'probs'} carry no gradient"
        )
        return (
            f"{which}: the router learns through them, so compute them from the logits "
            "without detaching (only the expert indices need no gradient)"
        )
    return None


def order_words(experts: torch.Tensor, want: torch.Tensor) -> str:
    """Each token has the right k experts in another order: which order they came in."""
    seen = f"(expected {want[:2].tolist()}..., got {experts[:2].tolist()}...)"
    fix = "order the k choices by decreasing probability, as topk returns them"
    if torch.equal(experts, want.flip(-1)):
        return f"each token's experts are ordered least probable first {seen}: {fix}"
    if torch.equal(experts, want.sort(-1).values):
        return f"each token's experts are in increasing expert index {seen}: {fix}"
    return f"each token has the right experts but not most probable first {seen}: {fix}"


def expected_keep(
    choices: list[torch.Tensor], num_experts: int, capacity: int
) -> list[torch.Tensor]:
    """First come first served over the group, rank then token order."""
    taken = [0] * num_experts
    out = []
    for experts in choices:
        keep = torch.zeros(experts.shape, dtype=torch.bool)
        for t in range(experts.shape[0]):
            for j in range(experts.shape[1]):
                e = int(experts[t, j])
                keep[t, j] = taken[e] < capacity
                taken[e] += int(keep[t, j])
        out.append(keep)
    return out


def keep_variants(
    choices: list[torch.Tensor], rank: int, num_experts: int, capacity: int
) -> dict[str, torch.Tensor]:
    """The masks the usual mistakes give for ``rank``, named by the mistake."""
    per_rank = expected_keep([choices[rank]], num_experts, capacity)[0]
    reversed_tokens = [c.flip(0) for c in choices]
    last_first = expected_keep(reversed_tokens, num_experts, capacity)[rank].flip(0)
    later_ranks_first = expected_keep(choices[::-1], num_experts, capacity)[::-1][rank]
    return {
        "capacity counted per rank: every rank let each expert take `capacity` of its own "
        "choices, as if the ranks before it had sent none. An expert's capacity is shared by "
        "the whole group: start each expert's queue at the choices of the ranks before this one "
        "(the census rows above this rank)": per_rank,
        "the LAST choices were kept: the queue runs in token order, token 0 first": last_first,
        "later ranks were served first: the queue runs in group-rank order, rank 0 first": (
            later_ranks_first
        ),
        "one choice too many per expert: keep a choice when fewer than `capacity` choices are "
        "ahead of it (place < capacity, counting places from 0)": expected_keep(
            choices, num_experts, capacity + 1
        )[rank],
        "the queue ran choice by choice (every token's first choice before any token's second): "
        "it runs token by token, each token's k choices together, as the (T, k) choices read "
        "row by row": expected_keep([c.t() for c in choices], num_experts, capacity)[rank].t(),
        "the queue ran choice by choice (the (T, k) choices read column by column, every "
        "token's first choice before any second), and its verdicts were put back row by row: "
        "the queue runs token by token, each token's k choices together, as the (T, k) "
        "choices read row by row (flatten them as they are)": expected_keep(
            [c.t() for c in choices], num_experts, capacity
        )[rank].reshape(choices[rank].shape),
        "this rank's own choices were counted among those ahead of it: the queue in front of "
        "this rank holds the census rows of the ranks before it (rows 0 .. rank-1), not its own "
        "row": expected_keep([*choices[: rank + 1], choices[rank]], num_experts, capacity)[-1],
    }


def keep_problems(
    masks: list[Any], choices: list[torch.Tensor], num_experts: int, capacity: int
) -> list[str]:
    """What is wrong with every rank's kept choices, ``masks[r]`` from group rank r: one named
    mistake when a single one explains every rank's masks, else each wrong rank's masks."""
    want = expected_keep(choices, num_experts, capacity)
    problems = []
    for rank, (got, mask) in enumerate(zip(masks, want, strict=True)):
        if not isinstance(got, torch.Tensor) or got.shape != mask.shape or got.dtype != torch.bool:
            have = (tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else type(got)
            problems.append(
                f"rank {rank}: returned {have}; expected a bool tensor of shape {tuple(mask.shape)}"
            )
    if problems:
        return problems
    wrong = [
        r
        for r, (got, mask) in enumerate(zip(masks, want, strict=True))
        if not torch.equal(got.cpu(), mask)
    ]
    if not wrong:
        return []
    variants = [keep_variants(choices, r, num_experts, capacity) for r in range(len(masks))]
    fits = [
        why
        for why in variants[0]
        if all(torch.equal(masks[r].cpu(), variants[r][why]) for r in range(len(masks)))
    ]
    if len(fits) == 1:
        return [f"ranks {wrong}: {fits[0]}"]
    if fits:  # these choices cannot tell the mistakes apart: name each that fits
        return [
            f"ranks {wrong}: one of {len(fits)} mistakes that give these masks: "
            + "; or ".join(fits)
        ]
    return [
        f"rank {r}: kept {masks[r].int().tolist()}; expected {want[r].int().tolist()} (each "
        "expert accepts the group's choices first come first served: rank 0's before rank "
        "1's, and within a rank token 0's before token 1's, until it holds `capacity`)"
        for r in wrong
    ]


def aux_variants(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> dict[str, float]:
    counts = torch.bincount(experts.flatten(), minlength=num_experts).double()
    tokens, k = experts.shape
    mean_p = probs.detach().mean(0)
    first = torch.bincount(experts[:, 0], minlength=num_experts).double() / tokens
    return {
        f"the fraction divides by the number of tokens ({tokens}), not by the number of "
        f"choices (tokens x k = {tokens * k}): f_e must be a fraction of all choices, summing "
        "to 1": float(num_experts * (counts / tokens * mean_p).sum()),
        "the fraction counts only each token's first choice (Switch's k = 1 form): with k "
        "choices per token, count all of them": float(num_experts * (first * mean_p).sum()),
        "the factor num_experts is missing (the loss is 1 for an even router, whatever the "
        "number of experts)": float((counts / (tokens * k) * mean_p).sum()),
        "both factors are mean probabilities: f_e is the fraction of the choices (a count), "
        "P_e the mean probability": float(num_experts * (mean_p * mean_p).sum()),
        "the loss is averaged over the experts instead of summed and scaled by num_experts": float(
            (counts / (tokens * k) * mean_p).mean()
        ),
    }


def aux_problem(
    got: Any, probs: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> str | None:
    """What is wrong with ``load_balancing_loss(probs, experts, num_experts)``'s result ``got``
    (None: nothing): its value, then its gradient with respect to ``probs``."""
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return f"returned {type(got).__name__}; expected a scalar tensor"
    grad: torch.Tensor | None = None
    if probs.requires_grad and got.requires_grad:
        (grad,) = torch.autograd.grad(got, probs, retain_graph=True)
    return aux_verdict(float(got.detach()), grad, probs, experts, num_experts)


def aux_verdict(
    value: float,
    grad: torch.Tensor | None,
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
) -> str | None:
    """The words for a loss of ``value`` whose gradient with respect to ``probs`` is ``grad``
    (None: the loss carries none; only judged when ``probs`` requires one)."""
    tokens, k = experts.shape
    counts = torch.bincount(experts.flatten(), minlength=num_experts).double()
    want = float(num_experts * (counts / (tokens * k) * probs.detach().mean(0)).sum())
    if not math.isclose(value, want, rel_tol=1e-10, abs_tol=1e-12):
        fits = [
            why
            for why, variant in aux_variants(probs, experts, num_experts).items()
            if math.isclose(value, variant, rel_tol=1e-10, abs_tol=1e-12)
        ]
        if len(fits) == 1:
            return f"{value:.6f} instead of {want:.6f}: {fits[0]}"
        ratio = f"{value / want:.6g} times the right value" if want else "the right value is 0"
        if fits:
            return (
                f"{value:.6f} instead of {want:.6f} ({ratio}); on these {tokens} tokens, "
                f"k={k}, one of {len(fits)} mistakes: " + "; or ".join(fits)
            )
        return (
            f"{value:.6f} instead of {want:.6f} ({ratio}; {tokens} tokens, k={k}, "
            f"{num_experts} experts): no usual mistake of the fraction f_e (a count of the "
            f"T x k = {tokens * k} choices), the mean probability P_e (over the {tokens} "
            "tokens) or the factor num_experts gives this value"
        )
    if probs.requires_grad:
        if grad is None:
            return "the loss carries no gradient: the router learns through the mean probabilities"
        want_grad = (num_experts * counts / (tokens * k) / tokens).expand(tokens, -1)
        if max_diff(grad, want_grad) > 1e-10:
            return (
                "its gradient with respect to probs is not num_experts x f_e / T: the fraction "
                "must be a constant (a count) and the probabilities averaged over the tokens"
            )
    return None


def aux_inputs() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(probs requiring a gradient, each token's top-k experts, num_experts) of every graded
    load-balancing case (AUX_CASES)."""
    g = torch.Generator().manual_seed(17)
    out = []
    for tokens, num_experts, k in AUX_CASES:
        logits = torch.randn(tokens, num_experts, generator=g, dtype=torch.float64) * 2
        probs = torch.softmax(logits, -1).requires_grad_()
        out.append((probs, probs.detach().topk(k, dim=-1).indices, num_experts))
    return out


def aux_message(
    got: Any, probs: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> str | None:
    """The failure of one load-balancing case (None: right)."""
    problem = aux_problem(got, probs, experts, num_experts)
    tokens, k = experts.shape
    return (
        f"3.8 load_balancing_loss({tokens} tokens, {num_experts} experts, k={k}): {problem}"
        if problem
        else None
    )


# ----------------------------------------------------------------------------- part 1, alone


# (tokens, num_experts, k): k, the expert count and the token count pairwise different in the
# first, so that a mistake off by one of them does not pass for a mistake off by another
ROUTE_CASES = ((6, 4, 2), (6, 4, 1), (5, 8, 3), (3, 4, 4))
# (tokens per rank, num_experts, k, capacity): the first has k != E != group size (3)
KEEP_CASES = (
    ([6, 7, 5], 4, 2, 6),
    ([6, 7, 5], 4, 1, 3),
    ([9, 4], 3, 2, 5),
    ([3, 3, 3, 3], 4, 2, 20),
    ([5, 6], 4, 2, 0),
)
AUX_CASES = ((7, 4, 2), (9, 4, 1), (6, 8, 3))  # (tokens, num_experts, k)


def route_inputs() -> list[tuple[torch.Tensor, int]]:
    """The logits (requiring a gradient) and k of every graded route case."""
    g = torch.Generator().manual_seed(5)
    out = []
    for tokens, num_experts, k in ROUTE_CASES:
        logits = torch.randn(tokens, num_experts, generator=g, dtype=torch.float64)
        out.append((logits.requires_grad_(), k))
    return out


def route_message(got: Any, logits: torch.Tensor, k: int) -> str | None:
    """The failure of one route case (None: right)."""
    problem = route_problem(got, logits, k)
    tokens, num_experts = logits.shape
    return (
        f"3.8 route(logits of {tokens} tokens x {num_experts} experts, k={k}): {problem}"
        if problem
        else None
    )


@exercise("3.8")
def test_route_keeps_the_k_most_probable_experts_with_weights_summing_to_one() -> None:
    routing = routing_module()
    for logits, k in route_inputs():
        got = routing.route(logits, k)
        problem = route_message(got, logits, k)
        if problem:
            fail(problem)


def group_choices(
    g: torch.Generator, tokens: list[int], num_experts: int, k: int
) -> list[torch.Tensor]:
    return [
        torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
        for t in tokens
    ]


def keep_inputs() -> list[list[torch.Tensor]]:
    """Every rank's (T, k) choices of every graded capacity case."""
    g = torch.Generator().manual_seed(11)
    return [group_choices(g, tokens, e, k) for tokens, e, k, _ in KEEP_CASES]


def keep_header(tokens: list[int], num_experts: int, k: int, capacity: int, census: Any) -> str:
    return (
        f"3.8 keep_within_capacity for each rank of a group of {len(tokens)} with "
        f"{tokens} tokens, k={k}, {num_experts} experts, capacity {capacity} (census "
        f"{census.tolist()}):"
    )


@exercise("3.8")
def test_capacity_keeps_each_experts_first_choices_over_the_whole_group() -> None:
    routing = routing_module()
    for (tokens, num_experts, k, capacity), choices in zip(KEEP_CASES, keep_inputs(), strict=True):
        census = torch.stack([torch.bincount(c.flatten(), minlength=num_experts) for c in choices])
        masks = [
            routing.keep_within_capacity(choices[rank].clone(), census.clone(), rank, capacity)
            for rank in range(len(tokens))
        ]
        problems = keep_problems(masks, choices, num_experts, capacity)
        if not problems:
            again = [
                routing.keep_within_capacity(choices[rank], census, rank, capacity)
                for rank in range(len(tokens))
            ]
            if not all(torch.equal(a, b) for a, b in zip(again, masks, strict=True)):
                problems = [
                    "two calls with the same choices kept different ones: the rule must be "
                    "deterministic (every rank decides alone and the decisions must fit)"
                ]
        if problems:
            first_problems(problems, keep_header(tokens, num_experts, k, capacity, census))


@exercise("3.8")
def test_load_balancing_loss_is_switch_transformers_with_k_choices() -> None:
    routing = routing_module()
    for probs, experts, num_experts in aux_inputs():
        got = routing.load_balancing_loss(probs, experts, num_experts)
        problem = aux_message(got, probs, experts, num_experts)
        if problem:
            fail(problem)
    even = torch.full((4, 4), 0.25, dtype=torch.float64)
    spread = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    value = float(routing.load_balancing_loss(even, spread, 4))
    if not math.isclose(value, 1.0, rel_tol=1e-12):
        fail(f"3.8 load_balancing_loss of a perfectly even router is {value}; expected 1.0")


# ----------------------------------------------------------------------------- the worlds


def _header(case: Case) -> str:
    return f"{case.label} (tokens per rank {list(case.tokens)}):"


def routing_problems(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
    problems = []
    dense = case_model(case)
    for rank, (run, want) in enumerate(zip(runs, ref.ranks, strict=True)):
        assert run.experts is not None and run.weights is not None
        if (
            not torch.equal(run.experts, want.experts_tensor)
            or max_diff(run.weights, want.weights.detach()) > TOLERANCE
        ):
            logits = dense.router(case_tokens(case, rank)).detach()
            got = (run.experts, run.weights, run.probs)
            named = route_problem(got, logits, case.k, gradient=False)
            problems.append(f"rank {rank}: routing: {named or 'differs from one process'}")
    if problems:
        return problems
    choices = [r.experts_tensor for r in ref.ranks]
    return [
        f"kept choices (capacity {ref.capacity}): {why}"
        for why in keep_problems(
            [run.keep for run in runs], choices, case.num_experts, ref.capacity
        )
    ]


def output_variants(case: Case, ref: Reference, rank: int) -> dict[str, torch.Tensor]:
    """The outputs the usual combine mistakes give, named by the mistake."""
    dense = case_model(case)
    x = case_tokens(case, rank)
    want = ref.ranks[rank]
    tokens, k = len(want.experts), case.k
    weights = want.weights.detach()
    with torch.no_grad():
        outs = [
            [dense.experts[e](x[t : t + 1])[0] for e in row] for t, row in enumerate(want.experts)
        ]
        raw = torch.stack([want.probs[t, row].detach() for t, row in enumerate(want.experts)])

    def mix(w: torch.Tensor, every: bool = False) -> torch.Tensor:
        rows = [
            sum(
                (w[t, j] * outs[t][j] for j in range(k) if every or want.keep[t][j]),
                torch.zeros(HIDDEN, dtype=torch.float64),
            )
            for t in range(tokens)
        ]
        return torch.stack(rows)

    kept = [(t, j) for t in range(tokens) for j in range(k) if want.keep[t][j]]
    sent = sorted(kept, key=lambda tj: want.experts[tj[0]][tj[1]])  # stable: token order
    slots = torch.zeros(tokens * k, HIDDEN, dtype=torch.float64)
    for i, (t, j) in enumerate(sent):
        slots[i] = outs[t][j]
    unordered = (slots.view(tokens, k, HIDDEN) * weights.unsqueeze(-1)).sum(1)
    return {
        "the outputs sit in the order the rows travelled (sorted by expert), not in token "
        "order: combine must put each returned row back at its own (token, choice) place (the "
        "plan's order) before weighting": unordered,
        "dropped choices were mixed in: a dropped choice adds nothing to its token": mix(
            weights, every=True
        ),
        "the outputs are not weighted: multiply each choice's output by its weight, then sum "
        "the token's choices": mix(torch.ones_like(weights)),
        "the weights are the raw top-k probabilities: renormalize them after top-k": mix(raw),
    }


def delivered_problem(case: Case, ref: Reference, runs: list[CaseRun], rank: int) -> str | None:
    """What is wrong with the rows dispatch delivered to ``rank``'s experts (None: nothing):
    grouped by sender, rank 0 first, and within a sender by expert, each expert's rows in token
    order; one row per kept choice, the row of its token."""
    per_rank = case.num_experts // case.ep
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    tokens = [case_tokens(case, s) for s in range(case.ep)]
    want_ids = [
        (s, t)
        for s in range(case.ep)
        for e in mine
        for t, (row, keep) in enumerate(zip(ref.ranks[s].experts, ref.ranks[s].keep, strict=True))
        if any(chosen == e and kept for chosen, kept in zip(row, keep, strict=True))
    ]
    got = runs[rank].received
    if got is None:
        return None
    want = (
        torch.stack([tokens[s][t] for s, t in want_ids])
        if want_ids
        else torch.zeros(0, HIDDEN, dtype=torch.float64)
    )
    if got.shape == want.shape and max_diff(got, want) <= TOLERANCE:
        return None

    def whose(row: torch.Tensor) -> str:
        for s in range(case.ep):
            for t in range(tokens[s].shape[0]):
                if max_diff(row, tokens[s][t]) <= TOLERANCE:
                    return f"{s}:{t}"
        return "?"

    got_ids = [whose(row) for row in got]
    want_names = [f"{s}:{t}" for s, t in want_ids]
    if len(got_ids) != len(want_names):
        return (
            f"rank {rank}'s experts were handed {len(got_ids)} rows; expected {len(want_names)}, "
            "one per kept choice of any rank that names one of its experts"
        )
    if sorted(got_ids) == sorted(want_names):
        return (
            f"rank {rank}'s experts were handed the right rows in the wrong order (rank:token "
            f"{got_ids}; expected {want_names}): rows go out sorted by expert, each expert's "
            "in token order (a stable sort), so each sender's block arrives grouped by expert"
        )
    return (
        f"dispatch handed rank {rank}'s experts the rows of (rank:token) {got_ids}; expected "
        f"{want_names}: each kept choice sends its token's row (choice i of the (T, k) "
        "choices read row by row belongs to token i // k), to the rank of its expert"
    )


def output_problems(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
    problems = []
    for rank, (run, want) in enumerate(zip(runs, ref.ranks, strict=True)):
        assert run.output is not None and run.aux is not None
        expected = want.output.detach()
        diff = max_diff(run.output, expected)
        if diff > TOLERANCE:
            if run.output.shape != expected.shape:
                problems.append(
                    f"rank {rank}: the output has shape {tuple(run.output.shape)}; expected "
                    f"{tuple(expected.shape)}, one row per token of this rank"
                )
                continue
            named = [
                why
                for why, variant in output_variants(case, ref, rank).items()
                if max_diff(run.output, variant) <= TOLERANCE
            ]
            bad = (run.output - expected).abs().amax(-1).gt(TOLERANCE).nonzero().flatten().tolist()
            if not named:
                wrong_rows = next(
                    (
                        found
                        for other in sorted(range(case.ep), key=lambda r: r != rank)
                        if (found := delivered_problem(case, ref, runs, other))
                    ),
                    None,
                )
                named = [wrong_rows] if wrong_rows else []
            problems.append(
                f"rank {rank}: tokens {bad} differ from one process by up to {diff:.3e}; "
                + (
                    named[0]
                    if named
                    else "the routing and the kept choices matched one process, so look at the "
                    "rows dispatch sends, the splits, or where combine puts the rows back"
                )
            )
        aux = float(run.aux)
        if not math.isclose(aux, float(want.aux_loss.detach()), rel_tol=1e-10, abs_tol=1e-12):
            assert run.probs is not None
            why = aux_problem(run.aux, run.probs, want.experts_tensor, case.num_experts)
            problems.append(f"rank {rank}: load-balancing loss {why}")
    return problems


def gradient_problems(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
    problems = []
    for rank, run in enumerate(runs):
        router_named = False
        if run.router_grad is None:
            problems.append(f"rank {rank}: the router got no gradient")
        elif (diff := max_diff(run.router_grad, ref.router_grads[rank])) > TOLERANCE:
            router_named = max_diff(run.router_grad, ref.router_aux_grads[rank]) <= TOLERANCE
            why = (
                "only the load-balancing loss reached the router: the weights combine uses "
                "must stay differentiable (do not detach them)"
                if router_named
                else "(the router's gradient of this rank's own loss: its weights and the "
                "load-balancing loss)"
            )
            problems.append(
                f"rank {rank}: the router's gradient differs from one process's by {diff:.3e}; "
                + why
            )
        experts_right = True
        for expert, grads in run.expert_grads.items():
            missing = [name for name, grad in grads.items() if grad is None]
            if missing:
                experts_right = False
                problems.append(
                    f"rank {rank}: expert {expert}'s {missing} got no gradient: the expert "
                    "outputs must travel back through the given all_to_all (differentiable) "
                    "and be used by the output"
                )
                continue
            for name, grad in grads.items():
                want = ref.expert_grads[expert][name]
                assert grad is not None
                if (diff := max_diff(grad, want)) > TOLERANCE:
                    experts_right = False
                    problems.append(
                        f"rank {rank}: expert {expert}'s {name} gradient differs from one "
                        f"process's by {diff:.3e} (it must sum the gradients of every rank's "
                        "tokens that chose it: the backward of the all-to-alls brings them)"
                    )
                    break
        if router_named:
            continue  # the tokens' gradient goes through the router too: named above
        if run.x_grad is None:
            problems.append(
                f"rank {rank}: the tokens got no gradient: the rows dispatch sends must stay "
                "connected to autograd (select them from the tokens and move them with the "
                "given all_to_all, which is differentiable)"
            )
        elif (diff := max_diff(run.x_grad, ref.x_grads[rank])) > TOLERANCE:
            why = (
                "the outputs and the experts' gradients are right, so the path from the "
                "experts' inputs back to the tokens is cut: select the rows from `tokens` "
                "(nothing detached) and move them with the given all_to_all, whose backward "
                "returns each row's gradient to the rank it came from"
                if experts_right
                else "it comes back through combine's and dispatch's all-to-alls, reversed"
            )
            problems.append(
                f"rank {rank}: the tokens' gradient differs from one process's by {diff:.3e}; "
                + why
            )
    return problems


def check_cases(ep: int, idle: bool | None, check: Any, what: str) -> None:
    """Run ``check`` on the cases of ep (those with idle experts, those without, or all for
    None) whose routing matched one process; a routing mismatch is reported instead."""
    runs = ep_runs(ep)
    refs = references(ep)
    chosen = [i for i, case in enumerate(CASES[ep]) if idle is None or bool(case.idle) == idle]
    messages = []
    for i in chosen:
        case = CASES[ep][i]
        per_rank = [runs[rank][i] for rank in range(ep)]
        problems = routing_problems(case, refs[i], per_rank)
        if not problems and check is not routing_problems:
            problems = check(case, refs[i], per_rank)
        if problems:
            messages.append(_header(case) + "\n    " + "\n    ".join(problems[:4]))
    first_problems(messages, f"3.8 expert parallelism, ep={ep}: {what} against one process")


@exercise("3.8")
@pytest.mark.parametrize("ep", EP_SIZES, ids=[f"ep{ep}" for ep in EP_SIZES])
def test_routing_and_kept_choices_match_one_process(ep: int) -> None:
    check_cases(ep, False, routing_problems, "routing and kept choices")


@exercise("3.8")
@pytest.mark.parametrize("ep", EP_SIZES, ids=[f"ep{ep}" for ep in EP_SIZES])
def test_outputs_and_load_balancing_loss_match_one_process(ep: int) -> None:
    check_cases(ep, False, output_problems, "outputs and load-balancing loss")


@exercise("3.8")
@pytest.mark.parametrize("ep", EP_SIZES, ids=[f"ep{ep}" for ep in EP_SIZES])
def test_gradients_match_one_process(ep: int) -> None:
    def both(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
        return output_problems(case, ref, runs) or gradient_problems(case, ref, runs)

    check_cases(ep, False, both, "gradients (tokens, router, experts)")


@exercise("3.8")
@pytest.mark.parametrize("ep", EP_SIZES, ids=[f"ep{ep}" for ep in EP_SIZES])
def test_experts_that_receive_no_token(ep: int) -> None:
    def everything(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
        problems = output_problems(case, ref, runs) or gradient_problems(case, ref, runs)
        unused = set(range(case.num_experts)) - {
            e for rank in ref.ranks for row in rank.experts for e in row
        }
        for rank, run in enumerate(runs):
            for expert in sorted(unused):
                grads = run.expert_grads.get(expert)
                if grads and any(g is not None and bool(g.any()) for g in grads.values()):
                    problems.append(
                        f"rank {rank}: expert {expert} received no token but has a non-zero "
                        "gradient"
                    )
        return problems

    check_cases(ep, True, everything, "outputs and gradients when some experts get no token")


BYTES_PARTS = ("the counts", "dispatch", "combine")
DROPPED_TRAVELLED = "dropped choices travelled: a choice its expert does not keep is never sent"


def forward_bytes_words(
    got: list[list[int] | None],
    want: list[list[int]],
    every_routed: list[list[int]],
    row_bytes: int,
) -> dict[int, str]:
    """Per rank whose forward all-to-alls sent other bytes than ``want`` (counts, dispatch,
    combine), what differs. The cause is named only when every rank of the case sent exactly
    the bytes of every routed choice, kept or dropped; otherwise each wrong part is described:
    its bytes, the rows they make, how many rows were expected, and whether they are the rows
    of every routed choice (``got[r]`` None: that rank's calls are reported otherwise)."""
    wrong = [r for r, g in enumerate(got) if g is not None and g != want[r]]
    named = all(g == every_routed[r] for r, g in enumerate(got) if g is not None)
    words = {}
    for r in wrong:
        mine = got[r]
        assert mine is not None
        if named:
            words[r] = DROPPED_TRAVELLED
            continue
        parts = []
        for part, g, w, a in zip(BYTES_PARTS, mine, want[r], every_routed[r], strict=True):
            if g == w:
                continue
            if part == "the counts":
                parts.append(
                    f"the counts are {g} bytes, " + (f"{g / w:.4g} times {w}" if w else "not 0")
                )
                continue
            say = f"{part} sent {g} bytes ({g / row_bytes:g} rows), expected {w // row_bytes} rows"
            if g == a:
                say += f" ({a // row_bytes} is the number of every routed choice, kept or not)"
            parts.append(say)
        words[r] = "; ".join(parts) + " (the other parts match)"
    return words


def bytes_problems(case: Case, ref: Reference, runs: list[CaseRun]) -> list[str]:
    problems = []
    rows = sends_between(case, ref)
    routed = sends_between(case, ref, kept_only=False)
    row_bytes = HIDDEN * ELEMENT
    per_rank = case.num_experts // case.ep
    counts_bytes = (case.ep - 1) * per_rank * 8

    def sent(table: list[list[int]], rank: int) -> list[int]:
        out_rows = sum(n for d, n in enumerate(table[rank]) if d != rank)
        in_rows = sum(table[s][rank] for s in range(case.ep) if s != rank)
        return [counts_bytes, out_rows * row_bytes, in_rows * row_bytes]

    forward_words = forward_bytes_words(
        [[c.bytes_to_others for c in run.forward_a2a] if len(run.forward_a2a) == 3 else None
         for run in runs],
        [sent(rows, rank) for rank in range(case.ep)],
        [sent(routed, rank) for rank in range(case.ep)],
        row_bytes,
    )  # fmt: skip
    for rank, run in enumerate(runs):
        out_rows = sum(n for d, n in enumerate(rows[rank]) if d != rank)
        in_rows = sum(rows[s][rank] for s in range(case.ep) if s != rank)
        formula = (
            f"counts (ep-1) x E/ep x 8 = {counts_bytes}, then {out_rows} kept rows to other "
            f"ranks and {in_rows} back, x hidden x 8 = {row_bytes} bytes each"
        )
        fwd, bwd = run.forward_a2a, run.backward_a2a
        if len(fwd) != 3:
            problems.append(
                f"rank {rank}: the forward made {len(fwd)} all_to_all_single calls "
                f"({[c.dtype for c in fwd]}); expected 3: the counts (int64), the rows in "
                "dispatch, the rows back in combine"
            )
            continue
        if rank in forward_words:
            problems.append(
                f"rank {rank}: the forward's all-to-alls sent {[c.bytes_to_others for c in fwd]} "
                f"bytes to other ranks (counts, dispatch, combine); expected "
                f"{sent(rows, rank)}: {formula}; {forward_words[rank]}"
            )
        bwd_bytes = sum(c.bytes_to_others for c in bwd)
        if len(bwd) != 2 or bwd_bytes != (out_rows + in_rows) * row_bytes:
            why = (
                ": one of the forward's row exchanges is outside autograd (its rows were "
                "detached, or moved with dist.all_to_all_single instead of the given "
                "all_to_all), so its gradients never travel back"
                if len(bwd) < 2
                else ""
            )
            problems.append(
                f"rank {rank}: the backward made {len(bwd)} all_to_all_single calls sending "
                f"{bwd_bytes} bytes to other ranks; expected 2 (the reverse of combine's, then "
                f"of dispatch's) sending ({out_rows} + {in_rows}) x {row_bytes} = "
                f"{(out_rows + in_rows) * row_bytes}{why}"
            )
        others_fwd = Counter(op for op, _ in run.forward_ops if op != "all_to_all_single")
        others_bwd = Counter(op for op, _ in run.backward_ops if op != "all_to_all_single")
        if others_fwd != Counter({"all_gather_into_tensor": 1}) or others_bwd:
            problems.append(
                f"rank {rank}: besides the all-to-alls, the forward made {dict(others_fwd)} and "
                f"the backward {dict(others_bwd)}; expected only the census's one "
                "all_gather_into_tensor in the forward"
            )
    return problems


@exercise("3.8")
@pytest.mark.parametrize("ep", EP_SIZES, ids=[f"ep{ep}" for ep in EP_SIZES])
def test_bytes_each_rank_sends_match_the_formula(ep: int) -> None:
    check_cases(ep, None, bytes_problems, "bytes sent per rank, counted")


# ----------------------------------------------------------------------------- ep x dp


def runs_2d() -> list[Run2D]:
    return cached("ep2 x dp2", lambda: world(run_2d, LAYOUT_EP * LAYOUT_DP), LAYOUT_OWNERS)


def _group_name(ranks: tuple[int, ...] | None, run: Run2D) -> str:
    if ranks is None or ranks == tuple(range(LAYOUT_EP * LAYOUT_DP)):
        return "world"
    if ranks == run.ep_ranks:
        return "ep"
    if ranks == run.dp_ranks:
        return "dp"
    return str(ranks)


@exercise("3.8")
def test_2d_layout_the_layer_talks_only_inside_its_expert_parallel_group() -> None:
    runs = runs_2d()
    _, _, outputs = reference_2d()
    problems = []
    for rank, run in enumerate(runs):
        outside = sorted({(op, str(g)) for op, g in run.moe_ops if g != run.ep_ranks})
        if outside:
            problems.append(
                f"rank {rank}: forward and backward called {outside} outside its expert-parallel "
                f"group {run.ep_ranks}: pass the layer's group to every collective"
            )
        assert run.output is not None
        if (diff := max_diff(run.output, outputs[rank])) > TOLERANCE:
            problems.append(
                f"rank {rank}: its output differs by {diff:.3e} from one process running its "
                f"replica's tokens (ranks {run.ep_ranks}, the replica's own capacity)"
            )
    first_problems(problems, f"3.8 {CASE_2D.name}: the MoE layer on the ep groups")


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """s when got == s * want (to 1e-9), else None."""
    norm = float((want * want).sum())
    if norm == 0:
        return None
    s = float((got * want).sum()) / norm
    return s if max_diff(got, s * want) <= 1e-9 * max(1.0, float(want.abs().max())) else None


def ratio_words(what: str, s: float | None, ep: int, dp: int, summed_on: str) -> str:
    """Why ``what`` (after its all-reduce on ``summed_on``) is ``s`` times the right gradient:
    the divisor each fitting mistake used, all of them when several fit (at ep = dp, dividing by
    either group's size gives the same numbers), else the ratio alone."""
    world = ep * dp
    if s is None:
        return (
            f"{what} is not a multiple of the right one (copies of one parameter must end with "
            "the same gradient on every replica: the mean of the world's losses)"
        )
    divisors = {
        "no division at all (the sum)": 1,
        f"the dp group's size ({dp})": dp,
        f"the ep group's size ({ep})": ep,
    }
    fits = [name for name, d in divisors.items() if math.isclose(s, world / d, rel_tol=1e-9)]
    fix = (
        f"after backward and the all-reduce on the {summed_on} it holds the sum over all "
        f"{world} ranks' losses: divide by the world size, {world}"
    )
    if not fits:
        return f"{what} is {s:g} times the right one; {fix}"
    if len(fits) == 1 and fits[0].startswith("no division"):
        return f"{what} is {s:g} times the right one, {fits[0]}: {fix}"
    said = " or by ".join(f for f in fits if not f.startswith("no division"))
    same = " (equal here, so these numbers cannot tell which)" if len(fits) > 1 else ""
    return f"{what} is {s:g} times the right one: it was divided by {said}{same}; {fix}"


def sync_groups_problem(
    by_group: dict[str, int],
    router_bytes: int,
    expert_bytes: int,
    ep_ranks: tuple[int, ...],
    dp_ranks: tuple[int, ...],
) -> str | None:
    """What the bytes ``sync_moe_gradients`` all-reduced on each group (``world``, ``ep``,
    ``dp``, or another collective or group by name) say (None: the router's on the world and
    the experts' on the dp group). Each group's bytes are read as so many router gradients and
    so many expert gradients (the two sizes differ), and each misplaced one is named."""
    want = {"world": router_bytes, "dp": expert_bytes}
    if by_group == want:
        return None
    held: dict[str, tuple[int, int]] = {}  # group: (router copies, expert copies)
    for group, nbytes in by_group.items():
        fits = [
            (r, e)
            for r in range(3)
            for e in range(3)
            if r * router_bytes + e * expert_bytes == nbytes
        ]
        if len(fits) == 1:
            held[group] = fits[0]
    said = (
        f"sync_moe_gradients all-reduced {by_group} bytes by group; expected the router's "
        f"{router_bytes} bytes on the world and the experts' {expert_bytes} on the dp group "
        f"{dp_ranks}"
    )
    if len(held) != len(by_group):
        return said  # some group's bytes are no whole number of either gradient: as seen
    notes = []
    router = {g: r for g, (r, _) in held.items() if r}
    experts = {g: e for g, (_, e) in held.items() if e}
    if "ep" in experts:
        notes.append(
            f"the experts' gradients were all-reduced on the ep group {ep_ranks}: those ranks "
            "hold DIFFERENT experts, whose gradients must never be added together; an expert's "
            "copies sit on its dp group"
        )
    if "world" in experts:
        notes.append(
            "the experts' gradients were all-reduced over every rank: that adds different "
            "experts' gradients together; only the dp group holds copies of the same experts"
        )
    if not experts:
        notes.append(
            f"the experts' gradients were not all-reduced: their copies on the dp group "
            f"{dp_ranks} saw other tokens"
        )
    for group in ("dp", "ep"):
        if group in router:
            ranks = dp_ranks if group == "dp" else ep_ranks
            where = (
                f"also on the {group} group {ranks}, after the world: that sums it again"
                if "world" in router
                else f"on the {group} group {ranks} only"
            )
            notes.append(
                f"the router's gradient was all-reduced {where}: the router is replicated on "
                "every rank and each rank saw other tokens, so its gradient is reduced over the "
                "world, once"
            )
    if not router:
        notes.append("the router's gradient was not all-reduced: reduce it over the world")
    twice = [g for g, n in {**router, **experts}.items() if n > 1]
    if twice:
        notes.append(f"a gradient was all-reduced twice on the {twice[0]} group")
    return said + ("; " + "; ".join(notes) if notes else "")


@exercise("3.8")
def test_2d_layout_gradients_are_averaged_on_the_right_groups() -> None:
    runs = runs_2d()
    router_want, experts_want, outputs = reference_2d()
    world_size = LAYOUT_EP * LAYOUT_DP
    wrong = [
        r
        for r, run in enumerate(runs)
        if run.output is None or max_diff(run.output, outputs[r]) > TOLERANCE
    ]
    if wrong:
        fail(
            f"3.8 {CASE_2D.name}: the outputs of ranks {wrong} differ from one process already "
            "(see the test of the layer on the ep groups, and the ep=2 tests), so no gradient "
            "can match; fix the forward first"
        )
    problems = []
    for rank, run in enumerate(runs):
        if run.router_grad is None or any(
            g is None for grads in run.expert_grads.values() for g in grads.values()
        ):
            problems.append(
                f"rank {rank}: some gradients were missing after backward (see the ep=2 "
                "gradient test), so sync_moe_gradients was not run"
            )
            continue
        by_group: Counter[str] = Counter()
        for op, nbytes, ranks in run.sync_records:
            if op == "all_reduce":
                by_group[_group_name(ranks, run)] += nbytes
            else:
                by_group[f"{op} on {_group_name(ranks, run)}"] += nbytes
        said = sync_groups_problem(
            dict(by_group), run.router_bytes, run.expert_bytes, run.ep_ranks, run.dp_ranks
        )
        if said:
            problems.append(f"rank {rank}: {said}")
            continue
        if (diff := max_diff(run.router_grad, router_want)) > TOLERANCE:
            s = _ratio(run.router_grad, router_want)
            problems.append(
                f"rank {rank}: the router's gradient differs by {diff:.3e} from that of the "
                f"mean of the {world_size} ranks' losses: "
                + ratio_words("the router's gradient", s, LAYOUT_EP, LAYOUT_DP, "world")
            )
        for expert, grads in run.expert_grads.items():
            for name, grad in grads.items():
                want = experts_want[expert][name]
                assert grad is not None
                if (diff := max_diff(grad, want)) <= TOLERANCE:
                    continue
                s = _ratio(grad, want)
                problems.append(
                    f"rank {rank}: expert {expert}'s {name} gradient differs by {diff:.3e} from "
                    f"that of the mean of the {world_size} ranks' losses: "
                    + ratio_words("the expert's gradient", s, LAYOUT_EP, LAYOUT_DP, "dp group")
                )
                break
    first_problems(problems, f"3.8 {CASE_2D.name}: gradients after sync_moe_gradients")


# ----------------------------------------------------------------------------- references


def program(name: str) -> Any:
    return importlib.import_module(f"solutions.phase3_multi_node.{name}")


@exercise("3.8")
@pytest.mark.reference
def test_bad_settings_are_refused_with_their_fix() -> None:
    cases = [
        (MoEConfig(num_experts=6), 4, ("ep=4 does not divide num_experts=6",)),
        (MoEConfig(k=5, num_experts=4), 2, ("k=5 > num_experts=4",)),
        (MoEConfig(capacity_factor=0.0), 2, ("capacity_factor=0.0",)),
        (MoEConfig(capacity_factor=float("inf")), 2, ("capacity_factor=inf",)),
        (MoEConfig(hidden=0, num_experts=3), 2, ("hidden=0", "ep=2 does not divide")),
    ]
    for config, ep, parts in cases:
        with pytest.raises(ValueError) as caught:
            check_moe_config(config, ep)
        for part in parts:
            if part not in str(caught.value):
                fail(
                    f"3.8 check_moe_config({config}, ep={ep}) refused with {str(caught.value)!r}, "
                    f"which does not name {part!r}: a refusal names the bad value and its fix"
                )
    check_moe_config(MoEConfig(), 4)


def after_the_graded_worlds() -> None:
    """The demo and the benchmark run the same layer as the graded worlds above: when one of
    those raised, they step aside instead of repeating it as a raw backend error."""
    failed = [key for key, run in _RUNS.items() if isinstance(run, BaseException)]
    for key in failed:
        if getattr(_RUNS[key], "exc_type", "") == "NotImplementedError":
            raise _RUNS[key]  # an unwritten TODO: reported (as blocked) by the harness
    if failed:
        pytest.skip(
            f"blocked by the failure above: the graded worlds {failed} raised, and this program "
            "runs the same expert_parallel.py"
        )


def demo_worker(impl_name: str) -> dict[str, Any]:
    demo = program("demos.moe")
    config = demo.DemoConfig(ep=2, dp=2, tokens=6, steps=2, impl=impl_name)
    return demo.run_demo(config)


@exercise("3.8")
@pytest.mark.reference
def test_the_demo_matches_one_process_on_an_ep_x_dp_layout() -> None:
    after_the_graded_worlds()
    summary = world(demo_worker, 4, impl())[0]
    if summary["max_diff"] > 1e-5:  # float32
        fail(
            f"3.8 the instructor demo (ep=2 x dp=2, float32, your expert_parallel.py): its output "
            f"differs from one process running every expert by {summary['max_diff']:.3g} (allowed "
            "1e-5); the graded tests above compare in float64 and name the part that is wrong: "
            "make them pass first"
        )
    if len(summary["rows"]) != 4 or len(summary["steps"]) != 2:
        fail(
            f"3.8 the instructor demo (ep=2 x dp=2, 2 steps) reported {len(summary['rows'])} rows "
            f"of its rows-per-rank table and {len(summary['steps'])} steps; expected one row per "
            "rank (4) and one line per step (2)"
        )


@exercise("3.8")
@pytest.mark.reference
def test_the_programs_refuse_bad_settings_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    demo = program("demos.moe")
    with pytest.raises(ValueError, match="ep=2 does not divide num_experts=3"):
        demo.validate(demo.DemoConfig(experts=3), 2)
    with pytest.raises(ValueError, match="does not fill the world of 4"):
        demo.validate(demo.DemoConfig(ep=3, dp=2), 4)
    assert demo.main(["--ep", "2"]) == 2  # a world of one: refused before any process group
    with pytest.raises(SystemExit) as caught:
        demo.main(["--capacity-factor", "0"])
    assert caught.value.code == 2
    bench = program("benchmarks.moe")
    assert bench.main(["--aux-coefs", "x", "--ep", "3"]) == 2
    err = capsys.readouterr().err
    for part in ("--aux-coefs 'x'", "ep=3 does not divide num_experts=8"):
        if part not in err:
            fail(
                "3.8 moe_benchmark --aux-coefs x --ep 3 must refuse both settings before "
                f"starting, naming each; its message does not name {part!r}:\n{err}"
            )


@exercise("3.8")
@pytest.mark.reference
def test_the_benchmark_reports_balance_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    after_the_graded_worlds()
    bench = program("benchmarks.moe")
    args = ["--ep", "2", "--tokens", "16", "--steps", "2", "--aux-coefs", "0,0.1"]
    args += ["--capacity-factors", "1.0", "--a2a-worlds", "2", "--a2a-kib", "4", "--reps", "1"]
    code = bench.main([*args, "--impl", impl()])
    out, err = capsys.readouterr()
    todo = re.search(r"NotImplementedError: (TODO \d+\.\d+: [^\n]*)", err)
    if code == 1 and todo:  # an unwritten TODO in the ranks: reported as such, once
        raise NotImplementedError(todo[1])
    if code != 0:
        fail(
            f"3.8 moe_benchmark (ep=2, your expert_parallel.py) exited with {code}; its ranks "
            f"reported:\n{err.strip()[-2000:]}"
        )
    missing = [title for title in ("balance:", "final:", "cost:") if title not in out]
    rows = out.count("| 0.1 | 1 |")  # two balance rows (steps 0 and 1), one final
    if missing or rows != 3:
        fail(
            f"3.8 moe_benchmark printed {rows} rows for aux coefficient 0.1 (expected 3: two "
            f"balance rows, one final) and lacks the tables {missing}; what it printed:\n{out}"
        )
