"""Exercise 3.6, gradient clipping across shards: ``uv run pytest tests/test_phase3.py -m ex3_6``.

One process computes the gradients of 3.6's stack of 4 MLP blocks (float64) and clips them with
``torch.nn.utils.clip_grad_norm_(max_norm = half the norm)``, for every kind of norm the API
takes: p = 2, inf, 3, 1, 1.5 and 0.5. In one world of 4 ranks, every rank then holds the pieces
of the same gradients a sharded model holds, with their placement (``GradShard.replicated_on``),
and calls your ``clip_grad_norm_``:

* 3D layouts (dp, tp, pp) = (2, 2, 1), (1, 2, 2), (2, 1, 2): fc1 rows and fc2 columns per tp
  rank, fc2's bias whole on every tp rank, a stage's blocks per pp rank, everything the same on
  every dp rank;
* the same with context parallelism, (dp, cp, tp, pp) = (1, 2, 2, 1) (4.7's cp2 x tp2, the
  weights replicated on ``"dp_cp"``) and (1, 2, 1, 2) (replicated on ``"dp"`` and ``"cp"``);
* ZeRO-2/3 gradient slices on dp = 4, on dp = 2 x pp = 2, and over dp = 2 x cp = 2: each rank's
  slice of every layer's flat, padded gradient.

Checked: the norm every rank returns equals one process's (1e-12 relative), and every rank's
gradients afterwards equal its pieces of one process's clipped gradients. A wrong norm is
matched against the classic mistakes, simulated on the same pieces: the local norm only, a
group (pp, tp, dp, cp) not reduced, copies (tp, dp, cp) counted several times, the inf-norm
summed or signed, the power or the root hard-coded to 2, the root missing or taken per rank, the
absolute value missing; it is named when only one fits, and the ones that fit are listed when
several do. The norm types the API refuses (0, -1, -inf, nan: torch takes them) must raise
ValueError. ``counted_here`` is also tried alone on every rank of a (dp, cp, tp, pp) =
(2, 2, 2, 2) grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from clip_helpers import (
    LAYOUTS,
    NORMS,
    REFUSED,
    TOLERANCE,
    Layout,
    clip_worker,
    close,
    dense_grads,
    evidence,
    named_mistakes,
    norm_name,
    pieces,
    raised_where,
    torch_clip,
)
from grading import defined_at, exercise, load
from learner_calls import at_learner_call
from phase3_helpers import fail, first_problems, small_world

from course.topology import RankGrid, Topology
from phase3_multi_node.clip_placement import GradShard

PHASE = "phase3_multi_node"
_RUNS: list[list[dict[str, Any]]] | BaseException | None = None
AXIS_GROUPS = {"dp": ("dp",), "cp": ("cp",), "tp": ("tp",), "dp_cp": ("dp", "cp")}


def runs() -> list[list[dict[str, Any]]]:
    """Per rank, the results of every layout and norm (one world of 4 for all of them)."""
    global _RUNS
    if _RUNS is None:
        try:
            _RUNS = small_world(clip_worker, 4)
        except BaseException as exc:
            at_learner_call(exc, "3.6")
            _RUNS = exc
    if isinstance(_RUNS, BaseException):
        raise _RUNS
    return _RUNS


def at(function: str) -> str:
    """Where the code under test defines ``function`` (for a judged failure)."""
    return defined_at(getattr(load(PHASE, "grad_clipping"), function, None))


GRID_LABEL = "dp=2 x cp=2 x tp=2 x pp=2 grid"


def counted_here_problems() -> list[str]:
    """counted_here alone, on every rank of a grid: for each set of replicated groups, every
    set of copies must be counted by exactly one rank."""
    clipping = load(PHASE, "grad_clipping")
    grid = RankGrid(dp=2, tp=2, pp=2, cp=2)
    axes_order = ("pp", "dp", "cp", "tp")
    problems = []
    for groups in (
        frozenset(), frozenset({"dp"}), frozenset({"tp"}), frozenset({"dp", "tp"}),
        frozenset({"cp"}), frozenset({"dp_cp"}), frozenset({"dp_cp", "tp"}),
        frozenset({"dp", "cp", "tp"}),
    ):  # fmt: skip
        shard = GradShard("g", torch.zeros(1), groups)
        replicated = {a for g in groups for a in AXIS_GROUPS[g]}

        def key(rank: int, replicated: set[str] = replicated) -> tuple[int, ...]:
            # the ranks holding the same copy differ only along the replicated axes
            here = grid.coords(rank)._asdict()
            return tuple(here[a] for a in axes_order if a not in replicated)

        counted: dict[tuple[int, ...], list[int]] = {}
        for rank in range(grid.world_size):
            topology = Topology(rank, grid, {})  # its place only: no process group is needed
            who = counted.setdefault(key(rank), [])
            try:
                mine = clipping.counted_here(shard, topology)
            except NotImplementedError:
                raise
            except Exception as exc:
                fail(
                    f"3.6 counted_here on rank {rank} of a {GRID_LABEL}, with a Topology that "
                    "holds the grid but no process group: it raised "
                    f"{raised_where(exc, clipping)}; decide from the rank's place alone "
                    "(topology.rank_in(name)), which needs no process group"
                )
            if mine:
                who.append(rank)
        for copy, who in counted.items():
            if len(who) != 1:
                copies = [r for r in range(grid.world_size) if key(r) == copy]
                what = (
                    "replicated on " + " and ".join(f'"{g}"' for g in sorted(groups))
                    if groups
                    else "held by its rank alone"
                )
                problems.append(
                    f"a gradient {what}: of the ranks {copies} holding the same copy, "
                    f"{'ranks ' + str(who) if who else 'none'} counted it; exactly one must "
                    "(e.g. the one whose index is 0 in every group of replicated_on)"
                    + at("counted_here")
                )
                break
    return problems


@exercise("3.6")
def test_counted_here_counts_every_set_of_copies_once() -> None:
    first_problems(counted_here_problems(), f"3.6 counted_here on every rank of a {GRID_LABEL}:")


def blamed(function: str) -> str:
    """Where to point a mistake of ``function``: copies counted several times while
    counted_here decides right on its own are global_grad_norm's (it adds what counted_here
    rejects, or does not ask it)."""
    if function == "counted_here":
        try:
            right = not counted_here_problems()
        except BaseException:
            right = False
        if right:
            return (
                " (counted_here itself decides right, see its own test: global_grad_norm adds "
                "shards it rejects, or does not ask it)" + at("global_grad_norm")
            )
    return at(function)


def layout_problems(layout: Layout, results: list[list[dict[str, Any]]]) -> list[str]:
    grads = dense_grads()
    problems = []
    for norm_type in NORMS:
        want, max_norm, clipped = torch_clip(norm_type)
        got = [
            next(
                r for r in per_rank
                if r.get("layout") == layout and r["norm_type"] == norm_type
            )
            for per_rank in results
        ]  # fmt: skip
        name = norm_name(norm_type)
        raised = [r["raised"] for r in got if "raised" in r]
        if raised:
            problems.append(
                f"{name}: global_grad_norm raised {raised[0]}; the API takes any positive "
                f"norm_type and inf, as torch.nn.utils.clip_grad_norm_ does (it returns "
                f"{want:.6g} here)"
            )
            continue
        norms = [r["norm"] for r in got]
        wrong = norm_problem(
            layout, norm_type, norms, grads, norms_elsewhere(layout, norm_type, results)
        )
        if wrong is not None:
            text, function = wrong
            problems.append(text + blamed(function))
            continue
        differs = [
            (rank, piece.name)
            for rank, result in enumerate(got)
            for piece in pieces(layout, rank, clipped)
            if result["grads"].get(piece.name) is None
            or not torch.allclose(result["grads"][piece.name], piece.values, rtol=TOLERANCE, atol=0)
        ]
        if differs:
            rank, piece_name = differs[0]
            problems.append(
                f"{name}: the norm is right, but rank {rank}'s {piece_name} after clipping "
                "differs from its piece of one process's clipped gradient (max_norm "
                f"{max_norm:.4g}; {len(differs)} tensors differ on the ranks): the given "
                "clip_grad_norm_ scales every gradient by min(1, max_norm / (norm + 1e-6)), so "
                "a gradient changed in place while measuring the norm (abs_(), pow_()) shows here"
                + at("global_grad_norm")
            )
    return problems


def norms_elsewhere(
    layout: Layout, norm_type: float, results: list[list[dict[str, Any]]]
) -> list[tuple[Layout, list[float]]]:
    """Every rank's norm of ``norm_type`` on each other graded layout (where none raised)."""
    out = []
    for other in LAYOUTS:
        if other == layout:
            continue
        got = [
            next(r for r in per_rank if r.get("layout") == other and r["norm_type"] == norm_type)
            for per_rank in results
        ]
        if all("norm" in r for r in got):
            out.append((other, [r["norm"] for r in got]))
    return out


def norm_problem(
    layout: Layout,
    norm_type: float,
    norms: list[float],
    grads: dict[str, torch.Tensor],
    elsewhere: Sequence[tuple[Layout, Sequence[float]]] = (),
) -> tuple[str, str] | None:
    """The words for the norms every rank returned on ``layout`` (None: right), and the function
    of the code under test they point at: the mistakes that give these values on every rank
    (and, where one does, the values returned on the other layouts, ``elsewhere``), one named
    when only one fits, the ones that fit listed when several do."""
    want = torch_clip(norm_type)[0]
    if all(close(n, want) for n in norms):
        return None
    named = named_mistakes(layout, norm_type, norms, grads, elsewhere)
    if named is None:
        cause, function = unexplained(norm_type, norms, want), "global_grad_norm"
    else:
        cause, function = f": {named.text()}", named.function
    return (
        f"{norm_name(norm_type)}: {evidence(norms)}; one process's clip_grad_norm_ returns "
        f"{want:.6g}" + cause,
        function,
    )


def unexplained(norm_type: float, norms: list[float], want: float) -> str:
    """What a wrong norm that no simulated mistake gives still shows: another norm type's value,
    or a sum of |g|^p counted a whole number of times, or ranks that disagree."""
    if len(set(norms)) > 1:
        return (": the ranks disagree, so some group holding other parts was not reduced over, "
                "and more is wrong besides (no single classic mistake gives these values)")  # fmt: skip
    value = norms[0]
    for other in NORMS:
        if other != norm_type and close(value, torch_clip(other)[0]):
            return (f": that is one process's {norm_name(other)}: norm_type = {norm_type:g} was "
                    "not used as given (the power of |g|, the root and the reduction all follow "
                    "it)")  # fmt: skip
    if not math.isinf(norm_type) and want > 0 and value > 0:
        times = (value / want) ** norm_type
        if round(times) >= 2 and abs(times - round(times)) < 1e-6:
            return (f": (returned / right)^{norm_type:g} = {round(times)}: the sum of "
                    f"|g|^{norm_type:g} came out {round(times)} times too large, as if every "
                    f"part were added {round(times)} times (a reduction over the world on top of "
                    "the groups', or copies counted on every rank)")  # fmt: skip
    return ": no classic mistake gives this value"


@exercise("3.6")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.label.replace(" ", ""))
def test_clip_grad_norm_over_shards_equals_one_process(layout: Layout) -> None:
    first_problems(
        layout_problems(layout, runs()),
        f"3.6 clip_grad_norm_ over {layout.label}, against torch.nn.utils.clip_grad_norm_ on "
        "one process holding the whole model (float64):",
    )


@exercise("3.6")
def test_norm_types_the_api_refuses_raise_value_error() -> None:
    problems = []
    for index, norm_type in enumerate(REFUSED):
        outcomes = {
            r["outcome"] for per_rank in runs() for r in per_rank if r.get("refused_case") == index
        }
        outcomes.discard(None)
        if outcomes:
            torch_says = "" if math.isnan(norm_type) else (
                f" (torch's clip_grad_norm_ takes it: {norm_name(norm_type)} "
                + {0.0: "counts the tensors with a non-zero gradient",
                   -1.0: "is a harmonic-like mean", -math.inf: "is the smallest |g|"}[norm_type]
                + ")"
            )  # fmt: skip
            problems.append(
                f"norm_type={norm_type}: global_grad_norm {sorted(outcomes)[0]}; the API takes "
                "a positive number or inf and raises ValueError for anything else"
                + torch_says
                + at("global_grad_norm")
            )
    first_problems(problems, "3.6 global_grad_norm with the norm types its API refuses:")
