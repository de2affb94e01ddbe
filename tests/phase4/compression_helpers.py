"""What the 4.4 grader runs inside its ranks: the hooks on hand-made buckets beside torch's, and on
two real DDPs (torch's and phase 3's).

A :class:`FlatBucket` offers the methods of ``dist.GradBucket`` a hook calls, so a hook can be
fed chosen gradients, one bucket after the other, and compared with torch's own hook on copies
of the same data (torch's hooks accept it too). Every check is made on every rank and every rank
runs every collective of a worker, whatever it finds: a rank that stopped early would leave the
others waiting. Each worker returns its remarks (strings), which the grader reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from grading import load, without_cuda_on_cpu_ranks, world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.comm_counter import CommCounter, CommRecord
from course.world import WorldHung

PHASE = "phase4_production"
TOLERANCE = 1e-9  # float64; PowerSGD: other matmul kernels or norms differ in the last bits
LOSS = nn.functional.cross_entropy

HANG_ADVICE = (
    "The ranks hung inside a communication hook. A hook must issue every collective from the "
    "hook call itself, in the same order on every rank: a collective started from a future's "
    ".then() callback runs on a gloo thread, so with several buckets two ranks can issue them "
    "in different orders (wait for P's all-reduce, then issue Q's, then return a completed "
    "future). Also check that every rank issues the same collectives for every bucket. Details:\n"
)


def module(name: str) -> ModuleType:
    """``phase4_production/<name>`` as ``--impl`` chose it."""
    return load(PHASE, name)


def small_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """A world of 2-4 ranks; a hang is reported with what usually causes one in a hook."""
    try:
        return world(fn, world_size, *args)
    except WorldHung as exc:
        exc.args = (HANG_ADVICE + str(exc),)
        raise


class FlatBucket:
    """A bucket made by hand: the methods of ``dist.GradBucket`` that hooks call."""

    def __init__(
        self, buffer: torch.Tensor, shapes: Sequence[tuple[int, ...]], index: int, last: bool
    ) -> None:
        self._buffer, self._shapes, self._index, self._last = buffer, list(shapes), index, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        views, start = [], 0
        for shape in self._shapes:
            numel = math.prod(shape)
            views.append(self._buffer[start : start + numel].view(shape))
            start += numel
        return views

    def parameters(self) -> list[torch.Tensor]:
        return [torch.zeros(shape) for shape in self._shapes]

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def bucket(
    buffer: torch.Tensor, shapes: Sequence[tuple[int, ...]], index: int = 0, last: bool = True
) -> Any:
    """A :class:`FlatBucket`, typed as what torch's hooks take (a ``dist.GradBucket``)."""
    return FlatBucket(buffer, shapes, index, last)


def numel_of(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def resolve(future: Any, what: str) -> torch.Tensor:
    """The tensor a hook's future carries (a hook may return [tensor], as all_reduce's does)."""
    if not isinstance(future, torch._C.Future):
        raise AssertionError(
            f"{what} returned {type(future).__name__}; a communication hook returns a "
            "torch.futures.Future whose value is the averaged bucket (a completed one: "
            "fut = torch.futures.Future(); fut.set_result(tensor))"
        )
    value = future.wait()
    return value[0] if isinstance(value, list) else value


def payload_bytes(records: Sequence[CommRecord], world_size: int) -> int:
    """Bytes this rank handed to collectives: an all-reduce's tensor, its own part of an
    all-gather (CommCounter records an all-gather's output, world x the part)."""
    total = 0
    for record in records:
        if record.op in ("all_gather", "all_gather_into_tensor"):
            total += record.nbytes // world_size
        else:
            total += record.nbytes
    return total


def gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (outside any CommCounter: the grader's own traffic)."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def mixed_gradients(g: torch.Generator, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values over eight orders of magnitude (fp16's subnormals and large values too)."""
    scale = 10.0 ** torch.randint(-7, 2, (numel,), generator=g)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOLERANCE) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol))


def scaled_by(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The ratio got / want over want's larger entries when nearly all of them share it (None
    otherwise): the world size when a division is missing, 1/world when there is one too many."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return None
    big = want.abs() > want.abs().median()
    if not bool(big.any()):
        return None
    ratios = got[big].double() / want[big].double()
    median = float(ratios.median())
    consistent = (ratios - median).abs() <= 0.05 * abs(median)
    return median if float(consistent.double().mean()) >= 0.9 else None


def scale_remark(got: torch.Tensor, want: torch.Tensor, world_size: int) -> str | None:
    """ "the sum, not the average" / "divided once more", or None."""
    ratio = scaled_by(got, want)
    if ratio is None:
        return None
    if abs(ratio - world_size) < 0.02 * world_size:
        return f"{world_size} times too large: a division by the world is missing"
    if abs(ratio - 1 / world_size) < 0.02 / world_size:
        return f"{world_size} times too small: divided by the world once too often"
    return None


# ----------------------------------------------------------------------------- fp16 / bf16


def cast_worker() -> list[str]:
    """Our fp16/bf16 hooks and torch's on copies of the same buckets (world 3: the division by 3
    is not exact, so the order cast -> divide shows in the bits)."""
    compression = module("compression")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(40 + rank)
    problems: list[str] = []
    cases: list[tuple[str, Any, Any, torch.dtype]] = [
        ("fp16_hook", compression.fp16_hook, default_hooks.fp16_compress_hook, torch.float16),
        ("bf16_hook", compression.bf16_hook, default_hooks.bf16_compress_hook, torch.bfloat16),
    ]
    for name, ours, theirs, dtype in cases:
        for bucket_dtype in (torch.float32, torch.float64):
            data = mixed_gradients(g, 1000, bucket_dtype)
            data[:8] = 40000.0  # 3 x 40000 overflows fp16 (65504) unless divided first
            mine, reference = data.clone(), data.clone()
            magnitude = torch.stack(gather(data)).double().abs().sum(0) / world_size
            with CommCounter() as comm:
                result = resolve(ours(None, bucket(mine, [(1000,)])), name)
            want = resolve(theirs(None, bucket(reference, [(1000,)])), "torch")
            label = f"{name} on a {str(bucket_dtype).removeprefix('torch.')} bucket"
            problems += cast_problems(label, mine, result, want, dtype, world_size, magnitude)
            sent = payload_bytes(comm.records, world_size)
            if sent != 1000 * 2 or comm.count("all_reduce") != 1:
                problems.append(
                    f"{label}: handed {sent} bytes to {dict(comm.calls)}; expected one all-reduce "
                    f"of 2000 bytes (1000 elements in {dtype}): cast before communicating"
                )
    return problems


def cast_problems(
    label: str,
    buffer: torch.Tensor,
    result: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    world_size: int,
    magnitude: torch.Tensor,
) -> list[str]:
    """What differs from torch's hook; ``magnitude`` is the mean of the ranks' |values|.

    Three things are measured: the future's dtype and shape, its values, and whether
    bucket.buffer() holds them. A cause is named only when one of the three is off and its
    evidence singles the cause out; when several are off, each is described, none named."""
    if result.shape != want.shape:
        return [
            f"{label}: the future's value is {result.dtype} {tuple(result.shape)}; expected the "
            f"bucket's own {want.dtype} {tuple(want.shape)} (copy the average back into it)"
        ]
    values = result.to(want.dtype)
    dtype_off = result.dtype != want.dtype
    buffer_off = not torch.equal(buffer, values)
    named, described = cast_value_remark(values, want, dtype, world_size, magnitude)
    off = [dtype_off, buffer_off, described is not None]
    if not any(off):
        return []
    if sum(off) == 1:
        if dtype_off:
            return [
                f"{label}: the future's value is {result.dtype} {tuple(result.shape)}, with "
                f"torch's values; expected the bucket's own {want.dtype} (copy the average back "
                "into it)"
            ]
        if buffer_off:
            return [
                f"{label}: the future carries the average but bucket.buffer() does not hold it: "
                "decompress in place (buffer.copy_(...)) as torch does, and return the buffer"
            ]
        return [f"{label}: {named}"]
    facts = []
    if dtype_off:
        facts.append(f"the future's value is {result.dtype}, expected {want.dtype}")
    if described is not None:
        facts.append(f"its values: {described}")
    if buffer_off:
        facts.append("bucket.buffer() does not hold what the future carries")
    return [f"{label}: more than one thing differs from torch's hook: " + "; ".join(facts)]


def cast_value_remark(
    values: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    world_size: int,
    magnitude: torch.Tensor,
) -> tuple[str, str | None]:
    """(the remark naming the cause where the values single one out, what differs in plain
    facts); (\"\", None) when the values are torch's."""
    if torch.equal(values, want):
        return "", None
    finite = torch.isfinite(want)
    overflowed = ~torch.isfinite(values) & finite
    if bool(overflowed.any()):
        both = torch.isfinite(values) & finite
        fact = (
            f"inf at {int(overflowed.sum())} entries where torch's hook has finite values (the "
            f"entries of 40000 on each of {world_size} ranks overflow {dtype} when summed)"
        )
        ratio = scaled_by(values[both], want[both])
        if ratio is not None and abs(ratio - world_size) < 0.02 * world_size:
            return (
                f"{fact}, and the finite entries are {world_size} times too large: the ranks' "
                "values were summed undivided",
                f"{fact}; the finite entries {ratio:.3g} times torch's",
            )
        if rounding_only(values[both], want[both], dtype, magnitude[both]):
            return (
                f"{fact}, the other entries within a few roundings of torch's: divide by the "
                f"world size before the all-reduce, in {dtype}, so the sum cannot overflow",
                f"{fact}; the finite entries within a few roundings of torch's",
            )
        return (
            fact,
            f"{fact}; the finite entries differ by up to {max_difference(values, want, both)}",
        )
    ratio = scaled_by(values, want)
    if ratio is not None and abs(ratio - world_size) < 0.02 * world_size:
        return (
            f"{world_size} times too large: a division by the world is missing",
            f"{ratio:.3g} times torch's",
        )
    if ratio is not None and abs(ratio - 1 / world_size) < 0.02 / world_size:
        return (
            f"{world_size} times too small: divided by the world once too often",
            f"{ratio:.3g} times torch's",
        )
    wrong = int((values != want).sum())
    if rounding_only(values, want, dtype, magnitude):
        fact = f"{wrong} of {want.numel()} entries differ in the last bits from torch's hook"
        order = (
            "; the entries of 40000 did not overflow, so the division came before the sum: "
            f"it came before the cast to {dtype}"
            if dtype == torch.float16
            else f" (dividing before the cast, or after the sum, rounds differently in {dtype})"
        )
        return (
            f"{fact}: the roundings differ; default_hooks casts to {dtype} first, then divides "
            f"by the world in {dtype}, then sums{order}",
            fact,
        )
    fact = (
        f"{wrong} of {want.numel()} entries differ from torch's default_hooks, by up to "
        f"{max_difference(values, want, finite)}, more than a few roundings in {dtype}; not a "
        f"factor of the world ({world_size}) either"
    )
    return fact, fact


def rounding_only(
    result: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor
) -> bool:
    """Whether every entry is within a few roundings in 16 bits of torch's, relative to the
    values summed (``magnitude``: with cancellation the result itself is a poor yardstick)."""
    rounding = 8 * torch.finfo(dtype).eps * magnitude + torch.finfo(dtype).tiny
    return bool(((result.double() - want.double()).abs() <= rounding).all())


def max_difference(result: torch.Tensor, want: torch.Tensor, where: torch.Tensor) -> str:
    if not bool(where.any()):
        return "nothing (no finite entry)"
    return f"{float((result[where].double() - want[where].double()).abs().max()):.3g}"


# ----------------------------------------------------------------------------- top-k

TOPK_BUCKETS = (1000, 37, 300)  # 37 x 5% = 1.85: k rounds up to 2


def topk_worker(ratio: float, steps: int) -> dict[str, Any]:
    """Three buckets, ``steps`` steps, every rank its own gradients: values, the error-feedback
    invariant, bytes and collectives checked on every bucket of every step."""
    topk = module("compression_topk")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(70 + rank)
    state = topk.TopKState(None, ratio=ratio)
    zeros = {index: torch.zeros(n) for index, n in enumerate(TOPK_BUCKETS)}
    errors = dict(zeros)
    # the errors a hook with one known mistake would remember: its own trajectory, so that
    # the mistake is recognised at every step, not only at the first (where errors are 0)
    variant_errors = {"signed": dict(zeros), "grad indices": dict(zeros)}
    places: list[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], bool]] = []
    other_problems: list[list[str]] = []
    sent_bytes = []
    for step in range(steps):
        for index, numel in enumerate(TOPK_BUCKETS):
            where = f"step {step + 1}, bucket {index} ({numel} elements)"
            grad = torch.randn(numel, generator=g)
            total = grad + errors[index]
            k = topk.topk_count(numel, ratio)
            sent = sparse_top(total, k)
            made = bucket(grad.clone(), [(numel,)], index, index == len(TOPK_BUCKETS) - 1)
            with CommCounter() as comm:
                try:
                    out = resolve(topk.topk_hook(state, made), "topk_hook").clone()
                except RuntimeError as err:
                    if "out of range" not in str(err):
                        raise
                    raise AssertionError(
                        f"{where}: torch.topk refused k ({err}): k is topk_count(this bucket's "
                        f"numel, ratio) = {k} here, never more than the bucket holds"
                    ) from None
            sent_bytes.append(payload_bytes(comm.records, world_size))
            want = average(gather(sent))
            signed_total = grad + variant_errors["signed"][index]
            signed_sent = sparse_top(signed_total, k, signed=True)
            variant_errors["signed"][index] = signed_total - signed_sent
            by_grad_total = grad + variant_errors["grad indices"][index]
            by_grad_sent = sparse_top(by_grad_total, k, chosen_by=grad)
            variant_errors["grad indices"][index] = by_grad_total - by_grad_sent
            variants = {
                "sum": want * world_size,
                "twice": want / world_size,
                "grad": average(gather(sparse_top(grad, k))),
                "grad indices": average(gather(by_grad_sent)),
                "signed": average(gather(signed_sent)),
                "magnitudes": average(gather(sent.abs())),
            }
            replicas = gather(out)
            agree = all(torch.equal(replicas[0], other) for other in replicas)
            places.append((where, out, want, variants, agree))
            other_problems.append(
                topk_error_problems(where, state, index, total, sent)
                + topk_comm_problems(where, comm, world_size, k, numel, ratio)
            )
            errors[index] = total - sent
    everywhere = fitting_everywhere([(out, variants) for _, out, _, variants, _ in places])
    problems: list[str] = []
    for (where, out, want, variants, agree), others in zip(places, other_problems, strict=True):
        problems += topk_value_problems(where, out, want, variants, agree, everywhere) + others
    return {"problems": problems, "bytes": sent_bytes}


def fitting_everywhere(places: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> list[str]:
    """The known top-k mistakes whose averaged bucket the hook gave at every place measured."""
    if not places:
        return []
    return [
        name
        for name in places[0][1]
        if all(close(out, variants[name], 1e-6) for out, variants in places)
    ]


def topk_order_worker() -> list[float]:
    """``average_sparse`` where 3 ranks chose one index (3) with 1e8, 1 and -1e8 in float32: the
    sum depends on the order of the additions ((1e8 + 1) - 1e8 is 0, (1e8 - 1e8) + 1 is 1)."""
    topk = module("compression_topk")
    rank = dist.get_rank()
    values = torch.tensor([(1e8, 1.0, -1e8)[rank], float(rank + 1)], dtype=torch.float32)
    indices = torch.tensor([3, 5 + rank], dtype=torch.int64)
    out = torch.full((10,), float("nan"), dtype=torch.float32)
    topk.average_sparse(values, indices, out)
    return out.tolist()


def sparse_top(
    total: torch.Tensor, k: int, signed: bool = False, chosen_by: torch.Tensor | None = None
) -> torch.Tensor:
    """``total`` at its k entries of largest magnitude (largest value if ``signed``; of
    ``chosen_by``'s magnitudes if given), 0 elsewhere."""
    key = total if chosen_by is None else chosen_by
    indices = (key if signed else key.abs()).topk(k).indices
    sent = torch.zeros_like(total)
    sent[indices] = total[indices]
    return sent


def average(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros_like(parts[0])
    for part in parts:
        out += part
    return out / len(parts)


# the words for each known mistake of the values, named only when it alone fits every place
TOPK_REMARKS = {
    "sum": "the sum of the sparse vectors, not their average: divide by the world",
    "twice": "the average divided by the world once more: divide once",
    "grad": (
        "the entries sent are the top-k of the gradient alone, the remembered error never "
        "added: select them from gradient + remembered error (the error feedback), and send "
        "that sum's values"
    ),
    "grad indices": (
        "the entries were chosen by the gradient's magnitudes alone, though the values sent "
        "hold the remembered error: choose them by |gradient + remembered error|"
    ),
    "signed": (
        "the k largest values were sent, not the k largest magnitudes: select on the absolute "
        "values (negative entries matter as much), send the signed values"
    ),
    "magnitudes": (
        "the right entries were chosen, but their magnitudes were sent: a negative entry "
        "arrives positive; send the sum's own signed values"
    ),
}
TOPK_SHORT = {
    "sum": "the sum of the ranks' vectors",
    "twice": "an average divided by the world again",
    "grad": "the gradient's own top-k",
    "grad indices": "entries chosen by the gradient",
    "signed": "a choice by signed value",
    "magnitudes": "magnitudes in place of values",
}


def topk_value_problems(
    where: str,
    out: torch.Tensor,
    want: torch.Tensor,
    variants: dict[str, torch.Tensor],
    agree: bool,
    everywhere: Sequence[str],
) -> list[str]:
    """The remark on one place (step, bucket); ``variants``: each known mistake's averaged
    bucket there, ``everywhere``: the mistakes that fit every place of the run. A mistake is
    named only when it alone fits everywhere; one that fits this place alone is described."""
    if not agree:
        return [
            f"{where}: the ranks ended with different averages: every rank must add every "
            "rank's (values, indices), in the same order, and divide once"
        ]
    if out.shape != want.shape or out.dtype != want.dtype:
        return [
            f"{where}: the future's value is {out.dtype} {tuple(out.shape)}; expected the "
            f"bucket's own {want.dtype} {tuple(want.shape)}: the average, scattered back into a "
            "dense bucket"
        ]
    if close(out, want, 1e-6):
        return []
    here = [name for name, value in variants.items() if close(out, value, 1e-6)]
    if len(everywhere) == 1 and everywhere[0] in here:
        return [f"{where}: {TOPK_REMARKS[everywhere[0]]}"]
    if here:
        return [
            f"{where}: this bucket is what {' or '.join(TOPK_SHORT[n] for n in here)} would "
            "give, but other steps or buckets are not: more than one thing differs from the "
            "average of every rank's top-k of (gradient + remembered error)"
        ]
    nonzero = int((out != 0).sum())
    return [
        f"{where}: the averaged bucket differs from the average of every rank's top-k of "
        f"(gradient + remembered error) by up to {float((out - want).abs().max()):.3g} "
        f"({nonzero} nonzero entries, at most {int((want != 0).sum())} expected)"
    ]


def topk_error_problems(
    where: str, state: Any, index: int, total: torch.Tensor, sent: torch.Tensor
) -> list[str]:
    error = state.errors.get(index)
    if error is None:
        return [
            f"{where}: state.errors[{index}] is missing: remember the part of gradient + old "
            "error that was not sent, per bucket index"
        ]
    want = total - sent
    if error.shape == want.shape and torch.equal(error, want):
        return []
    if error.shape == sent.shape and torch.equal(error, sent):
        return [
            f"{where}: state.errors[{index}] holds the entries that were sent; it must hold the "
            "rest (gradient + old error - sent): zeros where sent, the sum elsewhere"
        ]
    if error.shape == total.shape and torch.equal(error, total):
        return [
            f"{where}: state.errors[{index}] holds the whole gradient + old error: zero the "
            "entries that were sent, or they are sent twice"
        ]
    return [
        f"{where}: state.errors[{index}] is not gradient + old error - sent (exactly: zeros at "
        "the k sent indices, the sum elsewhere)"
    ]


def topk_comm_problems(
    where: str, comm: CommCounter, world_size: int, k: int, numel: int, ratio: float
) -> list[str]:
    if comm.count("all_reduce"):
        return [
            f"{where}: the hook called all_reduce; the sum of sparse vectors is not sparse: "
            "all-gather each rank's values and indices instead"
        ]
    gathers = comm.count("all_gather") + comm.count("all_gather_into_tensor")
    sent = payload_bytes(comm.records, world_size)
    want = k * (4 + 8)
    if sent == want and gathers >= 1:
        return []
    per_pair = 12
    return [
        f"{where}: this rank handed {sent} bytes to {dict(comm.calls)}; expected k = "
        f"topk_count({numel}, {ratio}) = {k} float32 values and k int64 indices ({want} bytes)"
        + (
            f", i.e. it sent {sent // per_pair} pairs: compute k from this bucket's size"
            if sent % per_pair == 0 and sent
            else ""
        )
    ]


# ----------------------------------------------------------------------------- PowerSGD

# Bucket 0: biases (never compressed), a wide and a square matrix; bucket 1: one shape twice
# with another between (torch groups them by shape), a conv weight (viewed 16 x 27), and a
# 4 x 3 matrix no rank compresses at rate 2.
PSGD_BUCKETS: list[list[tuple[int, ...]]] = [
    [(5,), (5, 32), (32,), (32, 32), (32, 20)],
    [(20, 20), (16, 3, 3, 3), (4, 3), (20, 20), (16,)],
]


@without_cuda_on_cpu_ranks
def powersgd_worker(rank_r: int, steps: int, start: int, group_size: int = 0) -> dict[str, Any]:
    """Our hook and torch's on copies of the same buckets, step by step (float64). With
    ``group_size``, the world is split into groups and each group runs on its own."""
    from subgroups import split_into_groups

    ours_module = module("compression_powersgd")
    group, ranks = None, tuple(range(dist.get_world_size()))
    if group_size:
        info = split_into_groups(group_size)
        group, ranks = info.group, info.ranks
    world_size = dist.get_world_size(group)
    g = torch.Generator().manual_seed(90 + dist.get_rank())
    ours = ours_module.PowerSGDState(group, rank=rank_r, start_iter=start, seed=5)
    theirs = torch_powersgd.PowerSGDState(
        group, matrix_approximation_rank=rank_r, start_powerSGD_iter=start, random_seed=5
    )
    problems: list[str] = []
    first_ok = True
    with CommCounter() as everything:
        for step in range(steps):
            for index, shapes in enumerate(PSGD_BUCKETS):
                last = index == len(PSGD_BUCKETS) - 1
                where = f"step {step + 1} (start_iter={start}), bucket {index}"
                grad = torch.randn(numel_of(shapes), generator=g, dtype=torch.float64)
                mine = bucket(grad.clone(), shapes, index, last)
                with CommCounter() as comm:
                    out = resolve(ours_module.powersgd_hook(ours, mine), "powersgd_hook").clone()
                hook = torch_powersgd.powerSGD_hook
                want = resolve(hook(theirs, bucket(grad.clone(), shapes, index, last)), "torch")
                replicas = gather(out, group)
                found = []
                if tuple(ours.compression_stats()) != tuple(theirs.compression_stats()):
                    found.append(
                        f"{where}: compression_stats() (rate, numel before, numel after) is "
                        f"{tuple(ours.compression_stats())}, torch's "
                        f"{theirs.compression_stats()}: should_compress must be torch's rule "
                        "(compress when (rows + cols)·r·min_compression_rate < rows·cols)"
                    )
                if step >= start and not found:
                    found += psgd_comm_problems(
                        where, comm, shapes, rank_r, ours.min_compression_rate
                    )
                value = psgd_value_problems(
                    where, step - start, first_ok, out, want, replicas, world_size, ours, index
                )
                found += value
                if step >= start and not value:
                    found += psgd_memory_problems(where, ours, theirs, index)
                if found and step == start:
                    first_ok = False
                problems += found
    crossing = [record.describe(dist.get_rank()) for record in everything.crossing(ranks)]
    problems += [
        f"{call} outside its group {ranks}: pass group= to every collective"
        for call in crossing[:2]
    ]
    return {"problems": problems}


def psgd_value_problems(
    where: str,
    compressed_steps: int,
    first_ok: bool,
    out: torch.Tensor,
    want: torch.Tensor,
    replicas: list[torch.Tensor],
    world_size: int,
    state: Any,
    index: int,
) -> list[str]:
    """``compressed_steps``: how many compressed steps came before this one (-1: plain)."""
    if not all(torch.equal(replicas[0], other) for other in replicas):
        return [
            f"{where}: the ranks ended with different gradients: all-reduce P *and* Q (the "
            "approximation P·Qᵀ must be built from the group's factors on every rank)"
        ]
    if out.shape != want.shape or out.dtype != want.dtype:
        return [
            f"{where}: the future's value is {out.dtype} {tuple(out.shape)}; torch's hook "
            f"returns the bucket's {want.dtype} {tuple(want.shape)}"
        ]
    if close(out, want):
        return []
    diff = f"differs from torch's powerSGD_hook by up to {float((out - want).abs().max()):.3g}"
    if compressed_steps < 0:
        return [
            f"{where}: before start_iter the hook averages the bucket with a plain all-reduce; it "
            + diff
        ]
    remark = scale_remark(out, want, world_size)
    if remark:
        return [
            f"{where}: {diff}: {remark} (Q is divided by the group size after its all-reduce; "
            "P is not: it is orthogonalized)"
        ]
    if not first_ok:
        return [f"{where}: {diff}"]
    if compressed_steps > 0:
        return [
            f"{where}: {diff}, though the first compressed step matched: warm start: keep Q in "
            "state.q_memory[index] and start the next step from it (orthogonalized), instead "
            "of drawing a new random Q"
        ]
    if index in state.p_memory and not factors_orthonormal(state, index):
        return [
            f"{where}: {diff}, and the columns of P are not orthonormal after the step: "
            "orthogonalize every P after its all-reduce, before Q = MᵀP"
        ]
    return [
        f"{where}: {diff}. Order: Q (warm or fresh random, orthogonalized), P = M·Q, all-reduce P "
        "(sum), orthogonalize P, Q = Mᵀ·P, all-reduce Q and divide by the world, M = P·Qᵀ"
    ]


def factors_orthonormal(state: Any, index: int) -> bool:
    """Whether each compressed matrix's P, read back from state.p_memory (torch's layout:
    matrices grouped by shape, in order of first appearance), has orthonormal columns."""
    memory = state.p_memory[index]
    by_shape: dict[tuple[int, int], int] = {}
    for shape in PSGD_BUCKETS[index]:
        rows, cols = shape[0], math.prod(shape[1:])
        rank = min(rows, cols, state.rank)
        if torch_powersgd._should_compress(rows, cols, rank, state.min_compression_rate)[0]:
            by_shape[(rows, cols)] = by_shape.get((rows, cols), 0) + 1
    start = 0
    for (rows, cols), count in by_shape.items():
        rank = min(rows, cols, state.rank)
        for _ in range(count):
            if start + rows * rank > memory.numel():
                return False
            p = memory[start : start + rows * rank].view(rows, rank)
            start += rows * rank
            if not torch.allclose(p.T @ p, torch.eye(rank, dtype=p.dtype), atol=1e-6):
                return False
    return True


def psgd_memory_problems(where: str, ours: Any, theirs: Any, index: int) -> list[str]:
    q = ours.q_memory.get(index)
    if q is None:
        return [
            f"{where}: state.q_memory[{index}] is empty after a compressed step: keep Q there, "
            "the next step starts from it (warm start)"
        ]
    want = theirs.q_memory_dict[index]
    if q.shape == want.shape and close(q.abs(), want.abs(), 1e-7):
        return []
    return [
        f"{where}: state.q_memory[{index}] after the step differs from torch's Q (up to column "
        "signs): Q must be the group's average of Mᵀ·P, reused at the next step (warm start: "
        "orthogonalize the kept Q, do not draw a new random one)"
    ]


def psgd_comm_problems(
    where: str, comm: CommCounter, shapes: Sequence[tuple[int, ...]], rank_r: int, rate: float
) -> list[str]:
    plain = factors = 0
    p_total = 0
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rows, cols, rank_r)
        if torch_powersgd._should_compress(rows, cols, r, rate)[0]:
            factors += (rows + cols) * r
            p_total += rows * r
        else:
            plain += rows * cols
    want = (plain + factors) * 8
    sent = sum(record.nbytes for record in comm.records if record.op == "all_reduce")
    if sent == want and set(comm.calls) == {"all_reduce"}:
        return []
    hint = ""
    if sent == (plain + p_total) * 8:
        hint = ": P was all-reduced but Q was not (every rank needs the group's Q)"
    elif sent == (plain + factors - p_total) * 8:
        hint = ": Q was all-reduced but P was not (P = M·Q must be summed over the group)"
    return [
        f"{where}: the hook all-reduced {sent} bytes ({dict(comm.calls)}); expected {want}: the "
        f"uncompressed tensors ({plain} elements) and every P and Q ({factors} elements), "
        f"float64{hint}"
    ]


# ----------------------------------------------------------------------------- on real DDPs


def chain_mlp(seed: int, widths: tuple[int, ...] = (12, 40, 30, 5)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


def batch(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(samples, 12, generator=g, dtype=torch.float64), torch.randint(
        5, (samples,), generator=g
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@without_cuda_on_cpu_ranks
def two_ddps_worker(method: str, cap: float, steps: int) -> dict[str, Any]:
    """The hook ``make_comm_hook(method)`` on torch's DDP and on phase 3's (the reference: 4.4
    does not depend on 3.4), both starting from rank 0's weights, ``steps`` SGD steps."""
    from solutions.phase3_multi_node.ddp import DistributedDataParallel as OurDDP

    compression = module("compression")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    theirs = TorchDDP(chain_mlp(10 + rank), bucket_cap_mb=cap)
    ours = OurDDP(chain_mlp(10 + rank), bucket_cap_mb=cap)
    models: list[Any] = [theirs, ours]
    options = {"topk_ratio": 0.1, "powersgd_rank": 1, "start_iter": 2, "seed": 3}
    for model in models:
        hook = compression.make_comm_hook(method, **options)
        model.register_comm_hook(*hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (theirs, ours)]
    per = 16 // world_size
    for step in range(steps):
        x, y = batch(step, 16)
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for model, optimizer in zip((theirs, ours), optimizers, strict=True):
            optimizer.zero_grad()
            LOSS(model(xs), ys).backward()
            optimizer.step()
    a, b = flat_params(theirs.module), flat_params(ours.module)
    replicas = gather(a)
    return {
        "diff": float((a - b).abs().max()),
        "replicas_agree": all(torch.equal(replicas[0], other) for other in replicas),
        "buckets": len(ours.buckets),
    }


@without_cuda_on_cpu_ranks
def one_bucket_worker(rank_r: int, steps: int) -> dict[str, Any]:
    """torch's powerSGD_hook on torch's DDP beside ours on torch's DDP and on phase 3's: one
    bucket, the same seed, float64."""
    from solutions.phase3_multi_node.ddp import DistributedDataParallel as OurDDP

    powersgd = module("compression_powersgd")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    models: list[Any] = [TorchDDP(chain_mlp(10)), TorchDDP(chain_mlp(10)), OurDDP(chain_mlp(10))]
    reference_state = torch_powersgd.PowerSGDState(
        None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2, random_seed=7
    )
    models[0].register_comm_hook(reference_state, torch_powersgd.powerSGD_hook)
    states = [powersgd.PowerSGDState(None, rank=rank_r, start_iter=2, seed=7) for _ in range(2)]
    for model, state in zip(models[1:], states, strict=True):
        model.register_comm_hook(state, powersgd.powersgd_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in models]
    losses: list[list[float]] = [[] for _ in models]
    per = 16 // world_size
    for step in range(steps):
        x, y = batch(step, 16)
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for k, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss = LOSS(model(xs), ys)
            loss.backward()
            optimizer.step()
            losses[k].append(loss.item())
    want = flat_params(models[0].module)
    return {
        "diffs": [float((flat_params(m.module) - want).abs().max()) for m in models[1:]],
        "losses": losses,
        "stats": [tuple(reference_state.compression_stats())]
        + [tuple(s.compression_stats()) for s in states],
    }


def subgroup_cast_worker() -> list[str]:
    """fp16 and top-k inside two groups of two: results equal torch's fp16 hook on the group,
    and the average of the group's top-k; nothing leaves the group."""
    from subgroups import split_into_groups

    compression, topk = module("compression"), module("compression_topk")
    info = split_into_groups(2)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    problems: list[str] = []
    with CommCounter() as comm:
        data = torch.randn(100, generator=g)
        out = resolve(
            compression.fp16_hook(info.group, bucket(data.clone(), [(100,)])),
            "fp16_hook",
        )
        want = resolve(
            default_hooks.fp16_compress_hook(info.group, bucket(data.clone(), [(100,)])),
            "torch",
        )
        if not torch.equal(out, want):
            problems.append(
                "fp16_hook(group, bucket) differs from torch's fp16_compress_hook on the same "
                "group (the test above compares on the world): divide by the group's size, "
                "all-reduce on the group"
            )
        state = topk.TopKState(info.group, ratio=0.1)
        out = resolve(topk.topk_hook(state, bucket(data.clone(), [(100,)])), "topk_hook")
        want = average(gather(sparse_top(data, 10), info.group))
        if not close(out, want, 1e-6):
            problems.append(
                "topk_hook with TopKState(group) differs from the average of the group's 2 "
                "top-k vectors (the top-k test above checks the world): gather on state.group, "
                "divide by its size"
            )
    crossing = [record.describe(dist.get_rank()) for record in comm.crossing(info.ranks)]
    problems += [f"{call} outside its group {info.ranks}: pass group=" for call in crossing[:2]]
    return problems
