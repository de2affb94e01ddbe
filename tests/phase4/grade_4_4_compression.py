"""Grader of exercise 4.4, gradient compression hooks: ``uv run pytest tests/test_phase4.py -m ex4_4``.

Every method is a DDP communication hook, checked against what torch ships, on hand-made buckets
(chosen gradients, one bucket after the other) and on two real DDPs (torch's and phase 3's):

* fp16 / bf16: bit for bit torch's ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``
  on 3 ranks (the division by 3 is not exact: the order cast -> divide shows), half the bytes;
* top-k: the average of every rank's k largest-magnitude entries of gradient + remembered error,
  the error-feedback invariant exactly (new error = gradient + old error - sent), k float32 values
  and k int64 indices per rank per bucket through all-gather, no all-reduce; 2 and 3 ranks;
* PowerSGD: ``should_compress`` equal to torch's rule, ``orthogonalize`` equal to torch's
  Gram-Schmidt and QR's Q (up to column signs); the hook beside torch's ``powerSGD_hook`` with
  the same seed, step by step (values, statistics, the Q kept for the warm start, the bytes of P
  and Q); trained on one bucket under torch's DDP and ours, equal to torch's hook;
* every hook on torch's DDP and on ours with one bucket per parameter (collectives issued from
  the hook call, so several buckets cannot hang), and inside two groups of two.
"""

from __future__ import annotations

import re

import pytest
import torch
from compression_helpers import (
    TOLERANCE,
    cast_worker,
    module,
    one_bucket_worker,
    powersgd_worker,
    small_world,
    subgroup_cast_worker,
    topk_order_worker,
    topk_worker,
    two_ddps_worker,
)
from grading import exercise, impl
from phase4_helpers import fail
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def report(results: list[list[str]], header: str, limit: int = 5) -> None:
    """Fail with each distinct remark once (the workers write "where: remark"), naming the
    ranks that made it and the first place it was made, the count of the others."""
    grouped: dict[str, tuple[str, list[int], list[str]]] = {}
    for rank, problems in enumerate(results):
        for problem in problems:
            where, sep, body = problem.partition(": ")
            if not sep or len(where) > 60:
                where, body = "", problem
            _, ranks, places = grouped.setdefault(NUMBER.sub("#", body), (body, [], []))
            if rank not in ranks:
                ranks.append(rank)
            if where and where not in places:
                places.append(where)
    lines = []
    for body, ranks, places in grouped.values():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        if places:
            others = len(places) - 1
            more = f" (and {others} more place{'s' if others > 1 else ''})" if others else ""
            who += f" at {places[0]}{more}"
        lines.append(f"{who}: {body}")
    if lines:
        extra = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
        fail(header + "\n  " + "\n  ".join(lines[:limit]) + extra)


# ----------------------------------------------------------------------------- fp16 / bf16


@exercise("4.4")
def test_fp16_and_bf16_hooks_equal_torchs_bit_for_bit() -> None:
    report(
        small_world(cast_worker, 3),
        "4.4 fp16_hook / bf16_hook beside torch's default_hooks on copies of the same buckets "
        "(1000 values from 1e-7 to 100, and 40000s), 3 ranks:",
    )


# ----------------------------------------------------------------------------- top-k


@exercise("4.4")
@pytest.mark.parametrize("world_size", [2, 3])
def test_topk_sends_k_pairs_and_keeps_the_rest_as_error(world_size: int) -> None:
    results = small_world(topk_worker, world_size, 0.05, 3)
    report(
        [r["problems"] for r in results],
        f"4.4 topk_hook, ratio 0.05, 3 steps over buckets of 1000, 37 and 300 elements, "
        f"{world_size} ranks with their own gradients:",
    )


@exercise("4.4")
def test_average_sparse_rounds_the_same_way_on_every_rank() -> None:
    outs = small_world(topk_order_worker, 3)
    if all(out == outs[0] for out in outs):
        return
    mid = ", ".join(f"rank {rank}: {out[3]:g}" for rank, out in enumerate(outs))
    differ = [i for i in range(len(outs[0])) if len({repr(out[i]) for out in outs}) > 1]
    fail(
        "4.4 average_sparse, 3 ranks that all chose index 3 with the float32 values 1e8, 1 and "
        f"-1e8 (and one index of their own): the ranks ended with different averages at "
        f"{differ} (index 3: {mid}). Float addition is not associative: (1e8 + 1) - 1e8 is 0 "
        "in float32, (1e8 - 1e8) + 1 is 1. Every rank must add the ranks' pairs in one order, "
        "the same everywhere, whatever its own rank"
    )


# ----------------------------------------------------------------------------- PowerSGD pieces


@exercise("4.4")
def test_should_compress_is_torchs_rule() -> None:
    powersgd = module("compression_powersgd")
    for rows in (1, 2, 3, 4, 5, 8, 20, 64):
        for cols in (1, 3, 4, 6, 27, 100):
            for rank in (1, 2, 4):
                for rate in (0.5, 1.0, 2.0, 2.5):
                    want = torch_powersgd._should_compress(rows, cols, rank, rate)[0]
                    got = powersgd.should_compress(rows, cols, rank, rate)
                    if bool(got) != want:
                        fail(
                            f"4.4 should_compress({rows}, {cols}, rank={rank}, "
                            f"min_compression_rate={rate}) returned {got!r}; torch's rule says "
                            f"{want}: ({rows} + {cols})·{rank}·{rate} = "
                            f"{(rows + cols) * rank * rate:g} against {rows}·{cols} = "
                            f"{rows * cols} (compress only when strictly less)"
                        )


def _orthogonalize_problem(
    a: torch.Tensor, got: torch.Tensor, returned: object, tol: float
) -> str | None:
    rank = a.shape[1]
    eye = torch.eye(rank, dtype=a.dtype)
    gram = got.T @ got
    if isinstance(returned, torch.Tensor) and returned.data_ptr() != got.data_ptr():
        return (
            "it returned a new matrix; orthogonalize the one it is given, in place (the hook "
            "works on views of its P and Q memory)"
        )
    if torch.equal(got, a):
        return (
            "the matrix is unchanged: normalize each column and subtract its component from "
            "the later ones, in place (col /= ..., rest -= ... on views)"
        )
    if not torch.isfinite(got).all():
        return "the result holds NaN or inf"
    norms = torch.linalg.vector_norm(got, dim=0)
    if not torch.allclose(norms, torch.ones_like(norms), atol=tol):
        return f"column norms are {norms.tolist()}: normalize each column (divide by its norm)"
    if not torch.allclose(gram, eye, atol=tol):
        return (
            "the columns have norm 1 but are not orthogonal (max |dot| "
            f"{float((gram - eye).abs().max()):.2e}): after normalizing column i, subtract its "
            "component from every later column"
        )
    q = torch.linalg.qr(a).Q
    if not torch.allclose(got.abs(), q.abs(), atol=tol):
        return (
            "the columns are orthonormal but not Gram-Schmidt's (QR's Q up to column signs): go "
            "left to right, so the first column keeps its direction and column j stays in the "
            "span of the first j input columns"
        )
    if rank <= 2:
        want = a.clone().unsqueeze(0)
        torch_powersgd._orthogonalize(want)
        if not torch.allclose(got, want[0], atol=tol):
            return "differs from torch's _orthogonalize (Gram-Schmidt) in the column signs"
    return None


@exercise("4.4")
def test_orthogonalize_is_gram_schmidt_like_torchs() -> None:
    orthogonalize = module("compression_powersgd").orthogonalize
    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        for rows, rank in ((6, 2), (6, 1), (40, 2), (40, 3), (9, 4), (4, 4), (1, 1)):
            a = torch.randn(rows, rank, generator=g, dtype=dtype)
            got = a.clone()
            returned = orthogonalize(got)
            problem = _orthogonalize_problem(a, got, returned, tol)
            if problem:
                fail(
                    f"4.4 orthogonalize on a random {rows} x {rank} {dtype} matrix: {problem}. "
                    "Expected Gram-Schmidt of the columns, in place: orthonormal columns, as "
                    "torch.linalg.qr's Q up to signs"
                )
    zero = torch.zeros(5, 2, dtype=torch.float64)
    zero[:, 0] = torch.randn(5, generator=g, dtype=torch.float64)
    orthogonalize(zero, 1e-8)
    if not torch.isfinite(zero).all():
        fail(
            "4.4 orthogonalize(matrix, epsilon=1e-8) on a matrix with a zero column gave NaN: "
            "divide each column by its norm + epsilon (torch's orthogonalization_epsilon)"
        )


# ----------------------------------------------------------------------------- PowerSGD hook


@exercise("4.4")
@pytest.mark.parametrize("rank_r", [1, 2, 4])
def test_powersgd_hook_equals_torchs_step_by_step(rank_r: int) -> None:
    results = small_world(powersgd_worker, 2, rank_r, 5, 2)
    report(
        [r["problems"] for r in results],
        f"4.4 powersgd_hook, rank {rank_r}, beside torch's powerSGD_hook with the same seed on "
        "copies of the same buckets (2 buckets, 5 steps, compression from step 3, float64, "
        f"tolerance {TOLERANCE:g}), 2 ranks:",
    )


@exercise("4.4")
@pytest.mark.parametrize("rank_r", [1, 2])
def test_powersgd_trains_like_torchs_hook_on_torch_ddp_and_ours(rank_r: int) -> None:
    results = small_world(one_bucket_worker, 2, rank_r, 8)
    for rank, result in enumerate(results):
        stats = result["stats"]
        if stats[1] != stats[0] or stats[2] != stats[0]:
            fail(
                f"4.4 PowerSGD rank {rank_r}, 8 SGD steps on one bucket: compression_stats() "
                f"on torch's DDP {stats[1]} and on ours {stats[2]}; torch's hook: {stats[0]}"
            )
        for where, diff in zip(("torch's DDP", "our DDP (phase 3)"), result["diffs"], strict=True):
            if diff > TOLERANCE:
                fail(
                    f"4.4 PowerSGD rank {rank_r} on {where}, 8 SGD steps (momentum) from the same "
                    f"weights and seed: rank {rank}'s parameters differ from torch's "
                    f"powerSGD_hook by {diff:.3g} (tolerance {TOLERANCE:g}); losses "
                    f"{[round(x, 6) for x in result['losses'][0]]} (torch's hook) vs "
                    f"{[round(x, 6) for x in result['losses'][1]]}"
                )


# ----------------------------------------------------------------------------- real DDPs


@exercise("4.4")
@pytest.mark.parametrize("method", ["fp16", "bf16", "topk", "powersgd"])
def test_hooks_run_on_torch_ddp_and_ours_with_one_bucket_per_parameter(method: str) -> None:
    results = small_world(two_ddps_worker, 2, method, 0.0, 6)
    for rank, result in enumerate(results):
        if not result["replicas_agree"]:
            fail(
                f"4.4 make_comm_hook({method!r}) on torch's DDP, {result['buckets']} buckets: "
                "after 6 steps the ranks hold different parameters: every rank must end with the "
                "same averaged gradient"
            )
        if result["diff"] > 1e-12:
            fail(
                f"4.4 make_comm_hook({method!r}) on torch's DDP and on ours (phase 3), "
                f"{result['buckets']} buckets, 6 SGD steps from the same weights: rank {rank}'s "
                f"parameters differ by {result['diff']:.3g}. A hook must rely only on what a "
                "GradBucket offers (buffer, gradients, index, is_last) and return a future "
                "whose value is the averaged bucket"
            )


@exercise("4.4")
def test_hooks_inside_two_groups_of_two() -> None:
    results = small_world(subgroup_cast_worker, 4)
    report(results, "4.4 fp16_hook and topk_hook in the groups (0, 1), (2, 3):")
    results = small_world(powersgd_worker, 4, 1, 4, 2, 2)
    report(
        [r["problems"] for r in results],
        "4.4 powersgd_hook with PowerSGDState(group) in the groups (0, 1), (2, 3), beside "
        "torch's hook on the same group:",
    )


# ----------------------------------------------------------------------------- given code


@exercise("4.4")
@pytest.mark.reference
def test_make_comm_hook_names_its_choices() -> None:
    compression = module("compression")
    assert compression.make_comm_hook("none") is None
    for name in ("fp16", "bf16", "topk", "powersgd"):
        made = compression.make_comm_hook(name)
        assert made is not None and callable(made[1]), f"make_comm_hook({name!r}) gave {made}"
    with pytest.raises(ValueError) as err:
        compression.make_comm_hook("int8")
    for name in compression.METHODS:
        assert name in str(err.value), f"the error should list {name!r}: {err.value}"
    for kwargs, word in (
        ({"topk_ratio": 0.0}, "ratio"),
        ({"topk_ratio": 1.5}, "ratio"),
        ({"powersgd_rank": 0}, "rank"),
        ({"start_iter": 1}, "start_iter"),
    ):
        name = "topk" if "topk_ratio" in kwargs else "powersgd"
        with pytest.raises(ValueError, match=word):
            compression.make_comm_hook(name, **kwargs)


def expected_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes per compressed step per rank of each benchmark row, from the model's shapes (one
    bucket: the model's fp32 gradients fit torch's 1 MiB first bucket)."""
    import math

    from solutions.phase4_production.compression_topk import topk_count

    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = sum(math.prod(shape) for shape in shapes)
    assert numel * 4 < 2**20, "the benchmark's model should fit one bucket"
    want = {"none": 4 * numel, "fp16": 2 * numel, "top-k 1%": 12 * topk_count(numel, 0.01)}
    for rank_r in (1, 2, 4):
        elements = 0
        for shape in shapes:
            rows, cols = shape[0], math.prod(shape[1:])
            r = min(rows, cols, rank_r)
            compress = torch_powersgd._should_compress(rows, cols, r, 2.0)[0]
            elements += (rows + cols) * r if compress else rows * cols
        want[f"PowerSGD r={rank_r}"] = 4 * elements
    return want


@exercise("4.4")
@pytest.mark.reference
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_benchmark_counts_the_bytes_of_each_method(model: str) -> None:
    import importlib

    bench = importlib.import_module("solutions.phase4_production.benchmarks.compression")
    config = bench.BenchmarkConfig(
        model=model, epochs=1, train_samples=512, test_samples=64, start_iter=2, impl=impl()
    )
    results = bench.run(config)
    table = bench.format_table(results, config)
    got = {r.label: r.payload for r in results}
    want = expected_bytes(bench.make_model(config))
    assert got == want, f"bytes per step per rank {got}, expected {want}:\n{table}"
    for label in want:
        assert f"| {label} |" in table, f"no row for {label}:\n{table}"
    assert "Margin: PowerSGD rank >= 2 within 2 accuracy points" in table
    assert bench.main(["--epochs", "0", "--start-iter", "1"]) == 2
