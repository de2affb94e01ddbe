"""2.6's errors raised inside given code, reported at the learner's call that caused them.

A shard of the wrong shape passes through the learner's ``column_shard`` or ``row_shard`` without
complaint and only breaks later, in the given ``from_weights`` (``copy_`` of a [12, 4] tensor into
a [6, 8] weight): torch's message then points into the given code and the grader's worker, not
at the learner's function. :func:`shard_shape_problem` checks the shard's shape where it is made;
:func:`raised_at_learner` turns a shape or type error raised in given code into a message at the
innermost frame of a function the learner writes (one holding ``# TODO 2.6:``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from grading import defined_at, learner_todo_line


def shard_shape_problem(
    layers: Any, kind: str, weight: torch.Tensor, rank: int, n: int, fused_parts: int = 1
) -> str | None:
    """What is wrong with the shape of ``kind`` ("column" or "row") shard of ``weight`` that the
    learner's ``column_shard``/``row_shard`` returns, or None when it is the expected one."""
    out_features, in_features = weight.shape
    if kind == "column":
        shard = layers.column_shard(weight, rank, n, fused_parts=fused_parts)
        want = (out_features // n, in_features)
        function, split = layers.column_shard, "output features (dim 0)"
    else:
        shard = layers.row_shard(weight, rank, n)
        want = (out_features, in_features // n)
        function, split = layers.row_shard, "input features (dim 1)"
    if tuple(shard.shape) == want:
        return None
    return (
        f"{kind}_shard(weight of shape {list(weight.shape)}, rank={rank}, world_size={n}) "
        f"returned shape {list(shard.shape)}; expected {list(want)}: a {kind}-parallel layer "
        f"splits its {split}, and the given from_weights copies the shard into a weight of that "
        f"shape{defined_at(function)}"
    )


def raised_at_learner(build: Callable[[], Any], what: str) -> Any:
    """``build()``; a shape or type error it raises inside given code becomes an AssertionError
    that says what was called and points at the learner's innermost line, not at torch's."""
    try:
        return build()
    except (RuntimeError, TypeError) as exc:
        site = learner_todo_line(exc)
        if not site:
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AssertionError(
            f"{what} raised {type(exc).__name__} in the given code: {first}. The call that "
            f"handed it this came from your code{site}"
        ) from None
