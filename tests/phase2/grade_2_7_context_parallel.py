"""Grader of exercise 2.7, context parallelism: ``uv run pytest tests/test_phase2.py -m ex2_7``.

The layout rule, the causal block rule and the online-softmax merge are pure functions, checked
in this process. Ring attention runs in worlds of 2, 3 and 4 processes (one world per size,
shared by the tests of that size) and is compared, in float64 to 1e-10, with
``scaled_dot_product_attention`` on the whole sequence in one process: output and dQ/dK/dV,
causal and not, contiguous and zig-zag, several heads. Beyond values: the bytes each rank sends
((cp - 1)/cp of K and V per pass, forward and backward), the blocks each rank computes (future
blocks skipped; zig-zag balanced), the order of passes and blocks (the next block posted before
computing on the current one), refusals of lengths that do not split, a float32 run with large
scores, a group of 2 inside a world of 4, and a transformer block trained for a few steps
against one process. Expected values are computed here (tests/phase2/cp_helpers.py), with
slicing written independently of the code under test.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cp_helpers import (
    F64,
    close,
    difference,
    dq_block_shares,
    dq_share_problem,
    expected_chunks,
    order_problem,
    own_queries_share,
    raise_todo,
    reference,
    shard,
    step_blocks,
    todo_record,
)
from grading import defined_at, exercise, impl, learner_line, step_aside_unless_mine
from phase2_group_helpers import crossing_message, demo_module, fail, module, small_world
from subgroups import split_into_groups

from course.cli import parse_config
from course.comm_counter import CommCounter

ATOL = 1e-10  # float64: the ring sums in another order than one process
BATCH, HEADS, HEAD_DIM = 2, 3, 4
CASES = [(causal, zigzag) for causal in (False, True) for zigzag in (False, True)]
CP_SIZES = [2, 3, 4]


def layout_module() -> ModuleType:
    return module("context_parallel_layout")


def cp_module() -> ModuleType:
    return module("context_parallel")


def passes(cp: int) -> str:
    return f"{cp - 1} pass" + ("es" if cp > 2 else "")


def case_name(cp: int, causal: bool, zigzag: bool) -> str:
    return (
        f"2.7 ring attention, cp={cp}, {'causal' if causal else 'not causal'}, "
        f"{'zig-zag' if zigzag else 'contiguous'} layout"
    )


def case_tensors(cp: int, causal: bool, zigzag: bool) -> list[torch.Tensor]:
    """q, k, v and dL/dout of the whole sequence (4·cp positions), the same on every rank."""
    seed = 100 * cp + 10 * causal + zigzag
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, 4 * cp, HEAD_DIM)
    return [torch.randn(shape, dtype=F64, generator=generator) for _ in range(4)]


# ============================================================================ in this process


ZIGZAG_CP_SIZES = range(1, 7)  # the graded sizes of zigzag_chunk_ids


def zigzag_verdict(got_by_cp: dict[int, list[tuple[int, ...]]]) -> str | None:
    """What is wrong with zigzag_chunk_ids(rank, cp) for rank = 0..cp-1, given for every graded
    cp; None when it is torch's head-tail layout on every one. A cause is named only when every
    cp singles it out (at cp=1 most layouts coincide): the same pairs in the other order, or two
    neighbouring chunks per rank (the contiguous split). Otherwise the first wrong cp is
    described: which chunks are held twice, or the unbalanced work."""
    want_by_cp = {cp: [expected_chunks(r, cp, True) for r in range(cp)] for cp in got_by_cp}
    wrong = [cp for cp, got in got_by_cp.items() if got != want_by_cp[cp]]
    if not wrong:
        return None
    swapped = all(
        got == [tuple(reversed(pair)) for pair in want_by_cp[cp]] for cp, got in got_by_cp.items()
    )
    contiguous = all(
        got == [(2 * r, 2 * r + 1) for r in range(cp)] for cp, got in got_by_cp.items()
    )
    cp = wrong[0]
    got, want = got_by_cp[cp], want_by_cp[cp]
    where = f"2.7 zigzag_chunk_ids for cp={cp}"
    if swapped:
        return (
            f"{where}: chunk order swapped (at every cp): rank 0 holds {want[0]} with the earlier "
            f"chunk first (torch's head-tail layout, and the order your local q, k, v are laid "
            f"out in); yours lists {got[0]}"
        )
    held = sorted(chunk for pair in got for chunk in pair)
    if held != list(range(2 * cp)):
        twice = sorted({c for c in held if held.count(c) > 1})
        missing = sorted(set(range(2 * cp)) - set(held))
        return (
            f"{where}: every chunk 0..{2 * cp - 1} must be held by exactly one rank; yours "
            f"gives {got}: chunks {twice} held more than once, {missing} by no rank"
        )
    work = [sum(chunk + 0.5 for chunk in pair) for pair in got]
    if len(set(work)) > 1:
        return (
            f"{where}: each chunk is held once, but the causal work is not balanced: "
            f"ranks hold {got}, doing {work} blocks of causal attention (a chunk c attends "
            f"c earlier chunks and half of its own)"
            + (": two neighbouring chunks per rank is the contiguous split" if contiguous else "")
            + ": pair an early chunk with a late one so every rank's sum is the same"
        )
    return f"{where}: rank r should hold {want} (r = 0..{cp - 1}); yours gives {got}"


@exercise("2.7")
def test_zigzag_layout_pairs_an_early_chunk_with_a_late_one() -> None:
    layout = layout_module()
    got = {
        cp: [tuple(layout.zigzag_chunk_ids(rank, cp)) for rank in range(cp)]
        for cp in ZIGZAG_CP_SIZES
    }
    verdict = zigzag_verdict(got)
    if verdict:
        fail(verdict)


@exercise("2.7")
def test_shard_and_unshard_follow_the_layout() -> None:
    layout = layout_module()
    for cp, zigzag in [(2, False), (3, False), (2, True), (3, True), (4, True)]:
        length = 4 * cp
        x = torch.arange(length, dtype=F64).view(1, 1, length, 1)
        pieces = [layout.shard_sequence(x, rank, cp, zigzag=zigzag) for rank in range(cp)]
        for rank, piece in enumerate(pieces):
            want = shard(x, rank, cp, zigzag)
            if not torch.equal(piece, want):
                fail(
                    f"2.7 shard_sequence(cp={cp}, zigzag={zigzag}): rank {rank} should hold "
                    f"positions {want.flatten().long().tolist()}; it holds "
                    f"{piece.flatten().long().tolist()}"
                )
        whole = layout.unshard_sequence(pieces, zigzag=zigzag)
        if not torch.equal(whole, x):
            fail(f"2.7 unshard_sequence(cp={cp}, zigzag={zigzag}) did not restore the order")


BLOCK_RULE_CASES = [(q, k, c) for c in (False, True) for q in range(6) for k in range(6)]


def right_block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """The kind of the block (query chunk, key chunk): FULL, DIAGONAL or SKIP."""
    if not causal or k_chunk < q_chunk:
        return "FULL"
    return "DIAGONAL" if k_chunk == q_chunk else "SKIP"


def block_rule_verdict(got: dict[tuple[int, int, bool], Any]) -> str | None:
    """What is wrong with block_kind over every pair of 6 chunks, causal or not (``got``: the
    kind it returned, by (q chunk, k chunk, causal)); None when all are right. The rule is called
    mirrored only when it is exactly that: every causal block off the diagonal has the other of
    FULL and SKIP, and everything else is right."""
    from phase2_advanced.ring_attention_blocks import BlockKind

    wrong = []
    for q_chunk, k_chunk, causal in BLOCK_RULE_CASES:
        kind = got[(q_chunk, k_chunk, causal)]
        name = kind.name if isinstance(kind, BlockKind) else repr(kind)
        want = right_block_kind(q_chunk, k_chunk, causal)
        if name != want:
            wrong.append((q_chunk, k_chunk, causal, name, want))
    if not wrong:
        return None
    lines = []
    for q_chunk, k_chunk, causal, name, want in wrong[:4]:
        why = {
            "FULL": "every key of it is at or before every query"
            if causal
            else "without a causal mask every query sees every key",
            "DIAGONAL": "the same positions: query i sees keys j <= i only",
            "SKIP": "every key of it is after every query",
        }[want]
        lines.append(
            f"block_kind({q_chunk}, {k_chunk}, causal={causal}) should be {want} ({why}); "
            f"it returned {name}"
        )
    swap = {"FULL": "SKIP", "SKIP": "FULL"}
    mirrored = {(q, k, c, n) for q, k, c, n, _ in wrong} == {
        (q, k, True, swap[right_block_kind(q, k, True)])
        for q, k, c in BLOCK_RULE_CASES
        if c and q != k
    }
    advice = (
        "\n  Every causal block off the diagonal has the other of FULL and SKIP: the rule is "
        "mirrored (key chunks after the query chunk are the future, never used)"
        if mirrored
        else ""
    )
    more = f"\n  ({len(wrong)} of 72 wrong) " + "\n  ".join(lines[1:]) if len(wrong) > 1 else ""
    return f"2.7 causal block rule: {lines[0]}{more}{advice}"


@exercise("2.7")
def test_block_rule_skips_the_future_and_masks_the_diagonal() -> None:
    layout = layout_module()
    got = {(q, k, c): layout.block_kind(q, k, causal=c) for q, k, c in BLOCK_RULE_CASES}
    verdict = block_rule_verdict(got)
    if verdict:
        fail(verdict + defined_at(layout.block_kind))


def _partials(dtype: torch.dtype, magnitude: float, seed: int) -> list[torch.Tensor]:
    """Two partial results (out, lse) over disjoint key sets, from real blocks of attention."""
    from phase2_advanced.ring_attention_blocks import block_attention

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 5, 8, dtype=F64, generator=generator) * magnitude
    k = torch.randn(2, 2, 7, 8, dtype=F64, generator=generator) * magnitude
    v = torch.randn(2, 2, 7, 8, dtype=F64, generator=generator)
    out_a, lse_a = block_attention(q, k[:, :, :3], v[:, :, :3])
    out_b, lse_b = block_attention(q, k[:, :, 3:], v[:, :, 3:])
    out, lse = block_attention(q, k, v)
    return [t.to(dtype) for t in (out_a, lse_a, out_b, lse_b)] + [out, lse]


def merge_variants(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The merged outputs the usual mistakes give (by the mistake), and the lse that misses its
    shift, in float64."""
    oa, la, ob, lb = (t.to(F64) for t in (out_a, lse_a, out_b, lse_b))
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m).unsqueeze(-1), torch.exp(lb - m).unsqueeze(-1)
    outs = {
        "the weighted sum is not divided by the sum of the weights (each side weighs "
        "exp(lse - m) / (exp(lse_a - m) + exp(lse_b - m)))": wa * oa + wb * ob,
        "the weights are swapped: out_a weighs by lse_a's share, out_b by lse_b's": (
            wb * oa + wa * ob
        )
        / (wa + wb),
        "a plain average ignores how much of the softmax each side holds: weigh each side's out "
        "by exp(its lse - the merged lse)": (oa + ob) / 2,
        "the sides are weighed by their lse; the weights are the exponentials, exp(lse - the "
        "merged lse)": (la.unsqueeze(-1) * oa + lb.unsqueeze(-1) * ob) / (la + lb).unsqueeze(-1),
    }
    return outs, torch.log(torch.exp(la - m) + torch.exp(lb - m))


MERGE_CASES = [
    ("float64, scores of order 1", F64, 1.0, 1e-12),
    ("float64, lse in the thousands", F64, 30.0, 1e-9),
    ("float32, lse in the hundreds", torch.float32, 10.0, 2e-5),
]


def merge_verdict(
    label: str, magnitude: float, atol: float, got_out: torch.Tensor, got_lse: torch.Tensor
) -> str | None:
    """What is wrong with merge_partials' (out, lse) on the case ``label`` (its partials drawn
    with ``magnitude``, seed 7), None when both are attention over both key sets. A mistake is
    named only when the result matches that mistake's and no other's."""
    dtype = next(d for name, d, _, _ in MERGE_CASES if name == label)
    out_a, lse_a, out_b, lse_b, out, lse = _partials(dtype, magnitude, seed=7)
    size = float(torch.maximum(lse_a.abs(), lse_b.abs()).max())
    where = f"2.7 merge_partials, {label} (largest |lse| {size:.0f})"
    finite = bool(torch.isfinite(got_out).all() and torch.isfinite(got_lse).all())
    if not finite and size > 80:
        return (
            f"{where}: the merged result has inf or nan: exp of an lse this large "
            f"overflows ({'float32 above 88' if dtype == torch.float32 else 'float64 above 709'}"
            "): subtract the larger lse before exponentiating (the max shift), so every "
            "exponent is <= 0"
        )
    tolerance = atol * max(1.0, float(lse.abs().max()))
    if not close(got_lse, lse, tolerance):
        lse_variants = {
            ": yours is the larger of the two lse; add the log of the summed weights": torch.maximum(
                lse_a, lse_b
            ).to(F64),
            ": yours is lse_a + lse_b; the union's lse is the log of the summed exps": (
                lse_a + lse_b
            ).to(F64),
            ": yours is the log of the shifted sum, log(exp(lse_a - m) + exp(lse_b - m)), "
            "without the shift m added back": merge_variants(out_a, lse_a, out_b, lse_b)[1],
        }
        fits = [why for why, variant in lse_variants.items() if close(got_lse, variant, tolerance)]
        return (
            f"{where}: the merged lse should be the lse over both key sets "
            f"({difference(got_lse, lse)}){fits[0] if len(fits) == 1 else ''}"
        )
    if not close(got_out, out, atol):
        named = [
            why
            for why, variant in merge_variants(out_a, lse_a, out_b, lse_b)[0].items()
            if close(got_out, variant, atol)
        ]
        return (
            f"{where}: the merged output should be attention over both key sets "
            f"({difference(got_out, out)}); the lse is right, so look at the weights: "
            + (
                named[0]
                if len(named) == 1
                else "this fits each of: " + "; ".join(named)
                if named
                else "each side's out weighs by its share of the summed exponentials, "
                "exp(its lse - the merged lse)"
            )
        )
    return None


@exercise("2.7")
def test_merge_of_two_partials_equals_attention_over_both_key_sets() -> None:
    cp = cp_module()
    for label, dtype, magnitude, atol in MERGE_CASES:
        out_a, lse_a, out_b, lse_b, out, lse = _partials(dtype, magnitude, seed=7)
        got_out, got_lse = cp.merge_partials(out_a, lse_a, out_b, lse_b)
        verdict = merge_verdict(label, magnitude, atol, got_out, got_lse)
        if verdict:
            fail(verdict)
        tolerance = atol * max(1.0, float(lse.abs().max()))
        swapped_out, swapped_lse = cp.merge_partials(out_b, lse_b, out_a, lse_a)
        if not (close(swapped_out, out, atol) and close(swapped_lse, lse, tolerance)):
            fail(
                f"2.7 merge_partials, {label}: merging (b, a) should give what merging (a, b) "
                "gives; it does not"
            )


# ============================================================================ ring attention worlds


def ring_case(
    cp_mod: ModuleType, rank: int, cp: int, causal: bool, zigzag: bool, group: Any = None
) -> dict[str, Any]:
    """One forward and backward on this rank, with everything the tests read."""
    from phase2_advanced.ring_attention_blocks import record_block_work

    q, k, v, grad = (shard(t, rank, cp, zigzag) for t in case_tensors(cp, causal, zigzag))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    result: dict[str, Any] = {}
    with record_block_work() as work, CommCounter() as comm:
        out = cp_mod.ring_attention(q, k, v, group, causal=causal, zigzag=zigzag)
    events = "".join({"post": "P", "wait": "W", "compute": "C"}[kind] for kind, _ in work.events)
    _, lse = cp_mod.ring_attention_forward(
        q.detach(), k.detach(), v.detach(), group, causal=causal, zigzag=zigzag,
        scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    result.update(
        lse=lse.clone(),
        out=out.detach().clone(),
        forward_bytes=comm.bytes_sent,
        forward_events=events,
        forward_blocks=[(call.diagonal, call.q_len) for call in work.calls("forward")],
        crossing=None,
    )
    try:
        with record_block_work() as work, CommCounter() as comm:
            out.backward(grad)
    except NotImplementedError as exc:
        result["backward_todo"] = todo_record(exc)
        return result
    result.update(
        grads=[t.grad for t in (q, k, v)],
        backward_bytes=comm.bytes_sent,
        backward_blocks=[(call.diagonal, call.q_len) for call in work.calls("backward")],
    )
    return result


def large_scores_case(cp_mod: ModuleType, rank: int, cp: int) -> dict[str, Any]:
    """float32, scores in the hundreds (lse far beyond exp's float32 range), causal, zig-zag."""
    q, k, v, grad = (t.float() for t in large_scores_tensors(cp))
    q, k, v, grad = (shard(t, rank, cp, True) for t in (q, k, v, grad))
    out = cp_mod.ring_attention(q, k, v, None, causal=True, zigzag=True)
    return {"out": out.detach().clone()}


def large_scores_tensors(cp: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    shape = (1, 2, 4 * cp, 8)
    q, k, v = (torch.randn(shape, dtype=F64, generator=generator) for _ in range(3))
    return [q * 8, k * 8, v, v]


def refusal_case(cp_mod: ModuleType) -> dict[str, Any]:
    """ring_attention on a zig-zag local length that cannot hold two equal chunks."""
    x = torch.zeros(1, 1, 3, 4, dtype=F64)
    with CommCounter() as comm:
        try:
            cp_mod.ring_attention(x, x, x, None, causal=True, zigzag=True)
            message = None
        except ValueError as err:
            message = str(err)
    return {"message": message, "calls": len(comm.records)}


def training_case(cp_mod: ModuleType, rank: int, cp: int) -> dict[str, Any]:
    """The block trained on zig-zag shards for 3 steps (losses and final weights)."""
    from phase2_advanced.context_parallel_model import build_block, train_steps

    x, target = training_data(cp)
    block = build_block(8, 2, 16, seed=3)

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_mod.ring_attention(q, k, v, None, causal=True, zigzag=True)

    try:
        losses = train_steps(
            block, shard(x, rank, cp, True, dim=1), shard(target, rank, cp, True, dim=1), ring,
            steps=3, total_elements=target.numel(),
        )  # fmt: skip
    except NotImplementedError as exc:
        return {"todo": todo_record(exc)}
    return {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in block.named_parameters()},
    }


def training_data(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return (
        torch.randn(2, 4 * cp, 8, dtype=F64, generator=generator),
        torch.randn(2, 4 * cp, 8, dtype=F64, generator=generator),
    )


def subgroup_case(cp_mod: ModuleType) -> dict[str, Any]:
    """Causal zig-zag ring attention in the groups (0, 1) and (2, 3), each on its own sequence."""
    info = split_into_groups(2)
    with CommCounter() as comm:
        tensors = case_tensors(2 + 10 * info.index, True, True)
        q, k, v, grad = (shard(t[:, :, :8], info.group_rank, 2, True) for t in tensors)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        try:
            out = cp_mod.ring_attention(q, k, v, info.group, causal=True, zigzag=True)
            out.backward(grad)
        except NotImplementedError as exc:
            return {"todo": todo_record(exc)}
        except Exception as exc:  # reported by the subgroup test, not by every test of cp=4
            return {"error": f"{type(exc).__name__}: {exc}{learner_line(exc)}", "index": info.index}
    return {
        "index": info.index,
        "group_rank": info.group_rank,
        "out": out.detach().clone(),
        "grads": [t.grad for t in (q, k, v)],
        "crossing": crossing_message(comm, info),
    }


def ring_worker(cp: int) -> dict[str, Any]:
    cp_mod, rank = cp_module(), dist.get_rank()
    results: dict[str, Any] = {
        "cases": {
            (causal, zigzag): ring_case(cp_mod, rank, cp, causal, zigzag)
            for causal, zigzag in CASES
        }
    }
    if cp == 2:
        results["large"] = large_scores_case(cp_mod, rank, cp)
    if cp == 3:
        results["refusal"] = refusal_case(cp_mod)
    if cp in (2, 3):
        results["training"] = training_case(cp_mod, rank, cp)
    if cp == 4:
        results["subgroup"] = subgroup_case(cp_mod)
    return results


_WORLDS: dict[tuple[str, int], list[dict[str, Any]] | Exception] = {}
# When the ranks of a world raise in the backward, the gradient test reports it and the tests
# before it (the output's) step aside; an error elsewhere is reported by the first test.
WORLD_OWNERS = {"ring_attention_backward": "test_ring_attention_gradients_equal_sdpa"}
LEARNER_FILES = {"context_parallel.py", "context_parallel_layout.py"}


def ring_world(cp: int) -> list[dict[str, Any]]:
    """The results of every rank of the world of ``cp`` (run once, shared by the tests)."""
    key = (impl(), cp)
    if key not in _WORLDS:
        try:
            _WORLDS[key] = small_world(ring_worker, cp, cp)
        except Exception as exc:  # re-raised for every test of this world
            _WORLDS[key] = exc
    found = _WORLDS[key]
    if isinstance(found, Exception):
        step_aside_unless_mine(found, WORLD_OWNERS, LEARNER_FILES)
        raise found
    return found


def _chunk_advice(results: list[dict[str, Any]], cp: int, zigzag: bool) -> str:
    if not zigzag:
        return ""
    try:
        got = [tuple(layout_module().zigzag_chunk_ids(r, cp)) for r in range(cp)]
    except NotImplementedError:
        return ""
    want = [expected_chunks(r, cp, True) for r in range(cp)]
    return (
        f"\n  Your zigzag_chunk_ids gives {got}, not {want}: fix that first (the ring takes the "
        "chunk ids of every block from it)"
        if got != want
        else ""
    )


@exercise("2.7")
@pytest.mark.parametrize("cp", CP_SIZES)
def test_ring_attention_output_equals_sdpa_on_the_whole_sequence(cp: int) -> None:
    results = ring_world(cp)
    wrong = []
    for causal, zigzag in CASES:
        q, k, v, grad = case_tensors(cp, causal, zigzag)
        ref = reference(q, k, v, grad, causal)
        for rank, result in enumerate(results):
            got = result["cases"][(causal, zigzag)]["out"]
            if not close(got, shard(ref.out, rank, cp, zigzag), ATOL):
                wrong.append(
                    (causal, zigzag, rank, difference(got, shard(ref.out, rank, cp, zigzag)))
                )
    if not wrong:
        _check_lse(results, cp)
        return
    causal, zigzag, rank, _ = wrong[0]
    silent = results[rank]["cases"][(causal, zigzag)]["forward_bytes"] == 0
    bad_lse = [
        (c, z, r)
        for c, z in CASES
        for r, result in enumerate(results)
        if (c, z, r) not in {(wc, wz, wr) for wc, wz, wr, _ in wrong}
        and not close(
            result["cases"][(c, z)]["lse"],
            shard(case_reference(cp, c, z).lse, r, cp, z),
            ATOL,
        )
    ]
    only_causal = all(c for c, _, _, _ in wrong) and not silent
    fail(
        output_verdict(
            cp, wrong, bad_lse[0] if bad_lse else None, silent, only_causal and _block_kind_right()
        )
        + _chunk_advice(results, cp, zigzag)
    )


def output_verdict(
    cp: int,
    wrong: list[tuple[bool, bool, int, str]],
    bad_lse: tuple[bool, bool, int] | None,
    silent: bool,
    block_kind_right: bool,
) -> str:
    """The failure of the ring's output, from what was measured: the (causal, zigzag, rank)
    outputs that differ (with how), the first right output whose lse is wrong, whether the first
    wrong rank sent nothing, whether the learner's block_kind is right. It describes the lse and
    the silence; where only causal cases differ it lists the causes that fit (it cannot tell
    the chunk ids of a visiting block from how the forward acts on the kind)."""
    causal, zigzag, rank, diff = wrong[0]
    only_causal = all(c for c, _, _, _ in wrong) and not silent
    advice = (
        f"\n  Where the output is right ({case_name(cp, bad_lse[0], bad_lse[1])}, rank "
        f"{bad_lse[2]}), the lse is already wrong: every merge must return the lse over both "
        "key sets, or the next merge weighs the blocks wrongly (a query chunk that meets more "
        "blocks goes wrong first)"
        if bad_lse
        else _only_causal_advice(block_kind_right)
        if only_causal
        else "\n  This rank sent nothing in the forward: every K/V block must travel around the "
        "ring (start_ring_pass), or the queries only ever meet their own keys"
        if silent
        else ""
    )
    return (
        f"{case_name(cp, causal, zigzag)}, rank {rank}: the output should equal "
        f"scaled_dot_product_attention on the whole sequence at this rank's positions ({diff}); "
        f"{len(wrong)} of {len(CASES) * cp} (case, rank) outputs differ" + advice
    )


def _block_kind_right() -> bool:
    """Whether the learner's block_kind gives the causal rule for every pair of 6 chunks."""
    layout = layout_module()
    try:
        return all(
            layout.block_kind(q, k, causal=causal).name
            == ("FULL" if not causal or k < q else "DIAGONAL" if k == q else "SKIP")
            for causal in (False, True)
            for q in range(6)
            for k in range(6)
        )
    except Exception:
        return False


def _only_causal_advice(block_kind_right: bool) -> str:
    """Advice when every non-causal output is right and some causal one is not: with the
    learner's block_kind right, two causes in the forward fit (listed); else block_kind too."""
    if block_kind_right:
        return (
            "\n  Every non-causal case is right, so the ring and the merge work, and your "
            "block kinds follow the causal rule; the causes that fit: the chunk ids the forward "
            "gives a visiting block (a block holds the chunks of the rank it started on, and "
            "which rank that is changes with the step), or how it acts on the kind (a SKIP "
            "block skipped, a DIAGONAL block computed with causal=True)"
        )
    return (
        "\n  Every non-causal case is right, so the ring and the merge work: look at which "
        "blocks are skipped or masked (block_kind, and the chunk ids of the visiting block: those "
        "of the rank it started on)"
    )


def _check_lse(results: list[dict[str, Any]], cp: int) -> None:
    """The forward's lse (what the backward needs), once every output is right."""
    for causal, zigzag in CASES:
        q, k, v, grad = case_tensors(cp, causal, zigzag)
        ref = reference(q, k, v, grad, causal)
        for rank, result in enumerate(results):
            got, want = result["cases"][(causal, zigzag)]["lse"], shard(ref.lse, rank, cp, zigzag)
            if not close(got, want, ATOL):
                fail(
                    f"{case_name(cp, causal, zigzag)}, rank {rank}: the output is right, but the "
                    f"lse ring_attention_forward returns is not the log-sum-exp of each query's "
                    f"scores over every key ({difference(got, want)}): the backward needs it, "
                    "so every merge must return the lse over both key sets"
                )


def _dkdv_advice(
    got: torch.Tensor,
    name: str,
    ref_full: torch.Tensor,
    homes: list[torch.Tensor],
    rank: int,
    cp: int,
    zigzag: bool,
) -> str:
    """What a wrong dK or dV of rank ``rank`` looks like (``homes[r]``: rank r's own queries'
    share of its own block's dK or dV)."""
    want = shard(ref_full, rank, cp, zigzag)
    home = homes[rank]
    if close(got, home, ATOL):
        return (
            f"{name} holds only this rank's own queries' share: the shares computed on the "
            "other ranks never came home (the last dK/dV pass, and adding what it brings, is "
            "missing)"
        )
    if close(got, want - home, ATOL):
        return (
            f"{name} holds the other ranks' shares but not this rank's own: add what comes home "
            "to the share computed at step 0, do not replace it"
        )
    for other in range(cp):
        if other != rank and close(got, want + homes[other], ATOL):
            return (
                f"{name} is the right sum plus rank {other}'s own share of its own block: a "
                f"travelling {name} sum started from a copy of rank {other}'s {name} instead of "
                "zeros (each block's travelling sum starts at zeros on the rank after its home)"
            )
        if other != rank and close(got, shard(ref_full, other, cp, zigzag), ATOL):
            return (
                f"{name} is the gradient of rank {other}'s positions: the sums ended on the wrong "
                "rank (the pass after the last step must land on the block's home rank)"
            )
    return (
        f"{name} differs ({difference(got, want)}): each block's {name} must collect every "
        "rank's share, computed with that block's K/V, and end on its home rank"
    )


def case_reference(cp: int, causal: bool, zigzag: bool) -> Any:
    """The one-process reference of a case (see cp_helpers.reference)."""
    q, k, v, grad = case_tensors(cp, causal, zigzag)
    return reference(q, k, v, grad, causal)


CAUSAL_RULE_ADVICE = (
    "the causal rule in the backward: the same blocks skipped as in the forward, and the "
    "diagonal block computed with its mask (causal=True for it), as in the forward"
)
CHUNK_SLICING_ADVICE = (
    "what changes with two chunks per rank: the query side of a block (q, out, lse, the "
    "incoming gradient, dQ) is sliced by its query chunk, the key side (k, v, dK, dV) by its key "
    "chunk"
)


def _pattern_advice(wrong: set[tuple[bool, bool]]) -> str:
    """What the set of wrong (causal, zigzag) cases points at, when it points at something:
    every causal case and no other (the causal rule), every zigzag case and no other (the
    slicing by chunk), or only the causal zigzag case, which both fit (listed, not named)."""
    only_causal = wrong == {(True, False), (True, True)}
    only_zigzag = wrong == {(False, True), (True, True)}
    if wrong == {(True, True)}:
        return (
            "only the causal zigzag case differs, and two causes fit it: "
            + CAUSAL_RULE_ADVICE
            + "; or "
            + CHUNK_SLICING_ADVICE
        )
    if only_causal:
        return (
            "every non-causal case is right, so the ring and the sums work: look at "
            + CAUSAL_RULE_ADVICE
        )
    if only_zigzag:
        return "every contiguous case is right, so look at " + CHUNK_SLICING_ADVICE
    return ""


@exercise("2.7")
@pytest.mark.parametrize("cp", CP_SIZES)
def test_ring_attention_gradients_equal_sdpa(cp: int) -> None:
    results = ring_world(cp)
    for rank, result in enumerate(results):
        for case in result["cases"].values():
            if "backward_todo" in case:
                raise_todo(rank, case["backward_todo"])
    refs = {}
    for causal, zigzag in CASES:
        q, k, v, grad = case_tensors(cp, causal, zigzag)
        refs[(causal, zigzag)] = reference(q, k, v, grad, causal)
    wrong: dict[str, list[tuple[bool, bool, int]]] = {"dQ": [], "dK": [], "dV": []}
    for causal, zigzag in CASES:
        ref = refs[(causal, zigzag)]
        for rank, result in enumerate(results):
            grads = result["cases"][(causal, zigzag)]["grads"]
            for name, got, full in zip(
                ("dQ", "dK", "dV"), grads, (ref.dq, ref.dk, ref.dv), strict=True
            ):
                if not close(got, shard(full, rank, cp, zigzag), ATOL):
                    wrong[name].append((causal, zigzag, rank))
    if not any(wrong.values()):
        return
    # a wrong forward explains wrong gradients: say so first
    for causal, zigzag in CASES:
        ref = refs[(causal, zigzag)]
        for rank, result in enumerate(results):
            case = result["cases"][(causal, zigzag)]
            where = f"{case_name(cp, causal, zigzag)}, rank {rank}"
            if not close(case["out"], shard(ref.out, rank, cp, zigzag), ATOL):
                fail(
                    f"{where}: the gradients differ from scaled_dot_product_attention's, and the "
                    "forward output is already wrong: fix the forward first (the output test)"
                )
            if not close(case["lse"], shard(ref.lse, rank, cp, zigzag), ATOL):
                fail(
                    f"{where}: the gradients differ from scaled_dot_product_attention's, and the "
                    "forward's lse is wrong: the backward needs the lse over every key, fix it "
                    "first (the output test says how)"
                )
    if wrong["dQ"]:
        causal, zigzag, rank = wrong["dQ"][0]
        k = case_tensors(cp, causal, zigzag)[1]
        ref = refs[(causal, zigzag)]
        dq = results[rank]["cases"][(causal, zigzag)]["grads"][0]
        cause = (
            dq_share_problem(dq, dq_block_shares(ref, k, rank, cp, zigzag, causal), ATOL)
            or _pattern_advice({(c, z) for c, z, _ in wrong["dQ"]})
            or "the forward's output and lse are right, so the backward computed some block "
            "with a K/V other than the one of its step (a stale block kept from an earlier "
            "step, or the one already received for the next), or with an out/lse slice other "
            "than its query chunk's"
        )
        fail(
            f"{case_name(cp, causal, zigzag)}, rank {rank}: dQ should equal "
            f"scaled_dot_product_attention's ({difference(dq, shard(ref.dq, rank, cp, zigzag))}); "
            f"{cause}"
        )
    name = "dK" if wrong["dK"] else "dV"
    causal, zigzag, rank = wrong[name][0]
    got = results[rank]["cases"][(causal, zigzag)]["grads"][1 if name == "dK" else 2]
    pattern = _pattern_advice({(c, z) for c, z, _ in wrong[name]})
    site = defined_at(getattr(cp_module(), "ring_attention_backward", None))
    fail(dkdv_verdict(cp, causal, zigzag, rank, name, got, pattern) + site)


def dkdv_verdict(
    cp: int, causal: bool, zigzag: bool, rank: int, name: str, got: torch.Tensor, pattern: str = ""
) -> str:
    """The failure for rank ``rank``'s wrong ``name`` ("dK" or "dV") on one case, dQ being right:
    what it holds, when it is a known mistake's sum, else how far off it is and ``pattern`` (what
    the set of wrong cases points at)."""
    q, k, v, grad = case_tensors(cp, causal, zigzag)
    ref = reference(q, k, v, grad, causal)
    index = 0 if name == "dK" else 1
    homes = [own_queries_share(ref, q, grad, r, cp, zigzag)[index] for r in range(cp)]
    full = ref.dk if name == "dK" else ref.dv
    advice = _dkdv_advice(got, name, full, homes, rank, cp, zigzag)
    if pattern and advice.startswith(f"{name} differs"):
        advice = f"{name} differs ({difference(got, shard(full, rank, cp, zigzag))}); {pattern}"
    return f"{case_name(cp, causal, zigzag)}, rank {rank}: dQ is right, but {advice}"


@exercise("2.7")
@pytest.mark.parametrize("cp", CP_SIZES)
def test_each_rank_sends_cp_minus_1_over_cp_of_k_and_v_each_way(cp: int) -> None:
    results = ring_world(cp)
    for causal, zigzag in CASES:
        kv = 2 * BATCH * HEADS * 4 * HEAD_DIM * 8  # this rank's K and V: 4 positions, float64
        for rank, result in enumerate(results):
            case = result["cases"][(causal, zigzag)]
            where = f"{case_name(cp, causal, zigzag)}, rank {rank}"
            sent, want = case["forward_bytes"], (cp - 1) * kv
            if sent != want:
                advice = {
                    0: "it sent nothing: the K/V blocks must travel around the ring",
                    cp * kv: "one pass too many: after the last step no block needs to move",
                }.get(sent, "")
                fail(
                    f"{where}: the forward should send {passes(cp)} of this rank's K and V "
                    f"({kv} bytes each), {want} bytes = (cp-1)/cp of the whole K and V; it sent "
                    f"{sent}" + (f": {advice}" if advice else "")
                )
            if "backward_todo" in case:
                raise_todo(rank, case["backward_todo"])
            sent, want = case["backward_bytes"], 2 * (cp - 1) * kv
            if sent != want:
                advice = {
                    want + kv: "one dK/dV pass too many: the home rank's own share never "
                    "needs to travel: keep it at home, start the travelling sums at zeros on "
                    "the next rank, and add what comes home to it",
                    (cp - 1) * kv: "that is the K/V passes only: the dK/dV sums must travel too",
                }.get(sent, "")
                fail(
                    f"{where}: the backward should send {passes(cp)} of K/V and {cp - 1} of "
                    f"their dK/dV sums, {want} bytes (each (cp-1)/cp of the whole); it sent "
                    f"{sent}" + (f": {advice}" if advice else "")
                )


@exercise("2.7")
@pytest.mark.parametrize("cp", CP_SIZES)
def test_blocks_in_the_future_are_skipped_and_zigzag_balances_the_work(cp: int) -> None:
    results = ring_world(cp)
    for causal, zigzag in CASES:
        for rank, result in enumerate(results):
            case = result["cases"][(causal, zigzag)]
            where = f"{case_name(cp, causal, zigzag)}, rank {rank}"
            steps = step_blocks(rank, cp, zigzag, causal)
            want = (sum(f for f, _ in steps), sum(d for _, d in steps))
            for direction in ("forward", "backward"):
                if f"{direction}_blocks" not in case:
                    raise_todo(rank, case["backward_todo"])
                blocks = case[f"{direction}_blocks"]
                got = (sum(1 for diag, _ in blocks if not diag), sum(1 for d, _ in blocks if d))
                if got != want:
                    more = got[0] + got[1] > want[0] + want[1]
                    advice = (
                        "blocks entirely in the future must be skipped, not computed"
                        if more
                        else "some needed blocks were never computed"
                    )
                    fail(
                        f"{where}: the {direction} should compute {want[0]} full and {want[1]} "
                        f"diagonal (masked) blocks on this rank; it computed {got[0]} full and "
                        f"{got[1]} diagonal: {advice}" + _chunk_advice(results, cp, zigzag)
                    )


@exercise("2.7")
@pytest.mark.parametrize("cp", CP_SIZES)
def test_next_block_is_posted_before_computing_on_the_current_one(cp: int) -> None:
    results = ring_world(cp)
    for causal, zigzag in CASES:
        for rank, result in enumerate(results):
            got = result["cases"][(causal, zigzag)]["forward_events"]
            problem = order_problem(got, cp)
            if problem:
                fail(f"{case_name(cp, causal, zigzag)}, rank {rank}, forward: {problem}")


@exercise("2.7")
def test_float32_with_large_scores_stays_accurate() -> None:
    results = ring_world(2)
    q, k, v, grad = large_scores_tensors(2)
    ref = reference(q, k, v, grad, True)
    for rank, result in enumerate(results):
        got = result["large"]["out"]
        if not close(got, shard(ref.out, rank, 2, True), 1e-3):
            if not bool(torch.isfinite(got).all()):
                why = (
                    "exp of an lse this large overflows float32: every merge must subtract the "
                    "larger lse before exponentiating"
                )
            elif _float64_case_right(results):
                why = (
                    "the same layout is right in float64, so precision is lost: keep the merge's "
                    "exponents <= 0 (subtract the larger lse) and the sums in lse's dtype"
                )
            else:
                why = "the float64 causal zig-zag case is wrong too: fix that first"
            fail(
                f"2.7 ring attention in float32 with scores in the hundreds (cp=2, causal, "
                f"zig-zag), rank {rank}: the output should be within 1e-3 of float64 SDPA "
                f"({difference(got, shard(ref.out, rank, 2, True))}): {why}"
            )


def _float64_case_right(results: list[dict[str, Any]]) -> bool:
    q, k, v, grad = case_tensors(2, True, True)
    ref = reference(q, k, v, grad, True)
    return all(
        close(result["cases"][(True, True)]["out"], shard(ref.out, rank, 2, True), ATOL)
        for rank, result in enumerate(results)
    )


@exercise("2.7")
def test_lengths_that_do_not_split_evenly_are_refused() -> None:
    layout = layout_module()
    for length, cp, zigzag, chunks, padded in [(10, 3, False, 3, 12), (9, 3, True, 6, 12)]:
        x = torch.zeros(1, 1, length, 2)
        with pytest.raises(ValueError) as caught:
            layout.shard_sequence(x, 0, cp, zigzag=zigzag)
        message = str(caught.value)
        for part in (
            f"sequence length {length}",
            f"{chunks} equal chunks",
            f"Pad the sequence to {padded}",
        ):
            assert part in message, f"2.7 shard_sequence's refusal should say {part!r}: {message}"
    refusal = ring_world(3)[0]["refusal"]
    if refusal["message"] is None:
        fail("2.7 ring_attention with a zig-zag local length of 3 should raise ValueError")
    if "local length 3" not in refusal["message"] or refusal["calls"]:
        fail(
            "2.7 ring_attention with a zig-zag local length of 3 should refuse it, naming the "
            f"length, before any message; it said {refusal['message']!r} after "
            f"{refusal['calls']} calls to torch.distributed"
        )


@exercise("2.7")
def test_ring_attention_inside_a_group_of_2_stays_in_it() -> None:
    results = ring_world(4)
    for rank, result in enumerate(results):
        sub = result["subgroup"]
        if "todo" in sub:
            raise_todo(rank, sub["todo"])
        if "error" in sub:
            group_rank = (
                ": inside a group, this rank's index is dist.get_rank(group), not its rank in "
                "the world"
                if "is not in a context-parallel group" in sub["error"]
                else ""
            )
            fail(
                f"2.7 ring attention in the group of ranks {2 * sub['index']}-"
                f"{2 * sub['index'] + 1} of a world of 4, rank {rank}, raised {sub['error']}"
                + group_rank
            )
        where = f"2.7 ring attention in the group of ranks {2 * sub['index']}-{2 * sub['index'] + 1} of a world of 4 (cp=2, causal, zig-zag), rank {rank}"
        if sub["crossing"]:
            fail(f"{where}: it communicated outside its group: {sub['crossing']}")
        tensors = case_tensors(2 + 10 * sub["index"], True, True)
        q, k, v, grad = (t[:, :, :8] for t in tensors)
        ref = reference(q, k, v, grad, True)
        wants = [ref.out, ref.dq, ref.dk, ref.dv]
        for name, got, want in zip(
            ("output", "dQ", "dK", "dV"), [sub["out"], *sub["grads"]], wants, strict=True
        ):
            if not close(got, shard(want, sub["group_rank"], 2, True), ATOL):
                fail(
                    f"{where}: the {name} should equal its group's one-process attention "
                    f"({difference(got, shard(want, sub['group_rank'], 2, True))}); "
                    + _group_advice()
                )


def _group_advice() -> str:
    """Advice for a wrong result inside a group, depending on whether a world of 2 is right."""
    try:
        results = ring_world(2)
    except Exception:
        return "the world of 2 failed too: start with its tests"
    q, k, v, grad = case_tensors(2, True, True)
    ref = reference(q, k, v, grad, True)
    for rank, result in enumerate(results):
        case = result["cases"][(True, True)]
        got = [case["out"], *case.get("grads", [])]
        wants = [ref.out, ref.dq, ref.dk, ref.dv][: len(got)]
        if not all(
            close(g, shard(w, rank, 2, True), ATOL) for g, w in zip(got, wants, strict=True)
        ):
            return (
                "the same case is wrong in a world of 2 (test_ring_attention_*[2]): fix that first"
            )
    return (
        "the same case is right in a world of 2, so the group is the difference: ranks and "
        "sizes come from dist.get_rank(group) / dist.get_world_size(group), peers from "
        "ring_neighbours(group), and every pass goes through start_ring_pass(..., group)"
    )


@exercise("2.7")
@pytest.mark.parametrize("cp", [2, 3])
def test_a_ring_attention_block_trains_like_one_process(cp: int) -> None:
    from phase2_advanced.context_parallel_model import build_block, sdpa_attention, train_steps

    results = ring_world(cp)
    x, target = training_data(cp)
    single = build_block(8, 2, 16, seed=3)
    want = train_steps(single, x, target, sdpa_attention(True), steps=3)
    weights = dict(single.named_parameters())
    for rank, result in enumerate(results):
        found = result["training"]
        if "todo" in found:
            raise_todo(rank, found["todo"])
        where = f"2.7 a transformer block with ring attention trained on zig-zag shards (cp={cp}, 3 AdamW steps), rank {rank}"
        losses = found["losses"]
        if any(abs(a - b) > ATOL for a, b in zip(losses, want, strict=True)):
            fail(
                f"{where}: the losses should equal one process's {want}; they are {losses} "
                "(the block's training is given: only ring attention differs, and the tests of "
                "its output and gradients above say how)"
            )
        for name, got in found["weights"].items():
            if not close(got, weights[name].detach(), ATOL):
                fail(
                    f"{where}: {name} should equal one process's after 3 steps "
                    f"({difference(got, weights[name].detach())})"
                )


# ============================================================================ library, demo


def library_worker() -> dict[str, Any]:
    from course.distributed import current_info

    library = demo_module("library.context_parallel")
    if current_info().device.type == "cuda":
        return {"skipped": "a GPU world: the library runs there; this test documents CPU"}
    mesh = library.cp_mesh(None, "cpu")
    x = torch.arange(16, dtype=F64).view(1, 1, 16, 1)
    return {
        "shard": library.library_cp_shard(x, mesh),
        "refusal": library.cpu_refusal(mesh),
    }


_LIBRARY: list[list[dict[str, Any]]] = []


def library_results() -> list[dict[str, Any]]:
    if not _LIBRARY:
        _LIBRARY.append(small_world(library_worker, 2))
    if "skipped" in _LIBRARY[0][0]:
        pytest.skip(_LIBRARY[0][0]["skipped"])
    return _LIBRARY[0]


@exercise("2.7")
@pytest.mark.reference
def test_library_shards_a_sequence_in_the_zigzag_layout() -> None:
    x = torch.arange(16, dtype=F64).view(1, 1, 16, 1)
    for rank, result in enumerate(library_results()):
        want = shard(x, rank, 2, True)
        assert torch.equal(result["shard"], want), (
            f"torch's context-parallel shard of rank {rank} is "
            f"{result['shard'].flatten().tolist()}, the zig-zag layout's {want.flatten().tolist()}"
        )


@exercise("2.7")
@pytest.mark.reference
def test_library_ring_attention_cannot_run_on_cpu() -> None:
    for result in library_results():
        refusal = result["refusal"]
        assert refusal is not None and "_scaled_dot_product_flash_attention_for_cpu" in refusal, (
            "the guide says torch's context_parallel refuses CPU attention; it now says "
            f"{refusal!r}: update phase2_advanced/guidelines.md#27-context-parallelism"
        )


def demo_worker(impl_name: str) -> dict[str, Any]:
    demo = demo_module("demos.context_parallel")
    config = demo.DemoConfig(batch_size=1, heads=2, seq_len=8, head_dim=4, steps=2, impl=impl_name)
    return demo.run_demo(config)


@exercise("2.7")
def test_instructor_demo_reports_equality_bytes_and_balance() -> None:
    results = small_world(demo_worker, 2, impl())[0]
    label = "2.7 context_parallel_demo on 2 ranks"
    for layout in ("contiguous", "zigzag"):
        found = results[layout]
        for name, diff in found["diffs"].items():
            if diff > ATOL:
                fail(
                    f"{label}: in the {layout} layout, the {name} of ring attention differs "
                    f"from SDPA's by {diff:.2e} (the tests above say why)"
                )
        if found["forward_bytes"] != found["expected_forward_bytes"]:
            fail(
                f"{label}: {layout} sent {found['forward_bytes']} bytes forward, expected "
                f"{found['expected_forward_bytes']}"
            )
    if len(set(results["zigzag"]["pairs"])) != 1:
        fail(f"{label}: zig-zag should balance the query-key pairs: {results['zigzag']['pairs']}")
    training = results["training"]
    if max(training.values()) > ATOL:
        fail(f"{label}: the trained block differs from one process: {training}")


@exercise("2.7")
@pytest.mark.reference
@pytest.mark.parametrize(
    ("argv", "world", "expected"),
    [
        (["--heads", "0"], 2, "--heads 0: must be >= 1"),
        (["--seq-len", "1"], 2, "--seq-len 1: must be >= 2"),
        (["--steps", "-1"], 2, "--steps -1: must be >= 0"),
        (["--cp-size", "3"], 4, "--cp-size 3 does not divide the world size 4"),
        (["--seq-len", "10"], 2, "--seq-len 10 is not a multiple of 2·cp = 4"),
    ],
)
def test_demo_refuses_bad_settings_before_starting(
    argv: list[str], world: int, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = demo_module("demos.context_parallel")
    try:
        config = parse_config(demo.DemoConfig, argv, demo.__doc__)
    except SystemExit as exit_:
        assert exit_.code == 2
        assert expected in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=expected.replace("·", ".")):
        demo.validate_config(config, world)


@exercise("2.7")
@pytest.mark.reference
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--cps", "1"], "--cps 1: each size must be 2..8"),
        (["--cps", "2,x"], "--cps '2,x': give integers like 2,4"),
        (["--seq-len", "2052"], "--seq-len 2052 is not a multiple of 2·cp = 8"),
        (["--repeats", "0"], "--repeats 0: must be >= 1"),
        (["--lengths", "0,16"], "--lengths '0,16': give positive integers"),
        (["--head-dim", "0"], "--head-dim 0: must be >= 1"),
    ],
)
def test_benchmark_refuses_bad_settings_before_starting(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark = demo_module("benchmarks.context_parallel")
    try:
        code = benchmark.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2, f"{argv}: exit status {code}, expected 2"
    assert expected in capsys.readouterr().err


@exercise("2.7")
@pytest.mark.reference
def test_benchmark_tables_compute_the_values_the_guide_quotes() -> None:
    benchmark = demo_module("benchmarks.context_parallel")

    def rank(pairs: int, cpu: float) -> dict[str, dict[str, float]]:
        return {
            "contiguous": {"pairs": pairs, "cpu": cpu, "wall": 1.0},
            "zig-zag": {"pairs": 10, "cpu": 0.1, "wall": 0.5},
        }

    overlap = [
        {"length": length, "bytes": 1024.0 * length, "compute": compute, "transfer": 1.0}
        for length, compute in [(16, 0.5), (64, 2.0), (256, 8.0)]
    ]
    results = benchmark.Results({2: [rank(5, 0.05), rank(15, 0.15)]}, overlap)
    tables, values = benchmark.tables(results)
    assert values["cp2_contiguous_pairs"] == "1.50x" and values["cp2_zigzag_pairs"] == "1.00x"
    assert values["cp2_contiguous_cpu"] == "1.50x" and values["zigzag_cpu_lower"] == "1 of 1"
    assert values["hides_count"] == "2 of 3" and values["hides_from"] == "from L = 64 up"
    assert len(tables["balance"].rows) == 2 and len(tables["overlap"].rows) == 3
    overlap[2]["compute"] = 0.5  # hidden at 64, not at 256
    _, values = benchmark.tables(benchmark.Results({2: [rank(5, 0.05)] * 2}, overlap))
    assert values["hides_from"] == "at L = 64 only" and values["zigzag_cpu_lower"] == "0 of 1"
