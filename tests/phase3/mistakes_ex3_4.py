"""What 3.4's namers know (issue 49; tests/mistake_tables.py runs these tables).

``assign_buckets``: tests/phase3/grade_3_4_ddp.py runs it on every graded case (61 of them,
``assignment_cases``) and hands the buckets to ``assignment_verdict``, which names a mistake
only when exactly one it knows gives those buckets on every case. Each mistake is planted here
by an assignment written apart from the grader's ``bucket_variant``, with the factors a learner
can get wrong; every mistake one factor away from a named one is planted as its neighbour.

Also tabled: what .grad holds after the all-reduces are waited for, what each bucket's
all-reduce is handed, the fp16 average (a gradient whose undivided sum overflows, and one that
tells an undivided sum from one divided after it), and no_sync() (the all-reduces per step, in a
nested block, after a block that raised).

Messages of 3.4 that need no table:

* _overlap_problems describes, names no cause (the measured order of gradients, launches and
  waits in one backward: no launch, a launch after the last gradient, a wait during backward, a
  bucket launched after the next one's gradients).
* _launch_order_problems describes, names no cause (the order the buckets were all-reduced in,
  against bucket order, on a model whose gradients arrive out of order).
* _step_problem lists the causes that fit, names none (the first step wrong: not averaged or
  not waited for; a later step wrong: state carried over, not reset or added to).
* the blocking all-reduce message describes, names no cause (async_op was not True).
* test_torch_comm_hooks_run_on_our_ddp's message lists the two causes that fit (the bucket not
  holding the raw gradients, a bucket not launched through self._launch), names none: it
  measures only how far the parameters are from torch's DDP with the same hook.
* no_sync's "differs from one process" message describes (counts right, values not), names no
  cause.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).parent),) if p not in sys.path]

import torch  # noqa: E402
from grade_3_4_ddp import (  # noqa: E402
    BUCKET_MISTAKES,
    CONTENT_SAY,
    FP16_GRAD,
    FP16_MISTAKES,
    GRAD_MISTAKES,
    NO_SYNC_MISTAKES,
    _content_problems,
    assignment_cases,
    assignment_verdict,
    fp16_verdict,
    grad_verdict,
    no_sync_verdict,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away  # noqa: E402

from solutions.phase3_multi_node.ddp_buckets import assign_buckets  # noqa: E402

Params = dict[str, Any]


def planted_assign(
    sizes: Sequence[int], limits: Sequence[int], kinds: Sequence[Any], params: Params
) -> list[list[int]]:
    """assign_buckets as a learner may write it (``params`` as in FACTORS)."""
    indices = list(range(len(sizes)))
    if params["walk"] == "backward":
        indices.reverse()
    filling: dict[Any, tuple[list[int], int]] = {}  # kind: (indices, bytes)
    done: list[tuple[Any, list[int]]] = []
    for i in indices:
        key = kinds[i] if params["kinds"] == "apart" else "all"
        members, nbytes = filling.get(key, ([], 0))
        members, nbytes = [*members, i], nbytes + sizes[i]
        if params["limit index"] == "per kind":
            k = sum(1 for kind, _ in done if kind == key)
        elif params["limit index"] == "all kinds":
            k = len(done)
        else:
            k = 0
        cap = limits[k] if k < len(limits) else limits[-1]
        full = nbytes > cap if params["close"] == "past" else nbytes >= cap
        if full:
            done.append((key, members))
            filling.pop(key, None)
        else:
            filling[key] = (members, nbytes)
    leftover = [members for members, _ in filling.values() if members]
    closed = [members for _, members in done]
    return closed + leftover if params["leftover"] == "last" else leftover + closed


FACTORS: dict[str, tuple[Any, ...]] = {
    "walk": ("backward", "forward"),
    "kinds": ("apart", "shared"),
    "limit index": ("per kind", "first", "all kinds"),
    "close": ("reach", "past"),
    "leftover": ("last", "first"),
}
RIGHT: Params = {
    "walk": "backward",
    "kinds": "apart",
    "limit index": "per kind",
    "close": "reach",
    "leftover": "last",
}
PLANTED: dict[str, Params] = {
    "registration order": {"walk": "forward"},
    "kinds share buckets": {"kinds": "shared"},
    "first limit only": {"limit index": "first"},
    "limits over all kinds": {"limit index": "all kinds"},
    "closes past the limit": {"close": "past"},
    "open buckets first": {"leftover": "first"},
}
CASES = assignment_cases()
CASE_LABELS = tuple(f"case {i}" for i in range(len(CASES)))


def measured(params: Params) -> list[list[list[int]]]:
    """What the grader measures: the buckets on every graded case."""
    return [planted_assign(sizes, limits, dtypes, params) for sizes, dtypes, limits in CASES]


def _separating_case(key: str) -> str:
    """The first graded case where ``key``'s buckets differ from every other named mistake's
    and from the right ones (computed, so the table says which case does the work)."""
    mine = measured({**RIGHT, **PLANTED[key]})
    others = [measured(RIGHT)] + [
        measured({**RIGHT, **change}) for other, change in PLANTED.items() if other != key
    ]
    for i in range(len(CASES)):
        if all(mine[i] != other[i] for other in others):
            return CASE_LABELS[i]
    return CASE_LABELS[0]


def _neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**RIGHT, **PLANTED[key]}
    out = []
    for factor, values in FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                out.append((", ".join(f"{f}={v}" for f, v in params.items()), measured(params)))
    return out


ASSIGN_BUCKETS = NamerTable(
    exercise="3.4",
    function="assign_buckets",
    factors=tuple(FACTORS),
    cases=CASE_LABELS,
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            _separating_case(key),
            BUCKET_MISTAKES[key][0],
        )
        for key, change in PLANTED.items()
    ),
    right=lambda: [assign_buckets(sizes, limits, dtypes) for sizes, dtypes, limits in CASES],
    plant=lambda key: measured({**RIGHT, **PLANTED[key]}),
    name=lambda got: assignment_verdict(CASES, got),
    neighbours=_neighbours,
)

# ----------------------------------------------------------------------------- .grad after wait

WORLD = 2  # test_gradients_are_read_only_after_waiting runs on 2 ranks
_g = torch.Generator().manual_seed(34)
LOCAL_GRADS = [torch.randn(5, 3, generator=_g, dtype=torch.float64) for _ in range(WORLD)]
GRAD_FACTORS: dict[str, tuple[Any, ...]] = {"divisions": (1, 0, 2), "waited": (True, False)}
GRAD_RIGHT: Params = {"divisions": 1, "waited": True}
GRAD_PLANTED: dict[str, Params] = {
    "summed, not averaged": {"divisions": 0},
    "divided twice": {"divisions": 2},
    "read before wait": {"waited": False},
    "read before wait, undivided": {"waited": False, "divisions": 0},
}


def grad_measured(params: Params) -> tuple[Any, ...]:
    """Rank 0's .grad after a backward whose buckets hold each rank's gradient times
    (1/world)**divisions and are read back after (or before) the all-reduce sums them; with
    what the grader compares it with: the average, rank 0's own gradient, the world size."""
    buckets = [g * (1.0 / WORLD) ** params["divisions"] for g in LOCAL_GRADS]
    summed = torch.stack(buckets).sum(0)
    grad = summed if params["waited"] else buckets[0]
    average = torch.stack(LOCAL_GRADS).sum(0) / WORLD
    return grad, average, LOCAL_GRADS[0], WORLD


def _grad_neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**GRAD_RIGHT, **GRAD_PLANTED[key]}
    out = []
    for factor, values in GRAD_FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, grad_measured(params)))
    return out


GRAD_AFTER_WAIT = NamerTable(
    exercise="3.4",
    function="DistributedDataParallel (.grad after backward, all-reduces finishing at wait())",
    factors=tuple(GRAD_FACTORS),
    cases=("2 ranks, rank 0",),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            "2 ranks, rank 0",
            GRAD_MISTAKES[key][0],
        )
        for key, change in GRAD_PLANTED.items()
    ),
    right=lambda: grad_measured(GRAD_RIGHT),
    plant=lambda key: grad_measured({**GRAD_RIGHT, **GRAD_PLANTED[key]}),
    name=lambda m: grad_verdict("0.weight", *m),
    neighbours=_grad_neighbours,
)

# ----------------------------------------------------------------------------- what is all-reduced

# test_buckets_are_all_reduced_once_each_as_soon_as_ready: 2 ranks, chain_mlp in buckets of
# 0.002 MB: two buckets of different sizes (what the grader records on rank 0 of one step)
BUCKET_NAMES = [["3.weight", "3.bias", "2.weight"], ["2.bias", "0.weight", "0.bias"]]
_shapes = {"3.weight": (5, 20), "3.bias": (5,), "2.weight": (20, 30), "2.bias": (20,),
           "0.weight": (30, 10), "0.bias": (30,)}  # fmt: skip
GRADS = {n: torch.randn(*shape, generator=_g, dtype=torch.float64) for n, shape in _shapes.items()}
CONTENT_FACTORS: dict[str, tuple[Any, ...]] = {
    "divisions before the sum": (1, 0, 2),
    "launch order": ("bucket order", "reversed"),
}
CONTENT_RIGHT: Params = {"divisions before the sum": 1, "launch order": "bucket order"}
CONTENT_PLANTED: dict[str, Params] = {
    "divided after the sum": {"divisions before the sum": 0},
    "divided twice": {"divisions before the sum": 2},
    "another bucket": {"launch order": "reversed"},
}


def content_measured(params: Params) -> list[torch.Tensor]:
    """What each dist.all_reduce call was handed, in call order."""
    handed = []
    for bucket in BUCKET_NAMES:
        flat = torch.cat([GRADS[n].reshape(-1) for n in bucket])
        handed.append(flat * (1.0 / WORLD) ** params["divisions before the sum"])
    return handed[::-1] if params["launch order"] == "reversed" else handed


def _content_neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**CONTENT_RIGHT, **CONTENT_PLANTED[key]}
    out = []
    for factor, values in CONTENT_FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, content_measured(params)))
    return out


def content_name(handed: list[torch.Tensor]) -> str | None:
    return "\n".join(_content_problems(handed, BUCKET_NAMES, GRADS, WORLD)) or None


BUCKET_CONTENTS = NamerTable(
    exercise="3.4",
    function="DistributedDataParallel (what each bucket's all-reduce is handed)",
    factors=tuple(CONTENT_FACTORS),
    cases=("2 ranks, 2 buckets, rank 0",),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            "2 ranks, 2 buckets, rank 0",
            CONTENT_SAY[key],
        )
        for key, change in CONTENT_PLANTED.items()
    ),
    right=lambda: content_measured(CONTENT_RIGHT),
    plant=lambda key: content_measured({**CONTENT_RIGHT, **CONTENT_PLANTED[key]}),
    name=content_name,
    neighbours=_content_neighbours,
)

# ----------------------------------------------------------------------------- fp16 average

# test_fp16_average_does_not_overflow: 2 ranks, each with the fp16 gradient FP16_GRAD
FP16_CASE = "2 ranks, fp16 gradients " + str(list(FP16_GRAD))
FP16_FACTORS: dict[str, tuple[Any, ...]] = {
    "divisions before the sum": (1, 0, 2),
    "divisions after the sum": (0, 1),
}
FP16_RIGHT: Params = {"divisions before the sum": 1, "divisions after the sum": 0}
FP16_PLANTED: dict[str, Params] = {
    "divided after the sum": {"divisions before the sum": 0, "divisions after the sum": 1},
    "summed, not averaged": {"divisions before the sum": 0},
    "divided twice": {"divisions before the sum": 2},
}


def fp16_measured(params: Params) -> torch.Tensor:
    """The .grad a learner's DDP leaves: each rank's fp16 gradient scaled into its bucket,
    the buckets summed in fp16 (torch.stack(...).sum rounds to fp16 like gloo), then scaled
    again (written apart from the grader's fp16_average). A tensor, not a list: the table's
    same_measurement compares tensors' infinities exactly, floats' by a relative tolerance."""
    params = {**FP16_RIGHT, **params}
    local = torch.tensor(FP16_GRAD, dtype=torch.float16)
    bucket = local * (1.0 / WORLD) ** params["divisions before the sum"]
    summed = torch.stack([bucket] * WORLD).sum(0)
    return (summed * (1.0 / WORLD) ** params["divisions after the sum"]).double()


FP16_AVERAGE = NamerTable(
    exercise="3.4",
    function="DistributedDataParallel (fp16 gradients averaged without overflow)",
    factors=tuple(FP16_FACTORS),
    cases=(FP16_CASE,),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            FP16_CASE,
            FP16_MISTAKES[key][0],
        )
        for key, change in FP16_PLANTED.items()
    ),
    right=lambda: fp16_measured(FP16_RIGHT),
    plant=lambda key: fp16_measured({**FP16_RIGHT, **FP16_PLANTED[key]}),
    name=lambda grad: fp16_verdict(grad.tolist(), WORLD),
    neighbours=lambda key: one_factor_away(
        FP16_PLANTED[key], FP16_PLANTED.values(), FP16_RIGHT, FP16_FACTORS, fp16_measured
    ),
)

# ----------------------------------------------------------------------------- no_sync

# test_no_sync_accumulates_and_all_reduces_once_per_step: chain_mlp in buckets of 0.002 MB (2),
# 3 steps of 3 micro-batches, then a nested no_sync() and one that raises
NO_SYNC_BUCKETS, NO_SYNC_STEPS, NO_SYNC_MICRO = 2, 3, 3
NO_SYNC_CASE = "2 ranks, 3 steps of 3 micro-batches, nested, raising"
NO_SYNC_FACTORS: dict[str, tuple[Any, ...]] = {
    "turns sync off": (True, False),
    "on exit": ("previous value", "True", "nothing"),
    "on a raise": ("exit runs (finally)", "exit skipped"),
}
NO_SYNC_RIGHT: Params = {
    "turns sync off": True,
    "on exit": "previous value",
    "on a raise": "exit runs (finally)",
}
NO_SYNC_PLANTED: dict[str, Params] = {
    "sync never off": {"turns sync off": False},
    "flag left off": {"on exit": "nothing"},
    "set back to True": {"on exit": "True"},
    "not restored on a raise": {"on a raise": "exit skipped"},
}


class _Flagged:
    """A DDP's synchronization flag and a no_sync() written with ``params``' choices; backward
    all-reduces every bucket when the flag is on (a simulation of no_sync_worker's run)."""

    def __init__(self, params: Params) -> None:
        self.params = {**NO_SYNC_RIGHT, **params}
        self.sync = True
        self.calls = 0

    def backward(self) -> None:
        self.calls += NO_SYNC_BUCKETS if self.sync else 0

    def no_sync(self, body: Any = None, raises: bool = False) -> None:
        previous = self.sync
        if self.params["turns sync off"]:
            self.sync = False

        def leave() -> None:
            if self.params["on exit"] == "previous value":
                self.sync = previous
            elif self.params["on exit"] == "True":
                self.sync = True

        if raises:
            if self.params["on a raise"] == "exit runs (finally)":
                leave()
            return
        if body is not None:
            body()
        leave()


def no_sync_measured(params: Params) -> tuple[list[int], int, bool]:
    ddp = _Flagged(params)
    calls = []
    for _ in range(NO_SYNC_STEPS):
        before = ddp.calls
        for _ in range(NO_SYNC_MICRO - 1):
            ddp.no_sync(ddp.backward)
        ddp.backward()
        calls.append(ddp.calls - before)
    ddp.no_sync(lambda: ddp.no_sync())  # with no_sync(), no_sync(): pass
    before = ddp.calls

    def inner_then_backward() -> None:
        ddp.no_sync()
        ddp.backward()

    ddp.no_sync(inner_then_backward)
    nested = ddp.calls - before
    ddp.no_sync(raises=True)
    return calls, nested, ddp.sync


NO_SYNC = NamerTable(
    exercise="3.4",
    function="DistributedDataParallel.no_sync",
    factors=tuple(NO_SYNC_FACTORS),
    cases=(NO_SYNC_CASE,),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            NO_SYNC_CASE,
            NO_SYNC_MISTAKES[key][0],
        )
        for key, change in NO_SYNC_PLANTED.items()
    ),
    right=lambda: no_sync_measured(NO_SYNC_RIGHT),
    plant=lambda key: no_sync_measured(NO_SYNC_PLANTED[key]),
    name=lambda m: no_sync_verdict(0, m[0], NO_SYNC_BUCKETS, NO_SYNC_STEPS, NO_SYNC_MICRO, *m[1:]),
    neighbours=lambda key: one_factor_away(
        NO_SYNC_PLANTED[key], NO_SYNC_PLANTED.values(), NO_SYNC_RIGHT, NO_SYNC_FACTORS,
        no_sync_measured,
    ),
)  # fmt: skip

TABLES = (ASSIGN_BUCKETS, GRAD_AFTER_WAIT, BUCKET_CONTENTS, FP16_AVERAGE, NO_SYNC)
