"""Shared pieces of the phase 3 graders (tests/phase3/grade_3_*.py): the code under test, short
failures, and the checks every hand-made all-reduce must pass.

Each all-reduce is compared with ``dist.all_reduce`` on the same inputs: exactly on
integer-valued inputs (every order of additions gives the same bits there, in float32, float64,
bfloat16 and int64), and to a stated tolerance on random floats, where the order of additions
differs from gloo's; every rank must hold the same bits in both cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from grading import defined_at, load, world

from course.comm_counter import CommCounter, CommRecord
from course.world import RankDied, RankFailed, WorldHung

PHASE = "phase3_multi_node"
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
OPS = ("MAX", "MIN", "PRODUCT")


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def module(name: str) -> ModuleType:
    """``phase3_multi_node/<name>`` as ``--impl`` chose it (template or solution)."""
    return load(PHASE, name)


HANG_ADVICE = (
    "The ranks hung inside point-to-point messages. The usual causes in a ring or a tree: every "
    "rank blocks in dist.send before posting its receive (post irecv and isend, then wait); "
    "sender and receiver disagree on which chunk or half moves at a step (an index off by one, "
    "bounds computed differently), so the messages' sizes or numbers differ; a peer given as a "
    "group rank where torch wants a global one; a partner that does not take part (the fold-in "
    "of a world that is not a power of two). Details:\n"
)


def small_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    nodes: int = 1,
    hint: str = "",
    hang_note: Callable[[WorldHung], str] | None = None,
) -> list[Any]:
    """A world of 2-6 ranks; a hang is reported after the world timeout (20 s by default; a
    deadlock 2-4 s after it sets in), with the usual causes of a hang in
    hand-made collectives in front of the harness's report (or, if ``hang_note`` reads a
    specific cause from the messages left pending, that cause), and ``hint`` (what this exercise
    most likely got wrong) in front of any rank failure."""
    prefix = f"{hint}\n" if hint else ""
    try:
        return world(fn, world_size, *args, nodes=nodes)
    except WorldHung as exc:
        note = hang_note(exc) if hang_note is not None else ""
        exc.args = ((note + " Details:\n" if note else prefix + HANG_ADVICE) + str(exc),)
        raise
    except RankDied as exc:
        exc.args = (
            f"{prefix}{exc} (gloo aborts a rank whose receive gets a message of another size: "
            "sender and receiver disagree on a chunk's or a half's bounds, or on who their "
            "peer is; see the gloo message below)",
        )
        raise
    except RankFailed as exc:
        if hint and exc.exc_type != "NotImplementedError":
            exc.args = (prefix + str(exc),)
        raise


def first_problems(problems: list[str], header: str, limit: int = 6) -> None:
    """Fail with the first few problems the ranks reported, if any (each once)."""
    unique = list(dict.fromkeys(problems))
    if unique:
        more = f"\n  ... and {len(unique) - limit} more" if len(unique) > limit else ""
        fail(header + "\n  " + "\n  ".join(unique[:limit]) + more)


def sizes_for(n: int, large: int = 4099) -> list[int]:
    """Divisible by the world first (a chunk-index mistake then shows as wrong values, not as a
    hang on messages of different sizes), then not divisible, larger, smaller than the world, 1."""
    return list(dict.fromkeys([4 * n, 3 * n + 1, large, max(1, n - 1), 1]))


def integer_valued(g: torch.Generator, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every order of reduction gives the same bits, bfloat16 included."""
    return torch.randint(-8, 9, (size,), generator=g).to(dtype)


def mixed_floats(g: torch.Generator, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values spread over six orders of magnitude: the order of additions shows."""
    scale = 10.0 ** torch.randint(-3, 4, (size,), generator=g)
    return (torch.randn(size, generator=g, dtype=torch.float64) * scale).to(dtype)


def tolerance(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Element-wise bound on |a - b| between two sums of the same n values in any order:
    2·(n-1)·eps·sum|x_i| (each of the n-1 additions of either sum rounds by at most eps times
    the magnitude of what it adds up; Higham, Accuracy and Stability, 2002, section 4.2)."""
    n = len(inputs)
    eps = torch.finfo(inputs[0].dtype).eps
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    return 2 * max(n - 1, 1) * eps * magnitude + torch.finfo(inputs[0].dtype).tiny


def same_bits_everywhere(result: torch.Tensor) -> list[int]:
    """The ranks whose result differs bitwise from rank 0's (collective: call on every rank)."""
    everyone = [torch.empty_like(result) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, result.contiguous())
    return [r for r, other in enumerate(everyone) if not torch.equal(other, everyone[0])]


def differs(mine: torch.Tensor, ref: torch.Tensor) -> str:
    """``at indices [..]: expected [..], got [..]`` for the first few differences."""
    bad = (mine != ref).nonzero().flatten()[:3].tolist()
    return f"at indices {bad}: expected {ref[bad].tolist()}, got {mine[bad].tolist()}"


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (a collective: call it on all)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


Diagnose = Callable[[torch.Tensor], list[str]]


def race_problems(
    fn: Callable[..., Any], data: torch.Tensor, label: str, explained: bool = False
) -> list[str]:
    """Run ``fn`` twice more on ``data``: results that change between identical runs mean a race
    (a collective: every rank calls it, and every rank reports the same verdict). ``explained``:
    a diagnosis above already named a deterministic mistake, which then says it as a consequence
    of that mistake (a message landing at the wrong place leaves memory that keeps an earlier
    call's data), not as a second cause."""
    rank = dist.get_rank()
    first, second = data.clone(), data.clone()
    fn(first)
    fn(second)
    changed = not torch.equal(first, second)
    if not any_rank(changed):
        return []
    where = f"rank {rank}" if changed else "another rank"
    if explained:
        return [
            f"(its results also change between two more runs on the same input ({where}): a "
            "consequence of the mistake above, which leaves part of the result to memory that "
            "no message of this call wrote, still holding an earlier call's data)"
        ]
    return [
        f"{label} also gave different results in two more runs on the same input ({where}): "
        "the result depends on more than the input, so something is read that no message of "
        "this call wrote: a receive buffer read before its irecv completed or where no "
        "message landed (stale data from an earlier call), or a tensor overwritten while a "
        "pending isend still reads it"
    ]


def values_problems(
    fn: Callable[..., Any],
    label: str,
    sizes: list[int],
    seed: int = 1000,
    diagnose: Diagnose | None = None,
    chunk_meaning: str = "",
) -> list[str]:
    """Run ``fn(tensor, op=...)`` (an in-place all-reduce) against ``dist.all_reduce``.

    Every rank learns whether any rank got a wrong result (one small all-reduce per case), so
    that on the first wrong case all of them run ``diagnose(input)`` together (it may
    communicate): what it returns is added to the report. ``chunk_meaning`` says what a wrong
    chunk means for this algorithm.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(seed + rank)
    for size in sizes:
        for dtype in DTYPES:
            data = integer_valued(g, size, dtype)
            mine, ref = data.clone(), data.clone()
            out = fn(mine)
            dist.all_reduce(ref)
            wrong = not torch.equal(mine, ref)
            if wrong:
                problems.append(
                    f"rank {rank}: size {size}, {dtype}: differs from dist.all_reduce "
                    f"{differs(mine, ref)}{chunk_hint(mine, ref, n, chunk_meaning)}"
                )
            if out is None or out.data_ptr() != mine.data_ptr():
                problems.append(f"{label} must reduce in place and return the input tensor")
            if any_rank(wrong):
                found = diagnose(data) if diagnose is not None else []
                problems += found
                problems += race_problems(fn, data, label, explained=bool(found))
                return problems  # the first case that fails: later ones may crash on it
    for op_name in OPS:
        op = getattr(dist.ReduceOp, op_name)
        data = torch.randint(1, 4, (2 * n + 1,), generator=g).double()
        mine, ref = data.clone(), data.clone()
        fn(mine, op=op)
        dist.all_reduce(ref, op=op)
        if not torch.equal(mine, ref):
            problems.append(
                f"rank {rank}: op={op_name}: expected {ref.tolist()}, got {mine.tolist()}"
            )
    square = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    ref = square.clone()
    fn(square)
    dist.all_reduce(ref)
    if not torch.equal(square, ref):
        problems.append(
            f"rank {rank}: a 3x4 tensor: expected {ref.tolist()}, got {square.tolist()}"
        )
    return problems


def chunk_hint(mine: torch.Tensor, ref: torch.Tensor, n: int, meaning: str = "") -> str:
    """Name the chunks (torch.tensor_split's) that came out wrong: a mistake in the chunk
    arithmetic usually spoils whole chunks, a wrong last boundary only the tail; ``meaning``
    says what a wrong chunk means for the algorithm under test."""
    if mine.numel() < n:
        return ""
    pieces = zip(torch.tensor_split(mine, n), torch.tensor_split(ref, n), strict=True)
    wrong = [i for i, (a, b) in enumerate(pieces) if not torch.equal(a, b)]
    if not wrong:
        return ""
    tail = ""
    if mine.numel() % n and wrong == [n - 1]:
        tail = (
            f"; only the last chunk is wrong and {mine.numel()} does not divide by {n}: causes "
            "that fit: the last chunk's boundary (the chunks must cover every element), or the "
            "step that handles the last chunk"
        )
    elif meaning:
        tail = f": {meaning}"
    return f" (wrong chunks of {n}: {wrong}{tail})"


def random_float_problems(fn: Callable[..., Any], seed: int = 77) -> list[str]:
    """Random floats: every rank the same bits, and within :func:`tolerance` of dist.all_reduce."""
    rank, n = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(seed + rank)
    for dtype in (torch.float32, torch.float64):
        data = mixed_floats(g, 4 * n + 3, dtype)
        inputs = [torch.empty_like(data) for _ in range(n)]
        dist.all_gather(inputs, data)
        mine, ref = data.clone(), data.clone()
        fn(mine)
        dist.all_reduce(ref)
        differ = same_bits_everywhere(mine)
        if differ:
            problems.append(
                f"{dtype}: ranks {differ} ended with different bits from rank 0's; causes "
                "that fit: an element reduced on more than one rank, in different orders, or "
                "reduced again on the way back instead of copied (each element must be reduced "
                "once, in one order, and then copied to every rank)"
            )
        bound = tolerance(inputs)
        excess = (mine.double() - ref.double()).abs() - bound
        if bool((excess > 0).any()):
            i = int(excess.argmax())
            problems.append(
                f"rank {rank}, {dtype}: element {i} is {mine[i].item()!r}, dist.all_reduce gives "
                f"{ref[i].item()!r}; two orders of the same sum differ by at most "
                f"{bound[i].item():.3e} here (2(n-1)·eps·sum|x|), it is "
                f"{(mine[i].double() - ref[i].double()).item():.3e} off; causes that fit: a "
                "contribution missing, or counted twice"
            )
    return problems


def counted(fn: Callable[[], Any]) -> CommCounter:
    """Run ``fn()`` under a :class:`CommCounter` and return it."""
    with CommCounter() as counter:
        fn()
    return counter


def sends(counter: CommCounter) -> list[CommRecord]:
    return [r for r in counter.records if r.op in ("send", "isend")]


def receives(counter: CommCounter) -> list[CommRecord]:
    return [r for r in counter.records if r.op in ("recv", "irecv")]


def collectives(counter: CommCounter) -> list[CommRecord]:
    return [r for r in counter.records if not r.is_point_to_point]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


class _TracedWork:
    """A point-to-point work that notes in its trace when someone waits for it."""

    def __init__(self, work: Any, trace: P2PTrace, op: str, tag: int, ident: int) -> None:
        self._work, self._trace, self._op, self._tag, self._ident = work, trace, op, tag, ident

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._trace.events.append(("wait", self._op, self._tag, self._ident))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class P2PTrace:
    """``with P2PTrace() as trace:`` records every ``dist.isend``/``dist.irecv`` posted and every
    ``wait()`` on their works, in order: ``(kind, op, tag, id)`` with kind "post" or "wait"."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int]] = []
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> P2PTrace:
        self._saved = (dist.isend, dist.irecv)

        def wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def posted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                work = original(tensor, *args, **kwargs)
                tag = int(kwargs.get("tag", args[2] if len(args) > 2 else 0))
                ident = len(self.events)
                self.events.append(("post", op, tag, ident))
                return None if work is None else _TracedWork(work, self, op, tag, ident)

            return posted

        dist.isend = wrap("isend", dist.isend)
        dist.irecv = wrap("irecv", dist.irecv)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        dist.isend, dist.irecv = self._saved

    def unwaited_sends(self) -> int:
        """Sends posted in the block whose work nobody waited for."""
        posted = {ident for kind, op, _, ident in self.events if kind == "post" and op == "isend"}
        waited = {ident for kind, op, _, ident in self.events if kind == "wait" and op == "isend"}
        return len(posted - waited)

    def send_waits_with_receives_pending(self, tag: int) -> int:
        """The most receives under ``tag`` still pending when a send under ``tag`` was waited
        for (0: every such send was waited for only once its receives were all done)."""
        pending: set[int] = set()
        worst = 0
        for kind, op, event_tag, ident in self.events:
            if event_tag != tag:
                continue
            if op == "irecv":
                (pending.add if kind == "post" else pending.discard)(ident)
            elif kind == "wait":
                worst = max(worst, len(pending))
        return worst


def factor_neighbours(
    settings: Mapping[str, Any],
    right: Mapping[str, Any],
    factors: Mapping[str, Sequence[Any]],
    measure: Callable[[dict[str, Any]], Any],
) -> list[tuple[str, Any]]:
    """The mistakes one factor away from ``settings`` (a mistake written as one value per factor
    of its function, ``right`` the right values): each factor the mistake got wrong set to each
    of its other wrong values, measured (issue 49's neighbours, generated from the factor list
    rather than by hand: the mistakes a namer could mistake this one for)."""
    out = []
    for factor, values in factors.items():
        if settings[factor] == right[factor]:
            continue
        for value in values:
            if value in (settings[factor], right[factor]):
                continue
            changed = {**settings, factor: value}
            label = ", ".join(f"{f}={v}" for f, v in changed.items() if v != right[f])
            out.append((label, measure(changed)))
    return out


def with_sites(found: dict[str, str], cls: type) -> dict[str, str]:
    """Each remark about a method of the learner's ``cls`` (keyed by the method's name) with
    where that method is defined: a unit method tried alone that misbehaved is pointed at by
    its own line, never at another class's method of the same name (``ZeroUnit.gather`` for an
    ``FsdpUnit`` remark that mentions an all-gather) or at the test's line."""
    return {method: text + defined_at(getattr(cls, method, None)) for method, text in found.items()}
