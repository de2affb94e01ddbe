"""What 3.1's namers know (issue 49; tests/mistake_tables.py runs these tables).

* ``ring_all_reduce``'s traffic: tests/phase3/grade_3_1_ring.py counts what every rank sends
  and receives, and to whom, on 2 and on 4 ranks (1000 and 1001 float32 elements, so chunks of
  251 and 250 bytes show a chunk index one off), and ``traffic_verdict`` names a mistake only
  when exactly one it knows gives all of it. Each mistake is planted here by a step-by-step
  simulation of the messages (written apart from the grader's ``ring_traffic``).
* which half is wrong (``halves_verdict``): the values test runs each half alone on the
  failing input; here the halves are simulated on integer values, on 3 and 4 ranks.
* which part crashes (``crash_verdict``): after ring_all_reduce crashed or hung, each half runs
  alone on the same world; ``crash_words`` names the half that fails alone, or the composition
  when both work, and says "both halves" when both fail.

Messages of 3.1 that need no table:

* ring_hang_note names a cause only when every hung rank waits the same way (tags crossed, all
  in an all-gather receive, all in an all-gather send, none matched); its unit tests in
  tests/test_hang_notes_phase3.py plant each and every hang one factor away (a hang spans the
  world it ran on, so it is written there as ledgers by hand, not as a table here).
* the 64 MiB size note describes, names no cause: whether 1000 elements pass in the same run,
  and the places to look that fit each answer (segments, receive buffers reused; or the values
  test's message).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).parent),) if p not in sys.path]

import torch  # noqa: E402
from grade_3_1_ring import (  # noqa: E402
    CRASH_SAY,
    GLOBAL_RANK_ADVICE,
    GROUP_ADVICE,
    GROUPS,
    HALVES_SAY,
    TRAFFIC_MISTAKES,
    TRAFFIC_NUMELS,
    TRAFFIC_WORLDS,
    crash_words,
    group_advice,
    halves_verdict,
    traffic_verdict,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away  # noqa: E402

Params = dict[str, Any]


def _chunk_bytes(numel: int, n: int) -> list[int]:
    base, extra = divmod(numel, n)
    return [4 * (base + (1 if i < extra else 0)) for i in range(n)]


def simulated_traffic(n: int, numel: int, params: Params) -> list[dict[str, Any]]:
    """Every message of a ring written with ``params``, rank by rank and step by step, summed
    as the grader's CommCounter sums them: bytes of each isend, bytes of each irecv posted."""
    chunk = _chunk_bytes(numel, n)
    nbytes = (lambda c: 4 * numel) if params["unit"] == "tensor" else (lambda c: chunk[c % n])
    steps = {"n-1": n - 1, "n": n, "n-2": n - 2}[params["steps"]]
    step_dir = 1 if params["direction"] == "right" else -1
    records: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]  # (op, peer, bytes)
    for r in range(n):
        right, left = (r + step_dir) % n, (r - step_dir) % n
        first_sent = {"every chunk but its own": r - 1, "one ahead": r, "one behind": r - 2}
        rs_first = first_sent[params["reduce-scatter index"]]
        for s in range(steps):
            records[r].append(("isend", right, nbytes(rs_first - s)))
            records[r].append(("irecv", left, nbytes(rs_first - 1 - s)))
        if params["halves"] == "both":
            ag_first = {"own chunk first": r, "one behind": r - 1, "one ahead": r + 1}
            first = ag_first[params["all-gather index"]]
            for s in range(steps):
                records[r].append(("isend", right, nbytes(first - s)))
                records[r].append(("irecv", left, nbytes(first - 1 - s)))
    return [
        {
            "sent": sum(b for op, _, b in mine if op == "isend"),
            "received": sum(b for op, _, b in mine if op == "irecv"),
            "to": sorted({p for op, p, _ in mine if op == "isend"}),
            "from": sorted({p for op, p, _ in mine if op == "irecv"}),
            "collectives": [],
        }
        for mine in records
    ]


def traffic_measured(params: Params) -> dict[int, dict[int, list[dict[str, Any]]]]:
    return {n: {numel: simulated_traffic(n, numel, params) for numel in TRAFFIC_NUMELS}
            for n in TRAFFIC_WORLDS}  # fmt: skip


TRAFFIC_FACTORS: dict[str, Sequence[Any]] = {
    "unit": ("chunk", "tensor"),
    "steps": ("n-1", "n", "n-2"),
    "reduce-scatter index": ("every chunk but its own", "one ahead", "one behind"),
    "all-gather index": ("own chunk first", "one behind", "one ahead"),
    "halves": ("both", "reduce-scatter only"),
    "direction": ("right", "left"),
}
TRAFFIC_RIGHT: Params = {factor: values[0] for factor, values in TRAFFIC_FACTORS.items()}
TRAFFIC_PLANTED: dict[str, Params] = {
    "whole tensor per step": {"unit": "tensor"},
    "n steps per half": {"steps": "n"},
    "chunk index one ahead": {"reduce-scatter index": "one ahead", "all-gather index": "one ahead"},
    "reduce-scatter only": {"halves": "reduce-scatter only"},
}
TRAFFIC_CASES = tuple(
    f"{n} ranks, {numel} elements" for n in TRAFFIC_WORLDS for numel in TRAFFIC_NUMELS
)
TRAFFIC_SEPARATED_BY = {
    "whole tensor per step": "4 ranks, 1000 elements",  # on 2 ranks: as n steps per half
    "n steps per half": "4 ranks, 1000 elements",
    "chunk index one ahead": "4 ranks, 1001 elements",
    "reduce-scatter only": "2 ranks, 1000 elements",
}


def _neighbours(
    right: Params, planted: dict[str, Params], factors: dict[str, Sequence[Any]], measure: Any
) -> Any:
    def generate(key: str) -> list[tuple[str, Any]]:
        base = {**right, **planted[key]}
        out = []
        for factor, values in factors.items():
            for value in values:
                if value != base[factor]:
                    params = {**base, factor: value}
                    out.append((", ".join(f"{f}={v}" for f, v in params.items()), measure(params)))
        return out

    return generate


RING_TRAFFIC = NamerTable(
    exercise="3.1",
    function="ring_all_reduce (bytes and peers)",
    factors=tuple(TRAFFIC_FACTORS),
    cases=TRAFFIC_CASES,
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            TRAFFIC_SEPARATED_BY[key],
            TRAFFIC_MISTAKES[key][0],
        )
        for key, change in TRAFFIC_PLANTED.items()
    ),
    right=lambda: traffic_measured(TRAFFIC_RIGHT),
    plant=lambda key: traffic_measured({**TRAFFIC_RIGHT, **TRAFFIC_PLANTED[key]}),
    name=traffic_verdict,
    neighbours=_neighbours(TRAFFIC_RIGHT, TRAFFIC_PLANTED, TRAFFIC_FACTORS, traffic_measured),
)

# ----------------------------------------------------------------------------- which half


HALVES_WORLDS = (3, 4)  # of the values test's worlds: left and right differ
HALVES_NUMEL = 12  # divides by 3 and 4: a chunk index mistake shows as values, not a hang


def _bounds(numel: int, n: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for piece in torch.arange(numel).tensor_split(n):
        out.append((start, start + len(piece)))
        start += len(piece)
    return out


def _reduce_scatter(data: list[torch.Tensor], params: Params) -> list[torch.Tensor]:
    """Every rank's flat tensor after the reduce-scatter's steps, step by step (all ranks send
    at once): at step s rank r sends chunk r - 1 - s + shift, the receiver adds it to its own
    copy of that chunk."""
    n = len(data)
    bounds = _bounds(data[0].numel(), n)
    shift = {"every chunk but its own": 0, "one ahead": 1, "one behind": -1}
    flat = [t.clone() for t in data]
    for s in range(n - 1):
        sent = []
        for r in range(n):
            lo, hi = bounds[(r - 1 - s + shift[params["reduce-scatter index"]]) % n]
            sent.append((lo, hi, flat[r][lo:hi].clone()))
        for r in range(n):
            lo, hi, values = sent[(r - 1) % n]
            flat[r][lo:hi] += values
    return flat


def _all_gather(chunks: list[torch.Tensor], numel: int, params: Params) -> list[torch.Tensor]:
    """Every rank's output after the all-gather: rank r holds its chunk r; at step s it sends
    chunk r - s + shift of what it holds, which its right neighbour copies into place."""
    n = len(chunks)
    bounds = _bounds(numel, n)
    shift = {"own chunk first": 0, "one behind": -1, "one ahead": 1}
    out = [torch.full((numel,), -99.0) for _ in range(n)]
    for r in range(n):
        lo, hi = bounds[r]
        out[r][lo:hi] = chunks[r]
    for s in range(n - 1):
        sent = []
        for r in range(n):
            lo, hi = bounds[(r - s + shift[params["all-gather index"]]) % n]
            sent.append((lo, hi, out[r][lo:hi].clone()))
        for r in range(n):
            lo, hi, values = sent[(r - 1) % n]
            out[r][lo:hi] = values
    return out


def halves_measured(params: Params) -> dict[int, tuple[bool, bool, bool]]:
    """Per world: (the reduce-scatter alone wrong on a rank, the all-gather alone (given the
    right chunks) wrong on a rank, ring_all_reduce wrong on a rank), as halves_diagnosis and
    the values test see them."""
    seen = {}
    for n in HALVES_WORLDS:
        g = torch.Generator().manual_seed(n)
        data = [torch.randint(-8, 9, (HALVES_NUMEL,), generator=g).double() for _ in range(n)]
        total = torch.stack(data).sum(0)
        bounds = _bounds(HALVES_NUMEL, n)
        flat = _reduce_scatter(data, params)
        rs_wrong = any(
            not torch.equal(flat[r][lo:hi], total[lo:hi]) for r, (lo, hi) in enumerate(bounds)
        )
        right = [total[lo:hi].clone() for lo, hi in bounds]
        ag_wrong = any(not torch.equal(o, total) for o in _all_gather(right, HALVES_NUMEL, params))
        mine = [flat[r][lo:hi].clone() for r, (lo, hi) in enumerate(bounds)]
        if params["composition"] == "no all-gather":
            result = flat
        else:
            result = _all_gather(mine, HALVES_NUMEL, params)
        seen[n] = (rs_wrong, ag_wrong, any(not torch.equal(o, total) for o in result))
    return seen


def halves_name(measured: dict[int, tuple[bool, bool, bool]]) -> str | None:
    """What the values tests add on 3 and on 4 ranks, when the all-reduce is wrong there."""
    said = [
        f"{n} ranks: " + " ".join(halves_verdict(rs, ag))
        for n, (rs, ag, wrong) in measured.items()
        if wrong or rs or ag
    ]
    return "\n".join(said) or None


HALVES_FACTORS: dict[str, Sequence[Any]] = {
    "reduce-scatter index": ("every chunk but its own", "one ahead", "one behind"),
    "all-gather index": ("own chunk first", "one behind", "one ahead"),
    "composition": ("reduce-scatter then all-gather", "no all-gather"),
}
HALVES_RIGHT: Params = {factor: values[0] for factor, values in HALVES_FACTORS.items()}
HALVES_PLANTED: dict[str, Params] = {
    "reduce-scatter chunk one ahead": {"reduce-scatter index": "one ahead"},
    "all-gather chunk one behind": {"all-gather index": "one behind"},
    "both indices off": {"reduce-scatter index": "one ahead", "all-gather index": "one behind"},
    "no all-gather": {"composition": "no all-gather"},
}
HALVES_KEY_SAYS = {
    "reduce-scatter chunk one ahead": HALVES_SAY["reduce-scatter"],
    "all-gather chunk one behind": HALVES_SAY["all-gather"],
    "both indices off": HALVES_SAY["both"],
    "no all-gather": HALVES_SAY["composition"],
}

RING_HALVES = NamerTable(
    exercise="3.1",
    function="ring_all_reduce (which half: halves_diagnosis)",
    factors=tuple(HALVES_FACTORS),
    cases=tuple(f"{n} ranks, {HALVES_NUMEL} elements" for n in HALVES_WORLDS),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            f"3 ranks, {HALVES_NUMEL} elements",
            HALVES_KEY_SAYS[key],
        )
        for key, change in HALVES_PLANTED.items()
    ),
    right=lambda: halves_measured(HALVES_RIGHT),
    plant=lambda key: halves_measured({**HALVES_RIGHT, **HALVES_PLANTED[key]}),
    name=halves_name,
    neighbours=_neighbours(HALVES_RIGHT, HALVES_PLANTED, HALVES_FACTORS, halves_measured),
)

# ----------------------------------------------------------------------------- inside a group

GROUP_NUMEL = 7  # subgroup_worker: torch.arange(7) times (rank + 1)


def group_outcome(members: Sequence[int], params: Params) -> str:
    """A ring over ``members`` of a world of 4 (neighbours from the group's order, as RingLinks
    gives them), with each rank's place taken from its "group rank" or its "global rank", and
    the ring's size from the "group" or the "world": "ok", "wrong values", or "stuck" (a
    receive of another size than its send, or a message nobody receives)."""
    m = len(members)
    size = m if params["size"] == "group" else 4
    place = [i if params["place"] == "group rank" else g for i, g in enumerate(members)]
    bounds = _bounds(GROUP_NUMEL, size)
    data = [torch.arange(GROUP_NUMEL, dtype=torch.float64) * (g + 1) for g in members]
    total = torch.stack(data).sum(0)
    flat = [t.clone() for t in data]
    if size != m:
        return "stuck"  # size - 1 steps around a ring of m: a message nobody takes or sends
    for s in range(size - 1):  # reduce-scatter
        sent = [bounds[(place[i] - 1 - s) % size] for i in range(m)]
        values = [flat[i][lo:hi].clone() for i, (lo, hi) in enumerate(sent)]
        for i in range(m):
            lo, hi = bounds[(place[i] - 2 - s) % size]
            if hi - lo != values[(i - 1) % m].numel():
                return "stuck"
            flat[i][lo:hi] += values[(i - 1) % m]
    for s in range(size - 1):  # all-gather
        sent = [bounds[(place[i] - s) % size] for i in range(m)]
        values = [flat[i][lo:hi].clone() for i, (lo, hi) in enumerate(sent)]
        for i in range(m):
            lo, hi = bounds[(place[i] - 1 - s) % size]
            if hi - lo != values[(i - 1) % m].numel():
                return "stuck"
            flat[i][lo:hi] = values[(i - 1) % m]
    return "ok" if all(torch.equal(f, total) for f in flat) else "wrong values"


def group_measured(params: Params) -> dict[str, str]:
    """The outcome in each graded group, and on the whole world of 4 (checked after a failure)."""
    out = {str(members): group_outcome(members, params) for members in GROUPS}
    out["whole world"] = group_outcome((0, 1, 2, 3), params)
    return out


def group_name(measured: dict[str, str]) -> str | None:
    """What test_ring_inside_groups_of_three adds to the first group that fails."""
    passed: list[tuple[int, ...]] = []
    for members in GROUPS:
        outcome = measured[str(members)]
        if outcome == "ok":
            passed.append(members)
            continue
        advice = group_advice(members, passed, measured["whole world"] == "ok")
        return f"the group {members}: {outcome}" + (f": {advice}" if advice else "")
    return None


GROUP_FACTORS: dict[str, Sequence[Any]] = {
    "place": ("group rank", "global rank"),
    "size": ("group", "world"),
}
GROUP_RIGHT: Params = {"place": "group rank", "size": "group"}
GROUP_PLANTED: dict[str, Params] = {
    "place from the global rank": {"place": "global rank"},
    "size from the world": {"size": "world"},
}
GROUP_SAYS = {"place from the global rank": GLOBAL_RANK_ADVICE, "size from the world": GROUP_ADVICE}

RING_GROUPS = NamerTable(
    exercise="3.1",
    function="ring_all_reduce (inside groups of three)",
    factors=tuple(GROUP_FACTORS),
    cases=(*(str(members) for members in GROUPS), "whole world"),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            str(GROUPS[1]) if key.startswith("place") else str(GROUPS[0]),
            GROUP_SAYS[key],
        )
        for key, change in GROUP_PLANTED.items()
    ),
    right=lambda: group_measured(GROUP_RIGHT),
    plant=lambda key: group_measured({**GROUP_RIGHT, **GROUP_PLANTED[key]}),
    name=group_name,
    neighbours=_neighbours(GROUP_RIGHT, GROUP_PLANTED, GROUP_FACTORS, group_measured),
)

# ----------------------------------------------------------------------------- which part crashes

# crash_verdict: after ring_all_reduce crashed or hung on a world, each half runs alone on it
CRASH_CASE = "the failing world, each half alone"
CRASH_FACTORS: dict[str, tuple[Any, ...]] = {
    "reduce-scatter": ("right", "wrong"),
    "all-gather": ("right", "wrong"),
    "composition": ("right", "wrong"),
}
CRASH_RIGHT: Params = dict.fromkeys(CRASH_FACTORS, "right")
CRASH_PLANTED: dict[str, Params] = {part: {part: "wrong"} for part in CRASH_FACTORS}


def crash_measured(changed: Params) -> tuple[bool, bool, bool]:
    """(ring_all_reduce crashed, reduce_scatter_ring alone works, all_gather_ring alone works)
    with a crashing mistake in each part ``changed`` sets wrong."""
    s = {**CRASH_RIGHT, **changed}
    wrong = {part for part, v in s.items() if v == "wrong"}
    return bool(wrong), "reduce-scatter" not in wrong, "all-gather" not in wrong


def crash_name(measured: tuple[bool, bool, bool]) -> str | None:
    crashed, rs_works, ag_works = measured
    if not crashed:
        return None  # crash_verdict runs only after a crash
    broken = [
        h for h, works in (("reduce-scatter", rs_works), ("all-gather", ag_works)) if not works
    ]
    return crash_words(4, broken, [])


RING_CRASH = NamerTable(
    exercise="3.1",
    function="ring_all_reduce (which part crashes: crash_verdict)",
    factors=tuple(CRASH_FACTORS),
    cases=(CRASH_CASE,),
    mistakes=tuple(
        KnownMistake(key, f"{key}: wrong", CRASH_CASE, CRASH_SAY[key]) for key in CRASH_PLANTED
    ),
    right=lambda: crash_measured({}),
    plant=lambda key: crash_measured(CRASH_PLANTED[key]),
    name=crash_name,
    neighbours=lambda key: one_factor_away(
        CRASH_PLANTED[key], CRASH_PLANTED.values(), CRASH_RIGHT, CRASH_FACTORS, crash_measured
    ),
)

TABLES = (RING_TRAFFIC, RING_HALVES, RING_GROUPS, RING_CRASH)
