"""Exercise 3.2, halving-doubling all-reduce (Rabenseifner): ``dist.all_reduce``'s result on
worlds of 2, 3, 4 and 5 (3 and 5 need the fold-in of the extra ranks), the same bits on every
rank, 2·log2(p) messages and 2(p-1)/p·S bytes per core rank, S in and S out for each folded pair.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise
from learner_calls import learner_world
from phase3_helpers import (
    counted,
    fail,
    first_problems,
    module,
    random_float_problems,
    receives,
    sends,
    sizes_for,
    values_problems,
)
from phase3_helpers import (
    small_world as world_of_ranks,
)

from course import p2p_ledger
from course.world import RankDied, WorldHung

# an error a rank raises in given code is reported at the learner's call that caused it
small_world = learner_world(world_of_ranks, "3.2")


def halving_doubling() -> Any:
    return module("tree_allreduce").halving_doubling_all_reduce


FOLD_BACK_MISSING = "The fold-in's way back is missing"
PAIRING_NOT_MUTUAL = "Partners that do not choose each other"


def fold_hang_note(exc: WorldHung, world_size: int) -> str:
    """A specific cause when a folded rank waits for a result its partner went on without
    sending back, or when two ranks wait on each other's partners (a pairing that is not
    mutual). A partner still blocked in a message of its own (with a core partner, say) is
    no evidence about the way back; one that went on (finished, or waiting in a collective
    such as the grader's reference all-reduce) is."""
    extra = world_size - (1 << (world_size.bit_length() - 1))
    for rank in exc.hung:
        op = p2p_ledger.waiting_on(exc.pending.get(rank, ()))
        if op is None or op.is_send or op.peer != rank + 1 or rank % 2 or rank >= 2 * extra:
            continue
        if p2p_ledger.waiting_on(exc.pending.get(rank + 1, ())) is None:
            return (
                f"{FOLD_BACK_MISSING}: rank {rank} (folded) waits for the result from its "
                f"partner {rank + 1}, which went on without sending it. At the end each odd "
                "rank below 2e sends the reduced tensor back to its even partner."
            )
    return pairing_hang_note(exc, frozenset(range(0, 2 * extra, 2)))


def pairing_hang_note(exc: WorldHung, folded: frozenset[int] = frozenset()) -> str:
    """Rank a waits on b while b waits on c != a: the partners of a step did not choose each
    other. A ``folded`` rank waits on its fold-in partner, not on a step's partner: it is no
    witness."""
    waits = {rank: p2p_ledger.waiting_on(exc.pending.get(rank, ())) for rank in exc.hung}
    for rank, op in waits.items():
        if op is None or op.peer is None or rank in folded:
            continue
        other = waits.get(op.peer)
        if other is None or other.peer is None or other.peer == rank:
            continue
        return (
            f"{PAIRING_NOT_MUTUAL}: rank {rank} waits on its partner "
            f"{op.peer}, whose partner at the same step is {other.peer}. At every halving and "
            "doubling step the pairing must be mutual (if a's partner is b, b's partner is a), "
            "and the two must be responsible for the same range."
        )
    return ""


BLOCKS = (
    "in halving-doubling on p ranks, rank r ends the halving holding block r (of p) reduced, "
    "and the doubling copies the other blocks back"
)


def blocks_diagnosis(data: torch.Tensor) -> list[str]:
    """On a power-of-two world: is each rank's own block right (the halving worked) and only
    the blocks the doubling brings back wrong, or is its own block wrong already?"""
    n = dist.get_world_size()
    if n & (n - 1) or data.numel() % n:
        return []
    mine, total = data.clone(), data.clone()
    halving_doubling()(mine)
    dist.all_reduce(total)
    wrong = [
        i
        for i, (a, b) in enumerate(zip(mine.tensor_split(n), total.tensor_split(n), strict=True))
        if not torch.equal(a, b)
    ]
    everyone: list[list[int]] = [[] for _ in range(n)]
    dist.all_gather_object(everyone, wrong)
    return blocks_verdict(everyone)


# What the blocks each rank holds wrong show, and the words each verdict uses
# (tests/phase3/mistakes_ex3_2.py plants the mistakes that lead to each).
BLOCKS_SAY = {
    "nothing came back": (
        "every rank holds its own block right and every other block wrong: nothing came back, "
        "so the doubling did not run (after the halving, replay its steps in reverse order, "
        "d = 1, 2, ..., p/2, each pair exchanging the range it kept for the range it gave up)"
    ),
    "some came back wrong": (
        "every rank's own block (block r on rank r, what the halving leaves it) is right, "
        "and only some blocks the doubling should bring back are wrong: replay the halving's "
        "steps in reverse order (d = 1, 2, ..., p/2), each pair exchanging the range it kept "
        "for the range it gave up at that step"
    ),
    "own block wrong": (
        "hold a wrong own block (block r on rank r, what the halving leaves it): at each "
        "halving step both partners must split the current range at the same middle, the "
        "lower rank keep the lower half, send the other half and reduce what it receives into "
        "the half it keeps"
    ),
}


def blocks_verdict(everyone: list[list[int]]) -> list[str]:
    """Which part of halving-doubling is wrong, from the blocks (of p) each rank holds wrong
    after it on a power-of-two world (``everyone[r]``: rank r's wrong blocks)."""
    n = len(everyone)
    if not any(everyone):
        return []
    own_wrong = [r for r, bad in enumerate(everyone) if r in bad]
    if own_wrong:
        return [f"ranks {own_wrong} {BLOCKS_SAY['own block wrong']}"]
    if all(sorted(bad) == [b for b in range(n) if b != r] for r, bad in enumerate(everyone)):
        return [BLOCKS_SAY["nothing came back"]]
    return [BLOCKS_SAY["some came back wrong"]]


def values_worker() -> list[str]:
    n = dist.get_world_size()
    fn = halving_doubling()
    problems = values_problems(
        fn,
        "halving_doubling_all_reduce",
        sizes_for(n),
        diagnose=blocks_diagnosis,
        chunk_meaning=BLOCKS,
    )
    return problems or (random_float_problems(fn) if n in (3, 4) else [])


@exercise("3.2")
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_halving_doubling_equals_dist_all_reduce(world_size: int) -> None:
    fold = (
        f" ({world_size} is not a power of two: ranks 0..{2 * (world_size - 2 ** (world_size.bit_length() - 1)) - 1} "
        "fold in pairwise first)"
        if world_size & (world_size - 1)
        else ""
    )
    hint = (
        f"3.2 on {world_size} ranks{fold}: partners r XOR d must be core ranks; a rank paired "
        "with a rank that does not take part fails or waits for ever."
        if fold
        else ""
    )
    try:
        results = small_world(
            values_worker,
            world_size,
            hint=hint,
            hang_note=lambda exc: fold_hang_note(exc, world_size),
        )
    except RankDied as exc:
        if exc.exitcode != -6:  # not SIGABRT: not gloo's check on message sizes
            raise
        exc.args = (SIGABRT_NOTE + "\n" + str(exc),)
        raise
    first_problems(
        [p for rank_problems in results for p in rank_problems],
        f"3.2 halving_doubling_all_reduce on {world_size} ranks{fold}, compared with "
        "dist.all_reduce:",
    )


# A rank that died of SIGABRT: the signal alone does not say which exchange sent the message of
# the wrong size, so the note lists the causes that fit (mistakes_ex3_2.py's docstring).
SIGABRT_NOTE = (
    "3.2: a rank was aborted (SIGABRT). gloo aborts a rank when a receive gets a message of "
    "another size than it posted; causes that fit in halving-doubling: the two partners of a "
    "step disagree on the ranges they exchange (both must split [lo, hi) at the same middle, "
    "rounded the same way, and give and keep complementary halves), or a fold-in message is "
    "not the whole tensor on both ends."
)


def bytes_worker(numel: int) -> dict[str, Any]:
    tensor = torch.ones(numel, dtype=torch.float32)
    counter = counted(lambda: halving_doubling()(tensor))
    return {
        "sent": sum(r.nbytes for r in sends(counter)),
        "received": sum(r.nbytes for r in receives(counter)),
        "messages": len(sends(counter)),
    }


def expected_traffic(rank: int, n: int, size: int) -> tuple[int, int, str]:
    """(bytes sent, messages sent, why) for a tensor of ``size`` bytes that divides by p."""
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    steps = p.bit_length() - 1
    core = 2 * (p - 1) * size // p
    if rank < 2 * extra and rank % 2 == 0:
        return size, 1, f"rank {rank} folds in: it sends its whole tensor (S) to rank {rank + 1}"
    if rank < 2 * extra:
        return (
            core + size,
            2 * steps + 1,
            f"rank {rank} takes rank {rank - 1}'s tensor, runs the core (2(p-1)/p·S in "
            f"2·log2(p) = {2 * steps} messages) and sends the result (S) back",
        )
    return core, 2 * steps, f"a core rank sends 2(p-1)/p·S in 2·log2(p) = {2 * steps} messages"


HD_WORLDS = (3, 4)  # 3 folds one pair in, 4 is a power of two
HD_NUMEL = 1024  # float32


def hd_traffic(n: int, size: int, plan: str = "right") -> list[tuple[int, int, int]]:
    """Per rank (bytes sent, bytes received, messages sent) for a tensor of ``size`` bytes on
    ``n`` ranks: halving-doubling (``plan`` "right"), or one of HD_TRAFFIC_MISTAKES."""
    if plan == "ring":
        numel = size // 4
        chunks = [p.numel() * 4 for p in torch.tensor_split(torch.empty(numel), n)]
        return [
            (
                2 * size - chunks[r] - chunks[(r + 1) % n],
                2 * size - chunks[(r - 1) % n] - chunks[r],
                2 * (n - 1),
            )
            for r in range(n)
        ]
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1
    core = {
        "right": (2 * (p - 1) * size // p, 2 * steps),
        "whole tensor per step": (steps * size, steps),
        "halving only": ((p - 1) * size // p, steps),
    }[plan]
    extra = n - p
    out = []
    for rank in range(n):
        if rank < 2 * extra and rank % 2 == 0:
            out.append((size, size, 1))
        elif rank < 2 * extra:
            out.append((core[0] + size, core[0] + size, core[1] + 1))
        else:
            out.append((core[0], core[0], core[1]))
    return out


# The realistic mistakes whose traffic differs from halving-doubling's, and the words a failure
# uses when exactly one gives every rank's bytes and messages on 3 and on 4 ranks
# (tests/phase3/mistakes_ex3_2.py plants each and its neighbours).
HD_TRAFFIC_MISTAKES: dict[str, str] = {
    "ring": (
        "every rank's counts are a ring's (2(n-1) messages of about S/n): halving-doubling's "
        "point is log2(p) steps each way, each moving half of the range before"
    ),
    "whole tensor per step": (
        "every step sent the whole tensor (recursive doubling): at each halving step a rank "
        "sends the half of its range it gives up, and the doubling sends back what it kept"
    ),
    "halving only": (
        "only the halving's messages went out: the doubling sends as many again, each pair "
        "exchanging the range it kept for the range it gave up"
    ),
}


def hd_traffic_verdict(seen: dict[int, list[dict[str, Any]]]) -> str | None:
    """The failure of the bytes-and-messages test (None: halving-doubling's traffic), given
    what every rank sent, received and how many messages, on each world size."""
    got = {
        n: [(r["sent"], r["received"], r["messages"]) for r in ranks] for n, ranks in seen.items()
    }
    size = HD_NUMEL * 4
    fits = [
        key for key in HD_TRAFFIC_MISTAKES if all(got[n] == hd_traffic(n, size, key) for n in got)
    ]
    if len(fits) == 1:
        cause = f" On 3 and 4 ranks {HD_TRAFFIC_MISTAKES[fits[0]]}."
    elif fits:
        cause = f" The counts fit more than one mistake: {', or '.join(fits)}."
    else:
        cause = ""
    for n, ranks in got.items():
        for rank, (sent, received, messages) in enumerate(ranks):
            want_sent, want_messages, why = expected_traffic(rank, n, size)
            if (sent, received) != (want_sent, want_sent):
                return (
                    f"3.2 on {n} ranks, S = {size} bytes: rank {rank} should send and receive "
                    f"{want_sent} bytes ({why}); it sent {sent} and received {received}."
                    + (cause or f" ({sent / want_sent:.4g} times the bytes it should send)")
                )
            if messages != want_messages:
                return (
                    f"3.2 on {n} ranks: rank {rank} should send {want_messages} messages "
                    f"({why}); it sent {messages}." + cause
                )
    return None


@exercise("3.2")
def test_bytes_and_messages_follow_the_halving_doubling_formula() -> None:
    seen = {n: small_world(bytes_worker, n, HD_NUMEL) for n in HD_WORLDS}
    problem = hd_traffic_verdict(seen)
    if problem:
        fail(problem)


def subgroup_worker() -> dict[str, Any]:
    group = dist.new_group([1, 2, 3])
    assert (
        isinstance(group, dist.ProcessGroup) or dist.get_rank() == 0
    )  # three ranks: the fold-in runs inside the group
    rank = dist.get_rank()
    if rank == 0:
        return {"skip": True}
    assert isinstance(group, dist.ProcessGroup)
    data = torch.arange(9, dtype=torch.float64) * (rank + 1)
    ref = data.clone()
    counter = counted(lambda: halving_doubling()(data, group=group))
    dist.all_reduce(ref, group=group)
    outside = [r.describe(rank) for r in counter.records if r.peer == 0]
    return {
        "skip": False,
        "ok": torch.equal(data, ref),
        "got": data,
        "ref": ref,
        "outside": outside,
    }


@exercise("3.2")
def test_halving_doubling_inside_a_group_of_three() -> None:
    problems = []
    hint = (
        "3.2 in the group (1, 2, 3) of a world of 4, a rank failed: most likely a message named "
        "a rank as the wrong kind of number. Partners and fold-in peers are computed as core "
        "or group ranks; dst= and src= of a send or receive take global ranks"
    )
    for rank, result in enumerate(small_world(subgroup_worker, 4, hint=hint)):
        if result["skip"]:
            continue
        if result["outside"]:
            problems.append(
                f"{result['outside'][0]}, but rank 0 is not in the group (1, 2, 3): map group "
                "ranks (partners, fold-in peers) with dist.get_global_rank(group, r)"
            )
        elif not result["ok"]:
            problems.append(
                f"rank {rank}: expected the group's sum {result['ref'].tolist()}, got "
                f"{result['got'].tolist()}"
            )
    first_problems(
        problems,
        "3.2 halving_doubling_all_reduce(tensor, group=group) on the group "
        "(1, 2, 3) of a world of 4:",
    )
