"""2.7's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

``zigzag_chunk_ids`` is judged by :func:`grade_2_7_context_parallel.zigzag_verdict` on every cp
from 1 to 6. A realistic mistake is off in one of three factors: the order within a rank's pair
(earlier chunk first, or later), the first chunk (rank r, or 2r as in a contiguous split) and the
partner chunk (2cp-1-r, one off from it either way, or the neighbour 2r+1). Only two
combinations have a name: the pairs in the other order (chunk order swapped), and two
neighbouring chunks per rank (the contiguous split); every other combination is described (which
chunks are held twice, or the unbalanced work), never named as one of those two.

Also below: the backward's pattern of wrong cases (:func:`_pattern_advice`) and the forward's
output (:func:`output_verdict`: only causal cases wrong, its causes listed). Messages that describe
and name no cause, so need no table:

* output_verdict's "this rank sent nothing in the forward" describes, names no cause.
* output_verdict's "where the output is right, the lse is already wrong" describes, names no
  cause (it says what every merge must return).
"""

from __future__ import annotations

import sys
from functools import cache
from itertools import product
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

import torch
from cp_helpers import close, own_queries_share, reference, shard
from grade_2_7_context_parallel import (
    ATOL,
    BLOCK_RULE_CASES,
    CP_SIZES,
    MERGE_CASES,
    ZIGZAG_CP_SIZES,
    _partials,
    _pattern_advice,
    block_rule_verdict,
    case_tensors,
    dkdv_verdict,
    merge_verdict,
    output_verdict,
    zigzag_verdict,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away

CASES = tuple(f"cp={cp}" for cp in ZIGZAG_CP_SIZES)
Layout = dict[str, list[tuple[int, ...]]]

FIRSTS = {"r": lambda r, cp: r, "2r": lambda r, cp: 2 * r}
PARTNERS = {
    "2cp-1-r": lambda r, cp: 2 * cp - 1 - r,
    "2cp-2-r": lambda r, cp: 2 * cp - 2 - r,
    "2cp-r": lambda r, cp: 2 * cp - r,
    "2r+1": lambda r, cp: 2 * r + 1,
}


def layout(first: str, partner: str, later_first: bool) -> Layout:
    """What zigzag_chunk_ids gives on every graded cp with these factors (written here, not
    taken from the namer)."""
    measured: Layout = {}
    for cp in ZIGZAG_CP_SIZES:
        pairs = []
        for r in range(cp):
            pair = (FIRSTS[first](r, cp), PARTNERS[partner](r, cp))
            pairs.append(tuple(reversed(pair)) if later_first else pair)
        measured[f"cp={cp}"] = pairs
    return measured


PLANTED = {
    "order_swapped": ("r", "2cp-1-r", True),
    "contiguous": ("2r", "2r+1", False),
}


def name(measured: Layout) -> str | None:
    """The grader's verdict on every graded cp at once."""
    return zigzag_verdict({cp: measured[f"cp={cp}"] for cp in ZIGZAG_CP_SIZES})


def neighbours(key: str) -> list[tuple[str, Layout]]:
    """Every combination of the three factors."""
    return [
        (f"first {f}, partner {p}, {'later' if s else 'earlier'} first", layout(f, p, s))
        for f, p, s in product(FIRSTS, PARTNERS, (False, True))
    ]


ZIGZAG_TABLE = (
    NamerTable(
        exercise="2.7",
        function="zigzag_chunk_ids",
        factors=("the order within a pair", "the first chunk (r or 2r)", "the partner chunk"),
        cases=CASES,
        mistakes=(
            KnownMistake(
                "order_swapped", "the order within the pair", "cp=2", "chunk order swapped"
            ),
            KnownMistake(
                "contiguous", "the first chunk and its partner", "cp=2", "the contiguous split"
            ),
        ),
        right=lambda: layout("r", "2cp-1-r", False),
        plant=lambda key: layout(*PLANTED[key]),
        name=name,
        neighbours=neighbours,
    ),
)


# ---------------------------------------------------------------------------- merge_partials
# Judged by merge_verdict on the grader's three cases (MERGE_CASES), the lse first: one table for
# the lse (its factor: how the two lse combine) and one for the output with the lse right (its
# factors: what weighs each side, whether the weights are normalised, whether they are swapped).
# Each mistake's result is computed here from its formula, not from the grader's merge_variants.

MERGE_LABELS = tuple(label for label, *_ in MERGE_CASES)
Merged = dict[str, torch.Tensor]


@cache
def _sides(label: str) -> tuple[list[torch.Tensor], float, float, torch.dtype]:
    _, dtype, magnitude, atol = next(c for c in MERGE_CASES if c[0] == label)
    return _partials(dtype, magnitude, seed=7), magnitude, atol, dtype


def merged_lse(how: str) -> Merged:
    """The lse a merge gives, per case, when it combines the two lse ``how``."""
    found = {}
    for label in MERGE_LABELS:
        (_, lse_a, _, lse_b, _, lse), _, _, dtype = _sides(label)
        la, lb = lse_a.double(), lse_b.double()
        m = torch.maximum(la, lb)
        found[label] = {
            "right": lse,
            "max": m,
            "sum": la + lb,
            "unshifted": torch.log(torch.exp(la - m) + torch.exp(lb - m)),
            "min": torch.minimum(la, lb),
            "mean": (la + lb) / 2,
            "log of summed exps, no shift": torch.log(torch.exp(la) + torch.exp(lb)),
        }[how].to(dtype)
    return found


def merged_out(numerator: str, normalised: bool, swapped: bool) -> Merged:
    """The output a merge gives, per case, weighing each side by ``numerator``."""
    found = {}
    for label in MERGE_LABELS:
        (out_a, lse_a, out_b, lse_b, _, _), _, _, dtype = _sides(label)
        oa, la, ob, lb = (t.double() for t in (out_a, lse_a, out_b, lse_b))
        m = torch.maximum(la, lb)
        wa, wb = {
            "exp(lse - max)": (torch.exp(la - m), torch.exp(lb - m)),
            "lse": (la, lb),
            "one": (torch.ones_like(la), torch.ones_like(lb)),
        }[numerator]
        if swapped:
            wa, wb = wb, wa
        total = (wa + wb).unsqueeze(-1) if normalised else 1.0
        found[label] = ((wa.unsqueeze(-1) * oa + wb.unsqueeze(-1) * ob) / total).to(dtype)
    return found


def _right_out(label: str) -> torch.Tensor:
    (_, _, _, _, out, _), _, _, dtype = _sides(label)
    return out.to(dtype)


def _right_lse(label: str) -> torch.Tensor:
    (_, _, _, _, _, lse), _, _, dtype = _sides(label)
    return lse.to(dtype)


def _merge_name(measured: Merged, *, of: str) -> str | None:
    for label in MERGE_LABELS:
        _, magnitude, atol, _ = _sides(label)
        out = measured[label] if of == "out" else _right_out(label)
        lse = measured[label] if of == "lse" else _right_lse(label)
        said = merge_verdict(label, magnitude, atol, out, lse)
        if said:
            return said
    return None


LSE_PLANTED = {"lse_max": "max", "lse_sum": "sum", "lse_unshifted": "unshifted"}
OUT_PLANTED = {
    "not_normalised": ("exp(lse - max)", False, False),
    "weights_swapped": ("exp(lse - max)", True, True),
    "plain_average": ("one", True, False),
    "weighed_by_lse": ("lse", True, False),
}

# ---------------------------------------------------------------------------- dK and dV
# Judged by dkdv_verdict at the first wrong (case, rank): on a ring where every case is wrong,
# cp=2 (the first graded world), not causal, contiguous, rank 0. Factors: what the travelling
# sum starts from (zeros, or a copy of a rank's own share), what is done with the home rank's own
# share (added, replaced, the only one kept, added twice), and the rank the sum ends on.
DKDV_CASE = "cp=2, not causal, contiguous, rank 0, dK"
DKDV_CP = CP_SIZES[0]


@cache
def _dk_pieces() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The full dK, each rank's own queries' share of its own dK, and rank 0's right dK."""
    q, k, v, grad = case_tensors(DKDV_CP, False, False)
    ref = reference(q, k, v, grad, False)
    homes = [own_queries_share(ref, q, grad, r, DKDV_CP, False)[0] for r in range(DKDV_CP)]
    return ref.dk, homes, shard(ref.dk, 0, DKDV_CP, False)


def dk_of(start: str, home: str, end: int) -> dict[str, torch.Tensor]:
    """Rank 0's dK when the travelling sums start from ``start`` ("zeros" or "copy r"), the home
    rank's own share is ``home`` ("added", "replaced", "only", "twice") and the sum of block b
    ends on rank b + ``end``."""
    full, homes, _ = _dk_pieces()
    owner = end % DKDV_CP  # whose block's sum rank 0 ends up with
    right = shard(full, owner, DKDV_CP, False)
    own = homes[owner]
    got = {"added": right, "replaced": right - own, "only": own, "twice": right + own}[home]
    if start.startswith("copy"):
        got = got + homes[int(start.split()[1])]
    return {DKDV_CASE: got}


DKDV_PLANTED = {
    "only_home_share": ("zeros", "only", 0),
    "home_share_replaced": ("zeros", "replaced", 0),
    "started_from_a_copy": ("copy 1", "added", 0),
    "ended_on_the_wrong_rank": ("zeros", "added", 1),
}


def _dk_name(measured: dict[str, torch.Tensor]) -> str | None:
    got = measured[DKDV_CASE]
    if close(got, _dk_pieces()[2], ATOL):
        return None
    return dkdv_verdict(DKDV_CP, False, False, 0, "dK", got)


def _dk_neighbours(key: str) -> list[tuple[str, dict[str, torch.Tensor]]]:
    starts = ["zeros", *(f"copy {r}" for r in range(DKDV_CP))]
    return [
        (f"start {s}, home share {h}, ends {e} on", dk_of(s, h, e))
        for s in starts
        for h in ("added", "replaced", "only", "twice")
        for e in range(DKDV_CP)
    ]


TABLES: tuple[NamerTable, ...] = (
    *ZIGZAG_TABLE,
    NamerTable(
        exercise="2.7",
        function="merge_partials (the lse)",
        factors=("how the two lse combine",),
        cases=MERGE_LABELS,
        mistakes=(
            KnownMistake("lse_max", "the log of the summed weights", MERGE_LABELS[0],
                         "yours is the larger of the two lse"),
            KnownMistake("lse_sum", "a sum for a log-sum-exp", MERGE_LABELS[0],
                         "yours is lse_a + lse_b"),
            KnownMistake("lse_unshifted", "the shift m", MERGE_LABELS[0],
                         "without the shift m added back"),
        ),
        right=lambda: merged_lse("right"),
        plant=lambda key: merged_lse(LSE_PLANTED[key]),
        name=lambda measured: _merge_name(measured, of="lse"),
        neighbours=lambda key: [
            (how, merged_lse(how))
            for how in ("max", "sum", "unshifted", "min", "mean", "log of summed exps, no shift")
        ],
    ),
    NamerTable(
        exercise="2.7",
        function="merge_partials (the output, the lse right)",
        factors=("what weighs each side", "normalised or not", "the sides' weights swapped"),
        cases=MERGE_LABELS,
        mistakes=(
            KnownMistake("not_normalised", "the sum of the weights", MERGE_LABELS[0],
                         "the weighted sum is not divided by the sum of the weights"),
            KnownMistake("weights_swapped", "which side each weight belongs to", MERGE_LABELS[0],
                         "the weights are swapped"),
            KnownMistake("plain_average", "the weights themselves", MERGE_LABELS[0],
                         "a plain average ignores"),
            KnownMistake("weighed_by_lse", "exp of the weights", MERGE_LABELS[0],
                         "the sides are weighed by their lse"),
        ),
        right=lambda: merged_out("exp(lse - max)", True, False),
        plant=lambda key: merged_out(*OUT_PLANTED[key]),
        name=lambda measured: _merge_name(measured, of="out"),
        neighbours=lambda key: [
            (f"{n}, {'normalised' if z else 'not normalised'}, {'swapped' if s else 'in order'}",
             merged_out(n, z, s))
            for n in ("exp(lse - max)", "lse", "one")
            for z in (True, False)
            for s in (False, True)
        ],
    ),
    NamerTable(
        exercise="2.7",
        function="ring_attention backward (dK and dV)",
        factors=("what a travelling sum starts from", "the home rank's own share",
                 "the rank the sum ends on"),
        cases=(DKDV_CASE,),
        mistakes=(
            KnownMistake("only_home_share", "every other rank's share", DKDV_CASE,
                         "holds only this rank's own queries' share"),
            KnownMistake("home_share_replaced", "the home share (replaced)", DKDV_CASE,
                         "holds the other ranks' shares but not this rank's own"),
            KnownMistake("started_from_a_copy", "a copy of a rank's share", DKDV_CASE,
                         "started from a copy of rank"),
            KnownMistake("ended_on_the_wrong_rank", "one ring step", DKDV_CASE,
                         "the sums ended on the wrong rank"),
        ),
        right=lambda: {DKDV_CASE: _dk_pieces()[2]},
        plant=lambda key: dk_of(*DKDV_PLANTED[key]),
        name=_dk_name,
        neighbours=_dk_neighbours,
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- block_kind
# Judged by block_rule_verdict on every (q chunk, k chunk) of 6, causal or not. Factors: which
# side of the diagonal is the future (k > q, or k < q), the diagonal's kind (DIAGONAL, FULL,
# SKIP), the boundary (k vs q, or vs q +- 1), and whether a non-causal call is masked too.
# Named: the mirrored rule only, when it is exactly that.


def block_rule(
    future: str, diagonal: str, shift: int, mask_always: bool
) -> dict[tuple[int, int, bool], Any]:
    from phase2_advanced.ring_attention_blocks import BlockKind

    found = {}
    for q, k, causal in BLOCK_RULE_CASES:
        if not causal and not mask_always:
            kind = "FULL"
        elif k == q:
            kind = diagonal
        else:
            ahead = k > q + shift if future == "k > q" else k < q - shift
            kind = "SKIP" if ahead else "FULL"
        found[(q, k, causal)] = BlockKind[kind]
    return found


BLOCK_RULE_PLANTED = {"mirrored": ("k < q", "DIAGONAL", 0, False)}
BLOCK_RULE_LABELS = ("6 chunks, causal and not",)

TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.7",
        function="block_kind",
        factors=("which side is the future", "the diagonal's kind", "the boundary",
                 "a mask without causal"),
        cases=BLOCK_RULE_LABELS,
        mistakes=(
            KnownMistake("mirrored", "the side of the diagonal", BLOCK_RULE_LABELS[0],
                         "the rule is mirrored"),
        ),
        right=lambda: block_rule("k > q", "DIAGONAL", 0, False),
        plant=lambda key: block_rule(*BLOCK_RULE_PLANTED[key]),
        name=block_rule_verdict,
        neighbours=lambda key: [
            (f"future {f}, diagonal {d}, shift {s}, {'always masked' if m else 'causal only'}",
             block_rule(f, d, s, m))
            for f in ("k > q", "k < q")
            for d in ("DIAGONAL", "FULL", "SKIP")
            for s in (0, 1)
            for m in (False, True)
        ],
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the ring's patterns
# Two verdicts read the pattern of which (causal, zigzag) cases a ring run got wrong, the same at
# every graded cp (2, 3, 4); nothing here runs a ring: the measurement is the evidence each
# verdict reads, written from the factors.
#
# The backward's _pattern_advice (dQ, dK, dV): factors, each (causal, zigzag) case spoiled or
# not. Named: the causal rule in the backward (every causal case, no other) and the slicing by
# chunk (every zigzag case, no other); the causal zigzag case alone fits both, and gets both.

PATTERN_CASES = tuple(f"ring attention gradients, cp={cp}" for cp in CP_SIZES)
QUADRANTS = tuple((causal, zigzag) for causal in (False, True) for zigzag in (False, True))
QUADRANT_RIGHT = {f"causal={c}, zigzag={z}": "right" for c, z in QUADRANTS}
QUADRANT_FACTORS = {q: ("right", "spoiled") for q in QUADRANT_RIGHT}
PATTERN_PLANTED = {
    "causal_rule": {"causal=True, zigzag=False": "spoiled", "causal=True, zigzag=True": "spoiled"},
    "chunk_slicing": {
        "causal=False, zigzag=True": "spoiled",
        "causal=True, zigzag=True": "spoiled",
    },
}


def spoiled(setting: dict[str, str]) -> dict[str, frozenset[tuple[bool, bool]]]:
    cases = frozenset(q for q, label in zip(QUADRANTS, QUADRANT_RIGHT, strict=True)
                      if setting[label] == "spoiled")  # fmt: skip
    return dict.fromkeys(PATTERN_CASES, cases)


def pattern_name(measured: dict[str, frozenset[tuple[bool, bool]]]) -> str | None:
    wrong = next(iter(measured.values()))
    if not wrong:
        return None
    return _pattern_advice(set(wrong)) or f"the cases {sorted(wrong)} differ"


# The forward's output_verdict: factors, whether the causal and the non-causal cases are spoiled,
# whether the learner's block_kind is right, whether the first wrong rank sent nothing, whether a
# right output has a wrong lse. Named (as a list of the two causes that fit: the visiting block's
# chunk ids, or how the forward acts on the kind): only causal cases wrong with block_kind right.
# Listed apart: only causal cases wrong with block_kind wrong. Described, naming no cause: a
# rank that sent nothing, a right output with a wrong lse. A setting with every output right is
# judged elsewhere (_check_lse, the block_kind test), so it measures as the right answer here.

OUTPUT_CASES = tuple(f"ring attention output, cp={cp}" for cp in CP_SIZES)
OUTPUT_RIGHT = {"causal": "right", "non-causal": "right", "block_kind": "right",
                "sent": "every block", "lse of a right output": "right"}  # fmt: skip
OUTPUT_FACTORS = {
    "causal": ("right", "spoiled"),
    "non-causal": ("right", "spoiled"),
    "block_kind": ("right", "wrong"),
    "sent": ("every block", "nothing"),
    "lse of a right output": ("right", "wrong"),
}
OUTPUT_PLANTED = {
    "visiting_ids_or_kind_use": {"causal": "spoiled"},
    "block_kind_wrong": {"causal": "spoiled", "block_kind": "wrong"},
}
OutputSeen = dict[str, tuple[Any, ...]]


def output_seen(setting: dict[str, str]) -> OutputSeen:
    """Per graded cp: (wrong (causal, zigzag, rank) cases, the first right output with a wrong
    lse, silent, block_kind right), as output_verdict reads them."""
    found: OutputSeen = {}
    for cp, label in zip(CP_SIZES, OUTPUT_CASES, strict=True):
        wrong = tuple((c, z, r) for c, z in QUADRANTS for r in range(cp)
                      if setting["causal" if c else "non-causal"] == "spoiled")  # fmt: skip
        if not wrong:
            found[label] = ()
            continue
        right_one = next(((c, z, r) for c, z in QUADRANTS for r in range(cp)
                          if (c, z, r) not in wrong), None)  # fmt: skip
        bad_lse = right_one if setting["lse of a right output"] == "wrong" else None
        found[label] = (wrong, bad_lse, setting["sent"] == "nothing",
                        setting["block_kind"] == "right")  # fmt: skip
    return found


def output_name(measured: OutputSeen) -> str | None:
    for cp, label in zip(CP_SIZES, OUTPUT_CASES, strict=True):
        if measured[label]:
            wrong, bad_lse, silent, block_kind_right = measured[label]
            return output_verdict(cp, [(*w, "max difference 1e+00") for w in wrong], bad_lse,
                                  silent, block_kind_right)  # fmt: skip
    return None


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.7",
        function="ring_attention backward (the pattern of wrong cases)",
        factors=tuple(QUADRANT_FACTORS),
        cases=PATTERN_CASES,
        mistakes=(
            KnownMistake("causal_rule", "the causal cases", PATTERN_CASES[0],
                         "so the ring and the sums work: look at the causal rule"),
            KnownMistake("chunk_slicing", "the zigzag cases", PATTERN_CASES[0],
                         "every contiguous case is right, so look at"),
        ),
        right=lambda: spoiled(QUADRANT_RIGHT),
        plant=lambda key: spoiled({**QUADRANT_RIGHT, **PATTERN_PLANTED[key]}),
        name=pattern_name,
        neighbours=lambda key: one_factor_away(
            PATTERN_PLANTED[key], PATTERN_PLANTED.values(), QUADRANT_RIGHT, QUADRANT_FACTORS,
            lambda changed: spoiled({**QUADRANT_RIGHT, **changed}),
        ),
    ),
    NamerTable(
        exercise="2.7",
        function="ring_attention forward (the output)",
        factors=tuple(OUTPUT_FACTORS),
        cases=OUTPUT_CASES,
        mistakes=(
            KnownMistake("visiting_ids_or_kind_use", "the causal cases, block_kind right",
                         OUTPUT_CASES[0], "the causes that fit: the chunk ids the forward gives"),
            KnownMistake("block_kind_wrong", "the causal cases, block_kind wrong",
                         OUTPUT_CASES[0], "look at which blocks are skipped or masked"),
        ),
        right=lambda: output_seen(OUTPUT_RIGHT),
        plant=lambda key: output_seen({**OUTPUT_RIGHT, **OUTPUT_PLANTED[key]}),
        name=output_name,
        neighbours=lambda key: one_factor_away(
            OUTPUT_PLANTED[key], OUTPUT_PLANTED.values(), OUTPUT_RIGHT, OUTPUT_FACTORS,
            lambda changed: output_seen({**OUTPUT_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip
