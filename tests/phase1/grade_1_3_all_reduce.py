"""Exercise 1.3, all-reduce from send and recv: the result of ``dist.all_reduce``, the bits of a
rank-order reduction on every rank, and the bytes each strategy predicts.

Both strategies run on worlds of 2, 3 and 4 with sizes smaller than the world, not divisible by
it, and large, in float32, float64 and int64, and with MAX, MIN and PRODUCT. Inputs of 10^r on
rank r count each contribution in the digits of the sum; every isend is watched, and its tensor
must not change before its Work is waited for. Random floats of
mixed magnitudes check the invariant exactly: every rank must hold the bits of
``((x0 + x1) + x2) + x3``, which a rank that adds in arrival order, or a root that starts from its
own tensor, does not. Inside the groups (0, 1) and (2, 3) of a world of 4, with ``root=1``, each
group must get its own sum and no message may leave its group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise
from phase1_helpers import (
    all_reduce_module,
    fail,
    first_problems,
    only_inside,
    run_in_subgroups,
    small_world,
)
from subgroups import SubgroupInfo

from course.comm_counter import CommCounter

STRATEGIES = ["reduce_broadcast_all_reduce", "direct_exchange_all_reduce"]


def sizes_for(world_size: int) -> list[int]:
    """1, smaller than the world, not divisible by it, and large."""
    return sorted({1, max(1, world_size - 1), 3 * world_size + 1, 2**16 + 3})


def all_reduce_worker(strategy: str) -> list[str]:
    fn = getattr(all_reduce_module(), strategy)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(1000 + rank)
    for size in sizes_for(world_size):
        for dtype in (torch.float32, torch.float64, torch.int64):
            # integer-valued inputs: every summation order gives the same bits
            data = torch.randint(-1000, 1000, (size,), generator=g).to(dtype)
            mine, ref = data.clone(), data.clone()
            out = fn(mine)
            dist.all_reduce(ref)
            if not torch.equal(mine, ref):
                bad = (mine != ref).nonzero().flatten()[:3].tolist()
                problems.append(
                    f"rank {rank}: size {size}, {dtype}: differs from dist.all_reduce at indices "
                    f"{bad}: expected {ref[bad].tolist()}, got {mine[bad].tolist()}"
                )
            if out is None or out.data_ptr() != mine.data_ptr():
                problems.append(
                    f"rank {rank}: size {size}: must reduce in place and return the input tensor"
                )
    for op_name in ("MAX", "MIN", "PRODUCT"):
        op = getattr(dist.ReduceOp, op_name)
        data = torch.randint(1, 4, (9,), generator=g).double()
        mine, ref = data.clone(), data.clone()
        fn(mine, op=op)
        dist.all_reduce(ref, op=op)
        if not torch.equal(mine, ref):
            problems.append(
                f"rank {rank}: op={op_name}: expected {ref.tolist()}, got {mine.tolist()}"
            )
    try:
        fn(torch.ones(4, 4).t())
        problems.append(f"rank {rank}: a non-contiguous tensor must be refused with a ValueError")
    except ValueError as err:
        if "contiguous" not in str(err):
            problems.append(f"the ValueError for a non-contiguous tensor should say so: {err}")
    return problems


@exercise("1.3")
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_reduce_equals_dist_all_reduce(strategy: str, world_size: int) -> None:
    results = small_world(all_reduce_worker, world_size, strategy)
    first_problems(
        [p for rank_problems in results for p in rank_problems],
        f"1.3 {strategy} on {world_size} ranks, compared with dist.all_reduce:",
    )


def census_worker(strategy: str, root: int) -> float:
    fn = getattr(all_reduce_module(), strategy)
    tensor = torch.full((7,), float(10 ** dist.get_rank()), dtype=torch.float64)
    fn(tensor, **({"root": root} if strategy == "reduce_broadcast_all_reduce" else {}))
    return float(tensor[0])


def contribution_counts(value: float, world_size: int) -> list[int] | None:
    """How many times each rank's 10^r is in ``value`` (None when it is no such sum)."""
    if value < 0 or value != int(value) or value >= 10**world_size * 10:
        return None
    digits = [int(value) // 10**r % 10 for r in range(world_size)]
    return digits if sum(d * 10**r for r, d in enumerate(digits)) == value else None


def census_remark(counts: list[int]) -> str:
    """What the digits of a rank's result say: whose contribution it counted how often, and
    the cause only where the counts single one out (one missing and one doubled: overwritten)."""
    missing = [r for r, c in enumerate(counts) if c == 0]
    twice = [r for r, c in enumerate(counts) if c > 1]
    said = ", ".join(f"rank {r}'s {c} time(s)" for r, c in enumerate(counts) if c != 1)
    if len(missing) == 1 and len(twice) == 1 and counts[twice[0]] == 2:
        why = (
            "one contribution was overwritten by another: each incoming tensor needs a place "
            "of its own, apart from the other incoming ones and from this rank's own tensor "
            "until that has been combined"
        )
    elif missing and twice:
        why = f"{len(missing)} contribution(s) missing and {len(twice)} counted more than once"
    elif missing:
        why = (
            f"{'a contribution was' if len(missing) == 1 else 'contributions were'} never "
            "received or never combined"
        )
    else:
        why = f"{'a contribution was' if len(twice) == 1 else 'contributions were'} combined "
        why += "more than once"
    return f"it counted {said}; {why}"


@exercise("1.3")
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_contribution_is_counted_once(strategy: str, world_size: int) -> None:
    root = world_size - 1
    problems = []
    for rank, value in enumerate(small_world(census_worker, world_size, strategy, root)):
        counts = contribution_counts(value, world_size)
        if counts == [1] * world_size:
            continue
        if counts is None:
            problems.append(f"rank {rank} ended with {value!r}, which is no sum of the inputs")
            continue
        problems.append(f"rank {rank} ended with {value:g}: {census_remark(counts)}")
    detail = f" (root={root})" if strategy == "reduce_broadcast_all_reduce" else ""
    first_problems(
        problems,
        f"1.3 {strategy}{detail} on {world_size} ranks, rank r's tensor all 10^r, so each digit "
        f"of the sum counts one rank's contribution (expected {'1' * world_size}):",
    )


class WatchedSend:
    """An isend's Work that checks, when waited for, that the tensor still holds what it held
    when the send was posted."""

    def __init__(self, work: Any, tensor: torch.Tensor, peer: Any, log: list[str]) -> None:
        self.work, self.tensor, self.peer, self.log = work, tensor, peer, log
        self.posted = tensor.clone()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.equal(self.tensor, self.posted):
            self.log.append(
                f"the tensor of its isend to rank {self.peer} changed before that send was "
                "waited for"
            )
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def in_flight_worker(strategy: str) -> list[str]:
    import torch.distributed.distributed_c10d as c10d

    fn = getattr(all_reduce_module(), strategy)
    log: list[str] = []
    original = c10d.isend

    def watched_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        peer = kwargs.get("dst", args[0] if args else kwargs.get("group_dst"))
        work = original(tensor, *args, **kwargs)
        return None if work is None else WatchedSend(work, tensor, peer, log)

    tensor = torch.arange(4099, dtype=torch.float64) * (dist.get_rank() + 1)
    saved = (dist.isend, c10d.isend)
    dist.isend = c10d.isend = watched_isend
    try:
        fn(tensor)
    finally:
        dist.isend, c10d.isend = saved
    return log


@exercise("1.3")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_tensor_changes_while_a_send_of_it_is_in_flight(strategy: str) -> None:
    problems = [
        f"rank {rank}: {remark}"
        for rank, log in enumerate(small_world(in_flight_worker, 3, strategy))
        for remark in log[:1]
    ]
    first_problems(
        problems,
        f"1.3 {strategy} on 3 ranks, every isend watched: a send may read its tensor until its "
        "Work completes, so a peer could receive part of the result instead of this rank's input:",
    )


def mixed_floats(g: torch.Generator, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values spread over six orders of magnitude: the order of additions shows."""
    scale = 10.0 ** torch.randint(-3, 4, (size,), generator=g)
    return (torch.randn(size, generator=g, dtype=torch.float64) * scale).to(dtype)


def rank_order_worker(strategy: str, root: int) -> list[str]:
    fn = getattr(all_reduce_module(), strategy)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(77 + rank)
    for dtype in (torch.float32, torch.float64):
        data = mixed_floats(g, 4099, dtype)
        inputs = [torch.empty_like(data) for _ in range(world_size)]
        dist.all_gather(inputs, data)
        expected = inputs[0].clone()
        for other in inputs[1:]:
            expected += other
        mine = data.clone()
        kwargs = {"root": root} if strategy == "reduce_broadcast_all_reduce" else {}
        fn(mine, **kwargs)
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        if not all(torch.equal(everyone[0], other) for other in everyone[1:]):
            differ = [r for r in range(world_size) if not torch.equal(everyone[0], everyone[r])]
            problems.append(
                f"{dtype}: ranks {differ} ended with different bits from rank 0's: reduce in the "
                "same order on every rank"
            )
        if not torch.equal(mine, expected):
            n_bad = int((mine != expected).sum())
            problems.append(
                f"rank {rank}, {dtype}: {n_bad} of {mine.numel()} values differ from "
                f"((x0 + x1) + x2) + ... in rank order (max difference "
                f"{float((mine - expected).abs().max()):.3e}); start from rank 0's contribution "
                "and add 1, 2, ... in turn, whichever rank you are (and whichever is the root)"
            )
    return problems


@exercise("1.3")
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_rank_holds_the_bits_of_a_rank_order_reduction(
    strategy: str, world_size: int
) -> None:
    root = world_size - 1  # a root that adds itself first would break the order
    results = small_world(rank_order_worker, world_size, strategy, root)
    detail = f" (root={root})" if strategy == "reduce_broadcast_all_reduce" else ""
    first_problems(
        sorted({p for rank_problems in results for p in rank_problems}),
        f"1.3 {strategy}{detail} on {world_size} ranks, random floats of mixed magnitude: floating "
        "point addition is not associative, so the invariant fixes the order:",
    )


def bytes_worker(strategy: str, numel: int) -> tuple[int, int]:
    fn = getattr(all_reduce_module(), strategy)
    tensor = torch.ones(numel, dtype=torch.float32)
    with CommCounter() as comm:
        fn(tensor)
    return comm.bytes_sent, comm.bytes_received


@exercise("1.3")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_sends_the_bytes_the_strategy_predicts(strategy: str, world_size: int) -> None:
    numel = 1000
    size = numel * 4
    n = world_size
    for rank, (sent, received) in enumerate(small_world(bytes_worker, world_size, strategy, numel)):
        if strategy == "reduce_broadcast_all_reduce":
            expected = (n - 1) * size if rank == 0 else size
            rule = "the root sends and receives (n-1)·S, every other rank S"
        else:
            expected = (n - 1) * size
            rule = "every rank sends its S bytes to each of the n-1 others"
        if (sent, received) != (expected, expected):
            fail(
                f"1.3 {strategy}, {n} ranks, S = {size} bytes: rank {rank} should send and receive "
                f"{expected} bytes ({rule}); it sent {sent} and received {received}. Call "
                "dist.send/isend/recv/irecv through the module so the counter sees them."
            )


def subgroup_worker(info: SubgroupInfo, strategy: str) -> dict[str, Any]:
    fn = getattr(all_reduce_module(), strategy)
    g = torch.Generator().manual_seed(500 + dist.get_rank())
    data = torch.randint(-1000, 1000, (37,), generator=g).double()
    mine, ref = data.clone(), data.clone()
    kwargs = {"root": 1} if strategy == "reduce_broadcast_all_reduce" else {}
    call = f"{strategy}(tensor, {'root=1, ' if kwargs else ''}group=group)"
    with only_inside(info, call) as counter:
        fn(mine, group=info.group, **kwargs)
    dist.all_reduce(ref, group=info.group)  # what a world of 2 gives
    return {"mine": mine, "ref": ref, "sent": counter.bytes_sent}


@exercise("1.3")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_reduce_inside_subgroups(strategy: str) -> None:
    results = run_in_subgroups(f"1.3 {strategy}", subgroup_worker, strategy)
    problems = []
    for rank, result in enumerate(results):
        if not torch.equal(result["mine"], result["ref"]):
            bad = (result["mine"] != result["ref"]).nonzero().flatten()[:3].tolist()
            problems.append(
                f"rank {rank} (group {(0, 1) if rank < 2 else (2, 3)}): expected its group's sum "
                f"{result['ref'][bad].tolist()} at indices {bad}, got {result['mine'][bad].tolist()}"
                " (the world's sum was right, so the causes that fit are the group's: a size "
                "or a rank taken from the world, where dist.get_world_size(group) and "
                "dist.get_rank(group) belong)"
            )
    first_problems(
        problems,
        f"1.3 {strategy} with group=, in the groups (0, 1) and (2, 3) of a world of 4 at once:",
    )
