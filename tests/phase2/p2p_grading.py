"""Shared pieces of the 2.4 and 2.5 graders (model and pipeline parallelism): worlds that fail
with a teacher's remark, torch errors translated, and runs inside two subgroups of a world of 4.

A learner's slip in point-to-point code rarely fails where it happens: a buffer of the wrong
dtype makes gloo abort the receiving process (signal 6), a forgotten ``requires_grad_()``
surfaces as "element 0 of tensors does not require grad", a wrong split as "mat1 and mat2
shapes cannot be multiplied". :func:`remarks` turns those, inside a rank, into what a teacher
would say; :func:`run` turns a dead or hung world into the same kind of sentence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import pytest
import torch.distributed as dist
from grading import world
from subgroups import SubgroupInfo, split_into_groups

from course.comm_counter import CommCounter, CommRecord
from course.world import RankDied, WorldHung

F = TypeVar("F", bound=Callable[..., Any])
SUBGROUP_WORLD, SUBGROUP_SIZE = 4, 2

DIED = (
    "gloo aborts a process (signal 6, 'Received data size doesn't match expected size') when a "
    "message is bigger than the buffer posted for it: allocate every receive buffer with the "
    "dtype AND the shape the header announced (decode_header(...).empty(device)), and receive "
    "the messages in the order they are sent (header, then data)"
)
# (piece of torch's message, what it means here)
KNOWN_ERRORS = [
    (
        "element 0 of tensors does not require grad",
        "the received activation does not require grad: call requires_grad_() on it before "
        "forward so its gradient can be sent back (a stage whose input needs no gradient and "
        "whose layers have no parameters has an output without a graph: skip its backward)",
    ),
    (
        "mat1 and mat2 shapes cannot be multiplied",
        "a layer got an input of the wrong shape: does every rank hold the layers the split "
        "gives it (the earlier ranks take the extra layers), and does each received tensor "
        "have the shape its header announced?",
    ),
    (
        "has to be contiguous",
        "a message must come from contiguous memory: send tensor.contiguous() (an activation "
        "after a transpose or a slice is not)",
    ),
    (
        "backward through the graph a second time",
        "a graph was backpropagated twice: is each stash entry used by exactly one backward?",
    ),
    (
        "Connection reset by peer",
        "a neighbour's process died in the middle of a message. " + DIED,
    ),
    (
        "'NoneType' object has no attribute",
        "a None was used as a tensor, often the .grad of a received activation that does not "
        "require grad (call requires_grad_() on it before forward) or a message that was "
        "never received",
    ),
]


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def remarks(label: str, known: Sequence[tuple[str, str]] = ()) -> Callable[[F], F]:
    """Decorate a rank's worker: a known torch error becomes ``label: <remark> (torch said:
    ...)`` as an AssertionError, which the world reports with the rank and the learner's line.
    ``known`` are (piece of torch's message, remark) pairs of this worker's own, tried before
    :data:`KNOWN_ERRORS` (what an error means depends on the code that ran)."""

    def decorate(worker: F) -> F:
        @functools.wraps(worker)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return worker(*args, **kwargs)
            except (RuntimeError, TypeError, AttributeError, ValueError) as exc:
                text = str(exc)
                for piece, remark in [*known, *KNOWN_ERRORS]:
                    if piece in text:
                        said = text.strip().splitlines()[0][:200]
                        remarked = AssertionError(f"{label}: {remark} (torch said: {said})")
                        # the learner's frames, down to the line that raised, stay in the report
                        raise remarked.with_traceback(exc.__traceback__) from exc
                raise

        return wrapped  # type: ignore[return-value]

    return decorate


def run(
    label: str, fn: Callable[..., Any], world_size: int, *args: Any, hang_hint: str = ""
) -> list[Any]:
    """``world(fn, world_size, *args)``; a rank killed by a signal or a hang fails the test
    with a remark (a rank's own exception is reported by the harness as it is)."""
    try:
        return world(fn, world_size, *args)
    except RankDied as exc:
        message = f"{label}: {exc}. {DIED}"
    except WorldHung as exc:
        message = f"{label}: the ranks hung. {hang_hint}\n{exc}"
    fail(message)  # outside the except block: no "during handling" chain in the report


# ----------------------------------------------------------------------------- subgroups


class _GuardedRecords(list[CommRecord]):
    """The records of a CommCounter that raises at the first call leaving the group."""

    def __init__(self, info: SubgroupInfo, what: str) -> None:
        super().__init__()
        self.info, self.what = info, what

    def append(self, record: CommRecord) -> None:
        super().append(record)
        if CommCounter(records=[record]).crossing(self.info.ranks):
            raise AssertionError(leaving_message(record, self.info, self.what))


def leaving_message(record: CommRecord, info: SubgroupInfo, what: str) -> str:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if record.is_point_to_point:
        why = (
            f"rank {record.peer} is not in the group. dst=/src= of send/recv are GLOBAL ranks "
            "even with group= given: pass group=group with group_dst=/group_src= (ranks within "
            "the group), or map a group rank r with dist.get_global_rank(group, r)"
        )
    elif record.group_ranks is None:
        why = (
            f"that call used the default group, all {world_size} ranks of the world: pass "
            "group=group, and ask the group for ranks and sizes (dist.get_rank(group))"
        )
    else:
        why = f"that group {record.group_ranks} reaches outside {info.ranks}"
    return (
        f"{what} inside the group {info.ranks} of a world of {world_size}: "
        f"{record.describe(rank)}, outside the group; {why}"
    )


@contextmanager
def only_inside(info: SubgroupInfo, what: str) -> Iterator[CommCounter]:
    """Count this rank's calls; raise AssertionError at the first one that leaves ``info``'s
    group, before it is sent, so the world fails with a message instead of hanging."""
    counter = CommCounter(records=_GuardedRecords(info, what))
    with counter:
        yield counter


def _subgroup_main(worker: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return worker(split_into_groups(SUBGROUP_SIZE), *args)


def run_in_subgroups(label: str, worker: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``worker(info, *args)`` on a world of 4 split into the groups (0, 1) and (2, 3)."""
    return run(
        label,
        _subgroup_main,
        SUBGROUP_WORLD,
        worker,
        args,
        hang_hint=(
            "Run in two groups of 2 at once (ranks 0-1 and 2-3 of a world of 4): inside a "
            "subgroup, ranks and sizes come from dist.get_rank(group) / "
            "dist.get_world_size(group), and every send/recv needs group= with a peer given as "
            "group_dst=/group_src= (or dst=/src= as a GLOBAL rank)."
        ),
    )
