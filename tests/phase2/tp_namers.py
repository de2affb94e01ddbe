"""What 2.6's grader says when a parallel block's all-reduces are not Megatron's (issue 49).

A block split across ranks enters its parallel region through f (copy_to_tensor_parallel_region:
no collective forward, one all-reduce backward) and leaves it through g
(reduce_from_tensor_parallel_region: one all-reduce forward, none backward). Put the wrong
operator at either end, or none, and the all-reduces each way change: counted, they say where
the operators stood, and with whether the output is right they single out one placement or a
few. :func:`placement_verdict` words that, naming a placement only when it alone fits; the grader
(tests/phase2/grade_2_6_tensor_parallel.py) and the mistake table (mistakes_ex2_6.py) both call it.
"""

from __future__ import annotations

from itertools import product

# all-reduces (forward, backward) that each operator makes at an end of the region
ALL_REDUCES = {"f": (0, 1), "g": (1, 0), "none": (0, 0)}
OPERATOR = {
    "f": "f (copy_to_tensor_parallel_region)",
    "g": "g (reduce_from_tensor_parallel_region)",
    "none": "no operator",
}
BLOCK = (("f", "g", "none"), ("f", "g", "none"), ("f", "g"))  # entries, exits, Megatron's
ROW_LAYER = (("none",), ("f", "g", "none"), ("none", "g"))  # no f: a scatter or a sliced input
COLUMN_LAYER = (("f", "g", "none"), ("none",), ("f", "none"))  # no g: a slice, or a gather


def counts_of(entry: str, exit_: str) -> tuple[int, int]:
    """All-reduces (forward, backward) that a block with these operators makes."""
    a, b = ALL_REDUCES[entry], ALL_REDUCES[exit_]
    return a[0] + b[0], a[1] + b[1]


def output_right(entry: str, exit_: str, right_exit: str) -> bool:
    """The output is the dense one iff the entry leaves the input as it is (f, or nothing) and
    the exit is the right one (g, which sums the ranks' partial outputs, where there are
    partial outputs)."""
    return entry in ("f", "none") and exit_ == right_exit


def _named(entry: str, exit_: str, right: tuple[str, str]) -> str:
    """The one placement that fits, as a cause (both ends wrong: said as such, so that it never
    reads as the one-end mistake it contains)."""
    if entry != right[0] and exit_ != right[1]:
        return f"both ends wrong: the entry has {OPERATOR[entry]}, the exit {OPERATOR[exit_]}"
    end, got, want = ("entry", entry, right[0]) if entry != right[0] else ("exit", exit_, right[1])
    want_name = OPERATOR[want].split(" ")[0]
    if got == "none":
        return f"no {want_name} at the {end}"
    if want == "none":
        return f"{OPERATOR[got]} at the {end}, where nothing belongs"
    return f"{OPERATOR[got]} where {want_name} belongs at the {end}"


def placement_verdict(
    got: tuple[int, int],
    is_output_right: bool,
    shape: tuple[tuple[str, ...], tuple[str, ...], tuple[str, str]] = BLOCK,
) -> str | None:
    """The words for a block whose all-reduces were ``got`` (forward, backward) and whose output
    was right or not; None when both are as Megatron's. ``shape``: the operators the block could
    have at its entry and at its exit, and the right pair (:data:`BLOCK`, :data:`ROW_LAYER`,
    :data:`COLUMN_LAYER`)."""
    entries, exits, right = shape
    want = counts_of(*right)
    if got == want and is_output_right:
        return None
    said = (
        f"forward ran {got[0]} all-reduce(s) and backward {got[1]}; expected {want[0]} in "
        f"forward and {want[1]} in backward"
    )
    fits = [
        (e, x)
        for e, x in product(entries, exits)
        if counts_of(e, x) == got and output_right(e, x, right[1]) == is_output_right
        and (e, x) != right
    ]  # fmt: skip
    if got == want:
        listed = "; ".join(f"entry {e}, exit {x}" for e, x in fits)
        return (
            f"forward ran {got[0]} all-reduce(s) and backward {got[1]}, as Megatron's "
            "does, yet the output differs: the difference is in the values "
            "(the shards, or what runs between the operators)"
            + (f", or in the operators' places (this also fits: {listed})" if listed else "")
        )
    if len(fits) == 1:
        return f"{said}: this is {_named(*fits[0], right)}"
    if fits:
        listed = "; ".join(f"entry {e}, exit {x}" for e, x in fits)
        return f"{said}: the operators' places that give this are, one of: {listed}"
    return (
        f"{said}: no placement of f and g at the entry and exit gives this; look for an "
        "all-reduce called directly, or one that runs twice"
    )
