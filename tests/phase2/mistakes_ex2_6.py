"""2.6's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

One namer, :func:`tp_namers.placement_verdict`, judges where f and g stand from the all-reduces
counted in forward and backward and from whether the output is right; the grader calls it for a
column-parallel layer alone (its entry: f), a row-parallel layer alone (its exit: g) and the MLP
and attention blocks (f at the entry, g at the exit). The factors a realistic mistake is off by:
which operator (f, g, or none) stands at each end. The counts do not depend on the world size,
so every graded world (2 and 4 ranks) measures alike; the output's rightness tells apart the
placements with equal counts, and where it cannot (f at one end and nothing at the other) the
namer lists both.

Also below: f's backward and g's forward writing into what they were handed
(:func:`grad_output_verdict`, :func:`g_input_verdict`: the in-place all-reduce), and attention's
qkv shard (:func:`qkv_shard_problem`: the contiguous block). Messages that describe and name no
cause, so need no table:

* the other operator problems (f/g/gather/scatter values and collective counts) describe, name no
  cause.
* the gather-backward hint ("is the slice picked by the rank in the group?") describes (the error
  raised, at the learner's line) and asks; it names no cause.
* the attention output message (shards right, output wrong) describes, and lists the two parts of
  forward that fit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

import torch
from grade_2_6_tensor_parallel import (
    BIAS_WORLD,
    BLOCK_ALL_REDUCES,
    COLUMN_ALL_REDUCES,
    FUSED_WEIGHT,
    ROW_ALL_REDUCES,
    ROW_WEIGHT,
    SHARD_CASES,
    SUBGROUP_SIZE,
    SUBGROUP_WORLD,
    bias_reference,
    bias_verdict,
    column_shard_verdict,
    g_input_verdict,
    grad_output_verdict,
    make_attention,
    qkv_shard_problem,
    row_shard_verdict,
    seeded,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away
from tp_namers import BLOCK, COLUMN_LAYER, ROW_LAYER, placement_verdict

Measured = dict[str, tuple[int, int, bool]]
Shape = tuple[tuple[str, ...], tuple[str, ...], tuple[str, str]]

COLUMN_CASES = ("ColumnParallelLinear on 2 ranks", "ColumnParallelLinear on 4 ranks")
ROW_CASES = ("RowParallelLinear on 2 ranks", "RowParallelLinear on 4 ranks")
BLOCK_CASES = (
    "ParallelMLP on 2 ranks",
    "ParallelMLP on 4 ranks",
    "ParallelSelfAttention on 2 ranks",
    "ParallelSelfAttention on 4 ranks",
)

# What each operator does, written out here (not taken from tp_namers): all-reduces forward,
# all-reduces backward, and whether its forward leaves the tensor as it is
OPERATORS = {"f": (0, 1, True), "g": (1, 0, False), "none": (0, 0, True)}


def placed(entry: str, exit_: str, right_exit: str, cases: tuple[str, ...]) -> Measured:
    """What the grader measures when these operators stand at the ends: the all-reduces each
    way, and whether the output is the dense one (the input left as it is, and the partial
    outputs summed exactly where the layer makes partial outputs)."""
    fwd = OPERATORS[entry][0] + OPERATORS[exit_][0]
    bwd = OPERATORS[entry][1] + OPERATORS[exit_][1]
    right = OPERATORS[entry][2] and exit_ == right_exit
    return dict.fromkeys(cases, (fwd, bwd, right))


def _name(shape: Shape) -> Callable[[Measured], str | None]:
    def name(measured: Measured) -> str | None:
        said = [placement_verdict((f, b), right, shape) for f, b, right in measured.values()]
        return next((s for s in said if s), None)

    return name


def _neighbours(
    shape: Shape, cases: tuple[str, ...]
) -> Callable[[str], Sequence[tuple[str, Measured]]]:
    """Every placement of the operators the shape allows: each end set to each of its options."""
    entries, exits, right = shape

    def neighbours(key: str) -> list[tuple[str, Measured]]:
        return [
            (f"entry {e}, exit {x}", placed(e, x, right[1], cases)) for e in entries for x in exits
        ]

    return neighbours


F_FOR_G = "f (copy_to_tensor_parallel_region) where g belongs at the exit"
G_FOR_F = "g (reduce_from_tensor_parallel_region) where f belongs at the entry"

TABLES: tuple[NamerTable, ...] = (
    NamerTable(
        exercise="2.6",
        function="ColumnParallelLinear.forward",
        factors=("the operator at the entry (f, g or none)",),
        cases=COLUMN_CASES,
        mistakes=(
            KnownMistake("g_for_f_at_entry", "g for f at the entry", COLUMN_CASES[0], G_FOR_F),
            KnownMistake("no_f_at_entry", "no operator at the entry", COLUMN_CASES[0],
                         "no f at the entry"),
        ),
        right=lambda: dict.fromkeys(COLUMN_CASES, (*COLUMN_ALL_REDUCES, True)),
        plant=lambda key: placed({"g_for_f_at_entry": "g", "no_f_at_entry": "none"}[key],
                                 "none", "none", COLUMN_CASES),
        name=_name(COLUMN_LAYER),
        neighbours=_neighbours(COLUMN_LAYER, COLUMN_CASES),
    ),
    NamerTable(
        exercise="2.6",
        function="RowParallelLinear.forward",
        factors=("the operator at the exit (f, g or none)",),
        cases=ROW_CASES,
        mistakes=(
            KnownMistake("f_for_g_at_exit", "f for g at the exit", ROW_CASES[0], F_FOR_G),
            KnownMistake("no_g_at_exit", "no operator at the exit", ROW_CASES[0],
                         "no g at the exit"),
        ),
        right=lambda: dict.fromkeys(ROW_CASES, (*ROW_ALL_REDUCES, True)),
        plant=lambda key: placed("none", {"f_for_g_at_exit": "f", "no_g_at_exit": "none"}[key],
                                 "g", ROW_CASES),
        name=_name(ROW_LAYER),
        neighbours=_neighbours(ROW_LAYER, ROW_CASES),
    ),
    NamerTable(
        exercise="2.6",
        function="ParallelMLP / ParallelSelfAttention (f at the entry, g at the exit)",
        factors=("the operator at the entry (f, g or none)", "the operator at the exit"),
        cases=BLOCK_CASES,
        mistakes=(
            KnownMistake("f_for_g_at_exit", "f for g at the exit", BLOCK_CASES[0], F_FOR_G),
            KnownMistake("g_for_f_at_entry", "g for f at the entry", BLOCK_CASES[0], G_FOR_F),
            KnownMistake("no_f_at_entry", "no operator at the entry", BLOCK_CASES[0],
                         "no f at the entry"),
        ),
        right=lambda: dict.fromkeys(BLOCK_CASES, (*BLOCK_ALL_REDUCES, True)),
        plant=lambda key: placed(*{"f_for_g_at_exit": ("f", "f"), "g_for_f_at_entry": ("g", "g"),
                                   "no_f_at_entry": ("none", "g")}[key], "g", BLOCK_CASES),
        name=_name(BLOCK),
        neighbours=_neighbours(BLOCK, BLOCK_CASES),
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the shards
# column_shard and row_shard, judged in process on every (world size, rank) of 2 and 4 ranks.
# Factors of column_shard: the dimension cut (output features, dim 0, or input features, dim 1),
# per fused part or one contiguous block, and the rank's offset (its own slice, or the next
# rank's); of row_shard: the dimension cut and the offset. Named: the contiguous block and the
# cut along the input features (column_shard), the cut along the output features (row_shard).

Shards = dict[tuple[int, int], torch.Tensor]


def column_shards(dim: int, per_part: bool, offset: int) -> Shards:
    """What a column_shard with these factors returns (written here from the factors)."""
    found = {}
    for n, rank in SHARD_CASES:
        r = (rank + offset) % n
        parts = FUSED_WEIGHT.chunk(3, dim=0) if per_part else (FUSED_WEIGHT,)
        pieces = []
        for part in parts:
            width = part.shape[dim] // n
            pieces.append(part.narrow(dim, r * width, width))
        found[(n, rank)] = torch.cat(pieces, dim=0)
    return found


def row_shards(dim: int, offset: int) -> Shards:
    found = {}
    for n, rank in SHARD_CASES:
        width = ROW_WEIGHT.shape[dim] // n
        found[(n, rank)] = ROW_WEIGHT.narrow(dim, ((rank + offset) % n) * width, width)
    return found


SHARD_LABELS = tuple(f"rank {r} of {n}" for n, r in SHARD_CASES)

TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.6",
        function="column_shard",
        factors=("the dimension cut", "per fused part or contiguous", "the rank's offset"),
        cases=SHARD_LABELS,
        mistakes=(
            KnownMistake("contiguous", "the fused parts", SHARD_LABELS[0],
                         "a contiguous block of rows"),
            KnownMistake("input_features", "the dimension", SHARD_LABELS[0],
                         "it cut the second dimension"),
        ),
        right=lambda: column_shards(0, True, 0),
        plant=lambda key: {"contiguous": column_shards(0, False, 0),
                           "input_features": column_shards(1, True, 0)}[key],
        name=column_shard_verdict,
        neighbours=lambda key: [
            (f"dim {d}, {'per part' if p else 'contiguous'}, offset {o}", column_shards(d, p, o))
            for d in (0, 1) for p in (True, False) for o in (0, 1)
        ],
    ),
    NamerTable(
        exercise="2.6",
        function="row_shard",
        factors=("the dimension cut", "the rank's offset"),
        cases=SHARD_LABELS,
        mistakes=(
            KnownMistake("output_features", "the dimension", SHARD_LABELS[0],
                         "it cut the first dimension"),
        ),
        right=lambda: row_shards(1, 0),
        plant=lambda key: row_shards(0, 0),
        name=row_shard_verdict,
        neighbours=lambda key: [
            (f"dim {d}, offset {o}", row_shards(d, o)) for d in (0, 1) for o in (0, 1)
        ],
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the row bias
# RowParallelLinear's bias, judged by bias_verdict on 4 ranks. Factors: where the bias is added
# (after g on every rank, before g on every rank, before g on rank 0 only, before and after g,
# nowhere) and its scale (1 or 1/n). Output and bias gradient per rank are written here from
# the factors: g sums what each rank added before it, its backward hands every rank the same
# gradient.

BIAS_PLACES = ("after g", "before g, every rank", "before g, rank 0", "before and after g",
               "nowhere")  # fmt: skip
BiasRun = list[dict[str, torch.Tensor | None]]


def bias_run(place: str, scale: str) -> BiasRun:
    out, bias, grad = bias_reference()
    n = BIAS_WORLD
    s = 1.0 if scale == "1" else 1.0 / n
    times = {"after g": s, "before g, every rank": n * s, "before g, rank 0": s,
             "before and after g": n * s + s, "nowhere": 0.0}[place]  # fmt: skip
    found: BiasRun = []
    for rank in range(n):
        used = {"after g": s, "before g, every rank": s, "before g, rank 0": s if rank == 0 else 0,
                "before and after g": 2 * s, "nowhere": 0}[place]  # fmt: skip
        found.append({"out": out + (times - 1) * bias, "bias_grad": grad * used if used else None})
    return found


BIAS_PLANTED = {
    "added_on_every_rank": ("before g, every rank", "1"),
    "added_on_some_ranks": ("before g, rank 0", "1"),
    "divided_by_n": ("before g, every rank", "1/n"),
}
BIAS_CASES = (f"RowParallelLinear(input_is_parallel=True) on {BIAS_WORLD} ranks",)

TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.6",
        function="RowParallelLinear.forward (its bias)",
        factors=("where the bias is added", "its scale (1 or 1/n)"),
        cases=BIAS_CASES,
        mistakes=(
            KnownMistake("added_on_every_rank", "a factor n", BIAS_CASES[0],
                         f"holds the bias {BIAS_WORLD} times"),
            KnownMistake("added_on_some_ranks", "the ranks that add it", BIAS_CASES[0],
                         "bias got no gradient"),
            KnownMistake("divided_by_n", "a factor 1/n in the gradient", BIAS_CASES[0],
                         f"got 1/{BIAS_WORLD} of its gradient"),
        ),
        right=lambda: bias_run("after g", "1"),
        plant=lambda key: bias_run(*BIAS_PLANTED[key]),
        name=bias_verdict,
        neighbours=lambda key: [(f"{p}, scale {s}", bias_run(p, s))
                                for p in BIAS_PLACES for s in ("1", "1/n")],
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the operators
# f's backward and g's forward, judged per rank by grad_output_verdict and g_input_verdict in
# the operators' worlds: 2 ranks, 4 ranks, and the groups (0, 1) and (2, 3) of 4 ranks. Factors:
# what is written into the tensor the operator was handed (nothing, the sum, the mean or the max
# over the ranks, n times this rank's own) and over which ranks (the layer's group or the whole
# world, which differ only on the subgroups). Named: the in-place all-reduce (the sum over the
# group written into the tensor itself). The group is not a factor of this name: an all-reduce
# over the world written into the tensor is an in-place all-reduce too, and at 2 ranks (the first
# world graded) it is told so; its group shows apart, in the subgroup test's crossing message and
# gradients. So the neighbours vary what is written, over the group.

OPERATOR_CASES = ("operators on 2 ranks", "operators on 4 ranks",
                  f"operators on groups of {SUBGROUP_SIZE} of {SUBGROUP_WORLD} ranks")  # fmt: skip
WRITTEN = ("nothing", "sum", "mean", "max", "n x own")
Handed = dict[str, list[torch.Tensor]]  # per case, per rank: the handed tensor after the call


def handed_in(seed: int, case: str) -> list[list[torch.Tensor]]:
    """Per group of the case, its ranks' tensors as the grader hands them (operator_problems'
    per_rank: seed 100 x seed + rank in group + 1000 x group index)."""
    size, world = ((2, 2), (4, 4), (SUBGROUP_SIZE, SUBGROUP_WORLD))[OPERATOR_CASES.index(case)]
    return [[seeded(100 * seed + r + 1000 * g, 3, 4) for r in range(size)]
            for g in range(world // size)]  # fmt: skip


def written(seed: int, setting: dict[str, str]) -> Handed:
    """What the handed tensors hold after an operator that writes ``setting`` into them."""
    found: Handed = {}
    for case in OPERATOR_CASES:
        groups = handed_in(seed, case)
        world = torch.stack([t for group in groups for t in group])
        after = []
        for group in groups:
            pool = torch.stack(group) if setting["over"] == "the group" else world
            for own in group:
                after.append(
                    {
                        "nothing": own,
                        "sum": pool.sum(0),
                        "mean": pool.mean(0),
                        "max": pool.amax(0),
                        "n x own": len(pool) * own,
                    }[setting["write"]]
                )
        found[case] = after
    return found  # fmt: skip


def operator_namer(
    seed: int, verdict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], str | None]
) -> Callable[[Handed], str | None]:
    def name(measured: Handed) -> str | None:
        for case in OPERATOR_CASES:
            groups = handed_in(seed, case)
            handed = [(own, torch.stack(group).sum(0)) for group in groups for own in group]
            for after, (own, summed) in zip(measured[case], handed, strict=True):
                said = verdict(after, own, summed)
                if said:
                    return said
        return None

    return name


OPERATOR_RIGHT = {"write": "nothing", "over": "the group"}
IN_PLACE = {"write": "sum"}


def operator_neighbours(seed: int) -> Callable[[str], list[tuple[str, Handed]]]:
    return lambda key: one_factor_away(
        IN_PLACE, [IN_PLACE], OPERATOR_RIGHT, {"write": WRITTEN},
        lambda changed: written(seed, {**OPERATOR_RIGHT, **changed}),
    )  # fmt: skip


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.6",
        function="CopyToTensorParallelRegion.backward (f: its grad_output)",
        factors=("what is written into grad_output",),
        cases=OPERATOR_CASES,
        mistakes=(
            KnownMistake("in_place_all_reduce", "grad_output itself for a new tensor",
                         OPERATOR_CASES[0], "an all-reduce wrote into grad_output itself"),
        ),
        right=lambda: written(2, OPERATOR_RIGHT),
        plant=lambda key: written(2, {**OPERATOR_RIGHT, **IN_PLACE}),
        name=operator_namer(2, grad_output_verdict),
        neighbours=operator_neighbours(2),
    ),
    NamerTable(
        exercise="2.6",
        function="ReduceFromTensorParallelRegion.forward (g: its input)",
        factors=("what is written into the input",),
        cases=OPERATOR_CASES,
        mistakes=(
            KnownMistake("in_place_all_reduce", "the input itself for a new tensor",
                         OPERATOR_CASES[0], "an all-reduce wrote into g's input itself"),
        ),
        right=lambda: written(3, OPERATOR_RIGHT),
        plant=lambda key: written(3, {**OPERATOR_RIGHT, **IN_PLACE}),
        name=operator_namer(3, g_input_verdict),
        neighbours=operator_neighbours(3),
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- attention's qkv
# ParallelSelfAttention's qkv.weight, judged by qkv_shard_problem on every rank of 2 and 4. The
# same factors as column_shard (the dimension cut, per fused part or contiguous, the rank's
# offset), on nn.MultiheadAttention's in_proj_weight ([q; k; v] stacked). Named: the contiguous
# block.

QKV_CASES = tuple((n, r) for n in (2, 4) for r in range(n))
QKV_LABELS = tuple(f"ParallelSelfAttention on {n} ranks, rank {r}" for n, r in QKV_CASES)


def qkv_shards(dim: int, per_part: bool, offset: int) -> dict[tuple[int, int], torch.Tensor]:
    """Each rank's qkv.weight from a from_dense with these factors (written here)."""
    weight = make_attention().in_proj_weight.detach()
    found = {}
    for n, rank in QKV_CASES:
        r = (rank + offset) % n
        parts = weight.chunk(3, dim=0) if per_part else (weight,)
        found[(n, rank)] = torch.cat(
            [p.narrow(dim, r * (p.shape[dim] // n), p.shape[dim] // n) for p in parts], dim=0
        )
    return found


def qkv_name(measured: dict[tuple[int, int], torch.Tensor]) -> str | None:
    return next(
        (s for (n, r), shard in measured.items() if (s := qkv_shard_problem(shard, r, n))), None
    )


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.6",
        function="ParallelSelfAttention.from_dense (qkv.weight)",
        factors=("the dimension cut", "per fused part or contiguous", "the rank's offset"),
        cases=QKV_LABELS,
        mistakes=(
            KnownMistake("contiguous", "the fused parts", QKV_LABELS[0],
                         "a contiguous block of in_proj_weight's rows"),
        ),
        right=lambda: qkv_shards(0, True, 0),
        plant=lambda key: qkv_shards(0, False, 0),
        name=qkv_name,
        neighbours=lambda key: [
            (f"dim {d}, {'per part' if p else 'contiguous'}, offset {o}", qkv_shards(d, p, o))
            for d in (0, 1) for p in (True, False) for o in (0, 1)
        ],
    ),
)  # fmt: skip
