"""Exercise 3.1, the ring all-reduce: ``dist.all_reduce``'s result, the two halves equal to
``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor``, the same bits on every rank,
2(n-1)/n·S bytes per rank sent only to the right-hand neighbour, and bad input refused before
any message.

Worlds of 2, 3, 4 and 5 (odd ones included: with 2 ranks left and right are the same rank and a
wrong direction cannot show), sizes 1, smaller than the world, not divisible by it and larger,
float32/float64/bfloat16/int64, SUM/MAX/MIN/PRODUCT; 64 MiB once, on 2 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise
from phase3_helpers import (
    counted,
    differs,
    fail,
    first_problems,
    integer_valued,
    module,
    random_float_problems,
    receives,
    sends,
    sizes_for,
    small_world,
    values_problems,
)

from course.comm_counter import CommCounter


def ring() -> Any:
    return module("ring_allreduce")


# ----------------------------------------------------------------------------- chunk bounds


@exercise("3.1")
def test_chunk_bounds_are_the_pieces_of_tensor_split() -> None:
    chunk_bounds = ring().chunk_bounds
    for n in range(1, 6):
        for numel in [*range(0, 13), 64, 1001]:
            expected, start = [], 0
            for piece in torch.tensor_split(torch.arange(numel), n):
                expected.append((start, start + piece.numel()))
                start += piece.numel()
            got = [tuple(b) for b in chunk_bounds(numel, n)]
            if got != expected:
                covered = got[-1][1] if got else None
                extra = ""
                if covered is not None and covered != numel:
                    extra = f": the last chunk stops at {covered}, the tensor has {numel} elements"
                fail(
                    f"3.1 chunk_bounds({numel}, {n}) returned {got}; expected {expected} (the "
                    "pieces of torch.tensor_split: sizes differ by at most one, the first "
                    f"numel % n = {numel % n} chunks are the longer ones){extra}"
                )


# ----------------------------------------------------------------------------- values


def values_worker() -> list[str]:
    n = dist.get_world_size()
    problems = values_problems(ring().ring_all_reduce, "ring_all_reduce", sizes_for(n))
    return problems or random_float_problems(ring().ring_all_reduce)


@exercise("3.1")
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_ring_all_reduce_equals_dist_all_reduce(world_size: int) -> None:
    results = small_world(values_worker, world_size)
    first_problems(
        [p for rank_problems in results for p in rank_problems],
        f"3.1 ring_all_reduce on {world_size} ranks, compared with dist.all_reduce:",
    )


def halves_worker() -> list[str]:
    mod = ring()
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(3 + rank)
    for dtype in (torch.float32, torch.int64):
        for per_rank in (1, 5):  # sizes that divide by n: what torch's collectives accept
            data = integer_valued(g, per_rank * n, dtype)
            before = data.clone()
            got = mod.reduce_scatter_ring(data)
            ref = torch.empty(per_rank, dtype=dtype)
            dist.reduce_scatter_tensor(ref, before.clone())
            if not torch.equal(got, ref):
                problems.append(
                    f"reduce_scatter_ring on rank {rank}, {per_rank * n} elements, {dtype}: "
                    f"dist.reduce_scatter_tensor gives rank {rank} chunk {rank} = {ref.tolist()}, "
                    f"got {got.tolist()} (rank r must end with chunk r)"
                )
            if not torch.equal(data, before):
                problems.append(
                    "reduce_scatter_ring changed its input without inplace=True: work on a copy"
                )
            chunk = integer_valued(g, per_rank, dtype)
            out = torch.full((per_rank * n,), -99, dtype=dtype)
            returned = mod.all_gather_ring(chunk, out)
            ref_out = torch.empty(per_rank * n, dtype=dtype)
            dist.all_gather_into_tensor(ref_out, chunk)
            if not torch.equal(out, ref_out):
                problems.append(
                    f"all_gather_ring on rank {rank}, {per_rank * n} elements, {dtype}: differs "
                    f"from dist.all_gather_into_tensor {differs(out, ref_out)}"
                )
            if returned is not out:
                problems.append("all_gather_ring must return out")
    # a size that does not divide: rank r's chunk of the all-reduce, as chunk_bounds cuts it
    data = integer_valued(g, 2 * n + 1, torch.float64)
    ref = data.clone()
    dist.all_reduce(ref)
    start, stop = mod.chunk_bounds(2 * n + 1, n)[rank]
    got = mod.reduce_scatter_ring(data)
    if not torch.equal(got, ref[start:stop]):
        problems.append(
            f"reduce_scatter_ring on rank {rank}, {2 * n + 1} elements: expected elements "
            f"{start}..{stop - 1} of the sum, {ref[start:stop].tolist()}, got {got.tolist()}"
        )
    out = torch.zeros(2 * n + 1, dtype=torch.float64)
    mod.all_gather_ring(ref[start:stop].clone(), out)
    if not torch.equal(out, ref):
        problems.append(
            f"all_gather_ring on rank {rank}, {2 * n + 1} elements: {differs(out, ref)}"
        )
    return problems


@exercise("3.1")
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_halves_equal_reduce_scatter_tensor_and_all_gather_into_tensor(
    world_size: int,
) -> None:
    results = small_world(halves_worker, world_size)
    first_problems(
        [p for rank_problems in results for p in rank_problems],
        f"3.1 the two halves of the ring on {world_size} ranks:",
    )


def large_worker(numel: int) -> bool:
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(-8, 9, (numel,), generator=g).float()
    ref = data.clone()
    ring().ring_all_reduce(data)
    dist.all_reduce(ref)
    return torch.equal(data, ref)


@exercise("3.1")
def test_64_mib_on_two_ranks() -> None:
    numel = 16 * 2**20  # 64 MiB of float32
    if not all(small_world(large_worker, 2, numel)):
        fail(
            "3.1 ring_all_reduce of 64 MiB (float32, integer-valued) on 2 ranks: differs from "
            "dist.all_reduce (small sizes pass: look at how segments or buffers are reused)"
        )


# ----------------------------------------------------------------------------- bytes and peers


def bytes_worker(numel: int) -> dict[str, Any]:
    tensor = torch.ones(numel, dtype=torch.float32)
    counter = counted(lambda: ring().ring_all_reduce(tensor))
    return {
        "sent": sum(r.nbytes for r in sends(counter)),
        "received": sum(r.nbytes for r in receives(counter)),
        "to": sorted({r.peer for r in sends(counter)}),
        "from": sorted({r.peer for r in receives(counter)}),
        "collectives": sorted({r.op for r in counter.records if not r.is_point_to_point}),
    }


@exercise("3.1")
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_sends_2_n_minus_1_over_n_of_the_tensor_to_its_right(world_size: int) -> None:
    n = world_size
    for numel in (1000, 1001):  # 1001 does not divide by 4: chunks of 251 and 250
        size = numel * 4
        pieces = [p.numel() * 4 for p in torch.tensor_split(torch.empty(numel), n)]
        for rank, seen in enumerate(small_world(bytes_worker, n, numel)):
            # reduce-scatter sends every chunk but its own and receives every chunk but r-1's;
            # all-gather sends every chunk but r+1's and receives every chunk but its own
            expected = 2 * size - pieces[rank] - pieces[(rank + 1) % n]
            expected_in = 2 * size - pieces[(rank - 1) % n] - pieces[rank]
            rule = (
                f"2(n-1)/n·S = {2 * (n - 1) * size // n}"
                if numel % n == 0
                else f"S - |chunk {rank}| + S - |chunk {(rank + 1) % n}| = {expected} (and "
                f"receive S - |chunk {(rank - 1) % n}| + S - |chunk {rank}| = {expected_in})"
            )
            if seen["collectives"]:
                fail(
                    f"3.1 ring_all_reduce on {n} ranks: rank {rank} called {seen['collectives']}; "
                    "the ring is built from isend/irecv only"
                )
            if (seen["sent"], seen["received"]) != (expected, expected_in):
                fail(
                    f"3.1 ring_all_reduce on {n} ranks, S = {size} bytes: rank {rank} should send "
                    f"{rule} bytes; it sent {seen['sent']} and received {seen['received']}. Each "
                    "step moves one chunk (about S/n), not the tensor; a chunk index off by one "
                    "moves the wrong chunks."
                )
            right, left = (rank + 1) % n, (rank - 1) % n
            if seen["to"] != [right] or seen["from"] != [left]:
                fail(
                    f"3.1 ring_all_reduce on {n} ranks: rank {rank} sent to ranks {seen['to']} and "
                    f"received from {seen['from']}; in the ring it sends only to its right "
                    f"neighbour (r+1) % n = {right} and receives only from its left (r-1) % n = "
                    f"{left}"
                )


# ----------------------------------------------------------------------------- groups and input


def subgroup_worker() -> dict[str, Any]:
    """Ranks (1, 2, 3) of a world of 4 form the ring; rank 0 stays out."""
    group = dist.new_group([1, 2, 3])
    rank = dist.get_rank()
    if rank == 0:
        return {"skip": True}
    assert isinstance(group, dist.ProcessGroup)
    data = torch.arange(7, dtype=torch.float64) * (rank + 1)
    ref = data.clone()
    counter = counted(lambda: ring().ring_all_reduce(data, group=group))
    dist.all_reduce(ref, group=group)
    outside = [r.describe(rank) for r in counter.records if r.peer is not None and r.peer == 0]
    return {
        "skip": False,
        "ok": torch.equal(data, ref),
        "got": data,
        "ref": ref,
        "outside": outside,
    }


@exercise("3.1")
def test_ring_inside_a_group_of_three() -> None:
    results = small_world(subgroup_worker, 4)
    problems = []
    for rank, result in enumerate(results):
        if result["skip"]:
            continue
        if result["outside"]:
            problems.append(
                f"{result['outside'][0]}, but rank 0 is not in the group (1, 2, 3): peers of "
                "isend/irecv are GLOBAL ranks; map a group rank with dist.get_global_rank(group, r)"
            )
        if not result["ok"]:
            problems.append(
                f"rank {rank}: expected the group's sum {result['ref'].tolist()}, got "
                f"{result['got'].tolist()} (ranks and sizes come from dist.get_rank(group) and "
                "dist.get_world_size(group))"
            )
    first_problems(
        problems, "3.1 ring_all_reduce(tensor, group=group) on the group (1, 2, 3) of a world of 4:"
    )


def refusal_worker() -> list[str]:
    mod = ring()
    problems = []
    cases = [
        (
            "a non-contiguous tensor",
            lambda: mod.ring_all_reduce(torch.ones(4, 6).t()),
            "contiguous",
        ),
        (
            "op=ReduceOp.BAND",
            lambda: mod.ring_all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
            "SUM",
        ),
        (
            "a chunk of the wrong size to all_gather_ring",
            lambda: mod.all_gather_ring(torch.ones(3), torch.zeros(10)),
            "chunk",
        ),
    ]
    for what, call, word in cases:
        err: Exception | None = None
        with CommCounter() as counter:
            try:
                call()
            except (ValueError, TypeError) as caught:
                err = caught
        if err is None:
            problems.append(f"{what} must be refused with a ValueError; it was accepted")
        elif word.lower() not in str(err).lower():
            problems.append(f"the error for {what} should mention {word!r}: {err}")
        elif counter.records:
            problems.append(
                f"{what} was refused only after {counter.records[0].describe()}: check the "
                "arguments before any message, or the other ranks wait for ever"
            )
    return problems


@exercise("3.1")
def test_bad_input_is_refused_before_any_message() -> None:
    results = small_world(refusal_worker, 2)
    first_problems(results[0] + results[1], "3.1 bad input:")
