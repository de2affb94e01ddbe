"""Exercise 3.6, 3D parallelism: ``uv run pytest tests/test_phase3.py -m ex3_6``.

A stack of 4 Megatron MLP blocks (8 -> 16 -> 8, float64) is trained 3 SGD steps on a global batch
of 16 in 2 micro-batches per replica (1F1B), laid out as (dp, tp, pp) = (2, 2, 1), (1, 2, 2) and
(2, 1, 2) on 4 ranks and (2, 2, 2) on 8. One world per layout; its run is checked for:

* the stage each rank builds: its contiguous blocks, each this tp rank's shard;
* values: the mean loss of each step and every parameter shard after every step equal one
  process's SGD on the whole batch (1e-10); summed instead of averaged gradients, every replica
  fed the same data, gradients never zeroed, or replicas drifting apart are named when seen;
* the work: each replica runs its own slice of the batch in m micro-batches;
* communication of a step: the all-reduces on the dp group carry exactly this rank's gradient
  bytes (one call with ``average_gradients``); the tensor-parallel all-reduces (2 per block and
  micro-batch, less stage 0's first backward one) stay on the tp group; activations and
  gradients go only to the pipeline neighbours; nothing else, and nothing outside the rank's
  three groups.

Also the pure pieces in this process (``replica_batch``, the refusals of bad layouts before any
process group exists) and, as references, the demo and the strategies benchmark in tiny sizes.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import defined_at, exercise, impl, world
from learner_calls import at_learner_call
from parallel_3d_helpers import (
    BLOCKS,
    ELEMENT,
    FFN,
    GLOBAL_BATCH,
    HIDDEN,
    MICROBATCHES,
    STEPS,
    TOLERANCE,
    Run3D,
    dense_model,
    expected_shard,
    expected_stage,
    max_diff,
    microbatch_sums,
    parallel_3d_module,
    run_3d,
    train_dense,
)
from phase3_helpers import fail, first_problems, small_world
from torch import nn

from course.tensor_header import HEADER_SLOTS
from course.world import WorldHung

CASES = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2)]
IDS = [f"dp{dp}-tp{tp}-pp{pp}" for dp, tp, pp in CASES]
_RUNS: dict[tuple[int, int, int], list[Run3D] | BaseException] = {}
HEADER_BYTES = HEADER_SLOTS * 8


HANG_ADVICE = (
    "The ranks hung. In 3D parallelism the usual cause is a message on the wrong group: a "
    "tensor-parallel block built on the world or another group than topology.tp_group (its "
    "all-reduces then wait for ranks of other stages, which are waiting for pipeline "
    "messages), an all-reduce that only some ranks call, or the pipeline's executor given "
    "another group than topology.pp_group. Where each rank stood:\n"
)


def runs(dp: int, tp: int, pp: int) -> list[Run3D]:
    """One world per layout, shared by the tests below (a failure is re-raised in each)."""
    key = (dp, tp, pp)
    if key not in _RUNS:
        try:
            _RUNS[key] = world(run_3d, dp * tp * pp, dp, tp, pp)
        except WorldHung as exc:
            exc.args = (f"{label(dp, tp, pp)}: {HANG_ADVICE}{exc}",)
            _RUNS[key] = exc
        except BaseException as exc:  # a rank's error: every test of this layout reports it
            at_learner_call(exc, "3.6")
            _RUNS[key] = exc
    result = _RUNS[key]
    if isinstance(result, BaseException):
        raise result
    return result


def label(dp: int, tp: int, pp: int) -> str:
    return f"3.6 3D parallelism dp={dp} x tp={tp} x pp={pp}"


RANK_PREFIX = re.compile(r"^rank (\d+): (.*)$", re.DOTALL)


def report(problems: list[str], header: str) -> None:
    """Fail with the problems, one line per distinct remark, naming the ranks that made it."""
    ranks: dict[str, list[str]] = {}
    for problem in problems:
        match = RANK_PREFIX.match(problem)
        who, text = (match[1], match[2]) if match else ("", problem)
        ranks.setdefault(text, []).append(who)
    lines = []
    for text, who in ranks.items():
        named = [w for w in who if w]
        prefix = f"rank{'s' if len(named) > 1 else ''} {', '.join(named)}: " if named else ""
        lines.append(prefix + text)
    first_problems(lines, header)


# ----------------------------------------------------------------------------- pure pieces


REPLICA_DP_SIZES = (1, 2, 3, 4)  # 3 and 4: a replica's slice is neither 1 row nor half the batch


def replica_batch_problem(batch: torch.Tensor, got: list[Any], dp: int) -> str | None:
    """What is wrong with ``replica_batch(batch, r, dp)`` for r = 0..dp-1, returned as
    ``got[r]`` (None: nothing). A cause is named only when every replica's slice shows it."""
    n = batch.shape[0]
    size = n // dp
    wants = [batch[r * size : (r + 1) * size] for r in range(dp)]
    wrong = [
        r for r, (g, w) in enumerate(zip(got, wants, strict=True))
        if not (isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w))
    ]  # fmt: skip
    if not wrong:
        return None
    r = wrong[0]
    if not all(isinstance(g, torch.Tensor) for g in got):
        return (
            f"3.6 replica_batch({n} samples, dp_rank={r}, dp_size={dp}) returned "
            f"{type(got[r]).__name__}; expected a tensor of rows {r * size}..{(r + 1) * size - 1}"
        )
    rows = [g[:, 0].div(2).long().tolist() if g.dim() == 2 else g.tolist() for g in got]
    if all(g.shape == batch.shape and torch.equal(g, batch) for g in got):
        why = (
            "every replica got the whole batch: each would compute the whole batch's "
            "gradient, dp times the work for the same update"
        )
    elif all(row == rows[0] == list(range(size)) for row in rows):
        why = "every replica got replica 0's samples: the others' are never trained on"
    else:
        why = (
            f"replicas must take disjoint, equal, contiguous slices in dp-rank order (dp ranks "
            f"{wrong} of {dp} got other rows)"
        )
    return (
        f"3.6 replica_batch({n} samples, dp_rank={r}, dp_size={dp}) returned samples "
        f"{rows[r]}; expected {list(range(r * size, (r + 1) * size))}: " + why
    )


@exercise("3.6")
def test_replica_batch_gives_each_replica_its_own_contiguous_slice() -> None:
    p3d = parallel_3d_module()
    batch = torch.arange(24.0).reshape(12, 2)
    for dp in REPLICA_DP_SIZES:
        got = [p3d.replica_batch(batch, dp_rank, dp) for dp_rank in range(dp)]
        problem = replica_batch_problem(batch, got, dp)
        if problem:
            fail(problem)


@exercise("3.6")
def test_bad_layouts_are_refused_before_any_process_group_work() -> None:
    p3d = parallel_3d_module()
    assert not dist.is_initialized()
    stack = p3d.StackConfig(hidden=HIDDEN, ffn_hidden=FFN, blocks=BLOCKS)
    cases = [
        ((4, 2, 2, 2), {}, ("dp=2 x tp=2 x pp=2 = 8 != world size 4",)),
        ((4, 1, 3, 1), {}, ("tp=3", "ffn_hidden=16")),
        ((6, 2, 1, 3), {}, ("pp=3", "number of blocks 4")),
        ((4, 2, 2, 1), {"global_batch": 10, "num_microbatches": 2}, ("global batch 10", "dp=2")),
        ((12, None, 3, 3), {}, ("tp=3", "pp=3")),  # every problem at once
    ]
    for (size, dp, tp, pp), extra, parts in cases:
        with pytest.raises(ValueError) as caught:
            p3d.check_layout(size, dp, tp, pp, stack, **extra)
        message = str(caught.value)
        for part in parts:
            assert part in message, f"the refusal of {(size, dp, tp, pp)} should say {part!r}"
    assert p3d.check_layout(8, None, 2, 2, stack, GLOBAL_BATCH, MICROBATCHES) == 2


# ----------------------------------------------------------------------------- the stages


def stage_problem(run: Run3D, rank: int, dp: int, tp: int, pp: int) -> str | None:
    dense = dense_model()
    want = expected_stage(dense, run.coords, tp, pp)
    got = run.shards[0]
    stage, _, tp_rank = run.coords
    per = BLOCKS // pp
    where = f"stage {stage} (blocks {stage * per}-{stage * per + per - 1}), tp rank {tp_rank}"
    if set(got) != set(want):
        blocks = len({name.split(".")[0] for name in got})
        if blocks != per and all(re.match(r"^\d+\.fc[12]\.(weight|bias)$", n) for n in got):
            return (
                f"{where}: the stage holds {blocks} blocks; with {BLOCKS} blocks and pp={pp} "
                f"each stage holds {per}, the contiguous ones of its pipeline rank"
            )
        return (
            f"{where}: the stage's parameters are named {sorted(got)[:6]}; expected "
            f"{sorted(want)[:6]}...: an nn.Sequential of {per} ParallelMLP blocks"
        )
    for name, tensor in want.items():
        mine = got[name]
        if mine.shape != tensor.shape:
            dense_shape = tuple(dense[0].get_parameter(name.split(".", 1)[1]).shape)
            why = (
                "it is not sharded at all"
                if tuple(mine.shape) == dense_shape
                else "it is sharded over a group of another size"
            )
            return (
                f"{where}: {name} has shape {tuple(mine.shape)}, expected {tuple(tensor.shape)} "
                f"(ffn_hidden/tp = {FFN // tp} of {FFN}): {why}; shard each block on "
                "topology.tp_group"
            )
    diff, name = max_diff(got, want)
    if diff <= TOLERANCE:
        return None
    local = int(name.split(".")[0])
    for block in range(BLOCKS):
        for other in range(tp):
            shard = expected_shard(dense, block, other, tp)
            held = {n: got[f"{local}.{n}"] for n in shard}
            if max_diff(held, shard)[0] <= TOLERANCE:
                if block != stage * per + local:
                    return (
                        f"{where}: its block {local} is dense block {block}; stage s holds "
                        f"blocks [s*k, (s+1)*k) with k = blocks/pp = {per}, in order"
                    )
                return (
                    f"{where}: block {local} holds tp rank {other}'s shard: the shard must be "
                    "picked by the rank in the tp group (ParallelMLP.from_dense(block, "
                    "topology.tp_group))"
                )
    return f"{where}: {name} differs by {diff:.3e} from its shard of the dense block"


@exercise("3.6")
@pytest.mark.parametrize(("dp", "tp", "pp"), CASES, ids=IDS)
def test_each_stage_holds_its_blocks_sharded_on_the_tp_group(dp: int, tp: int, pp: int) -> None:
    results = runs(dp, tp, pp)
    problems = [
        f"rank {rank}: {problem}"
        for rank, run in enumerate(results)
        if (problem := stage_problem(run, rank, dp, tp, pp))
    ]
    report(problems, f"{label(dp, tp, pp)}: the parameters of each rank's stage after building:")


# ----------------------------------------------------------------------------- values


def replicas_diverge(results: list[Run3D], step: int) -> str | None:
    """Two replicas of one shard (same pp and tp, different dp) that differ after ``step``."""
    by_shard: dict[tuple[int, int], list[tuple[int, Run3D]]] = {}
    for rank, run in enumerate(results):
        by_shard.setdefault((run.coords[0], run.coords[2]), []).append((rank, run))
    for members in by_shard.values():
        (first, a), *others = members
        for rank, b in others:
            if max_diff(b.shards[step], a.shards[step])[0] > 0:
                return (
                    f"ranks {first} and {rank} hold the same shard in different replicas but "
                    f"their parameters differ after step {step}: every replica must apply the "
                    "same update, the gradients averaged over the dp group, before the "
                    "optimizer step" + defined_at(parallel_3d_module().Parallel3D.train_step)
                )
    return None


def _matches(results: list[Run3D], state: nn.Sequential, step: int, tp: int, pp: int) -> bool:
    """Whether every rank's shards after ``step`` equal the ones cut from ``state``."""
    return all(
        max_diff(run.shards[step], expected_stage(state, run.coords, tp, pp))[0] <= TOLERANCE
        for run in results
    )


def values_problems(results: list[Run3D], dp: int, tp: int, pp: int) -> list[str]:
    """The first step whose loss or parameters differ from one process's, explained."""
    states, losses = train_dense()
    summed = train_dense(grad_scale=dp)[0] if dp > 1 else None
    same_data = train_dense(replica0_of=dp)[0] if dp > 1 else None
    for step in range(1, STEPS + 1):
        problems: list[str] = []
        last = [
            run.losses[step - 1]
            for run in results
            if run.coords[0] == pp - 1 and run.coords[2] == 0
        ]
        if any(loss is None for loss in last):
            problems.append(
                f"step {step}: a rank of the last stage returned no loss from train_step; it "
                "must return the executor's loss there"
            )
        else:
            mean = sum(float(loss) for loss in last if loss is not None) / len(last)
            fed = feeding_problem(results, dp) if step == 1 else None
            if abs(mean - losses[step - 1]) > TOLERANCE and fed:
                return [
                    f"step 1: the mean of the replicas' losses is {mean:.12f}; one process on "
                    f"the whole batch gets {losses[step - 1]:.12f}, and {fed}"
                ]
            if abs(mean - losses[step - 1]) > TOLERANCE:
                problems.append(
                    f"step {step}: the mean of the replicas' losses is {mean:.12f}; one process "
                    f"on the whole batch gets {losses[step - 1]:.12f}"
                    + (
                        ": this loss comes before any update, so the 3D model's forward already "
                        "differs from the dense one; check each tensor-parallel block (2.6: "
                        "fc2's bias is added once, after the all-reduce), the order of the "
                        "blocks, and that all tp ranks of a replica feed the same samples"
                        if step == 1
                        else ""
                    )
                )
        wrong = []
        for rank, run in enumerate(results):
            diff, name = max_diff(
                run.shards[step], expected_stage(states[step], run.coords, tp, pp)
            )
            if diff > TOLERANCE:
                wrong.append(f"rank {rank}: after step {step}, {name} differs by {diff:.3e}")
        if not wrong:
            if problems:
                return problems
            continue
        if summed is not None and _matches(results, summed[step], step, tp, pp):
            return [
                f"after step {step} every rank holds what SUMMED gradients give, not one "
                f"process's SGD on the whole batch: divide by the dp group's size ({dp}); each "
                "replica's loss is the mean over its own samples only"
            ]
        if same_data is not None and _matches(results, same_data[step], step, tp, pp):
            return [
                f"after step {step} every rank holds what training on replica 0's samples only "
                "gives: every replica was fed the same slice; take the slice of this rank's dp "
                "rank (topology.dp_rank), so that the replicas together cover the whole batch"
            ]
        if step > 1:
            return [
                f"{wrong[0]}, though step {step - 1} was right on every rank: are the gradients "
                "zeroed at the start of every step? (the executor accumulates into .grad)"
            ]
        diverged = replicas_diverge(results, step) if dp > 1 else None
        if diverged:
            return [*problems, diverged]
        return problems + [
            f"{line} from one process's SGD on the whole batch (tolerance {TOLERANCE}): average "
            "the gradients over the dp group only (tp ranks hold different shards, pp ranks "
            "different blocks), then step"
            for line in wrong
        ]
    return []


@exercise("3.6")
@pytest.mark.parametrize(("dp", "tp", "pp"), CASES, ids=IDS)
def test_three_steps_equal_one_process_on_the_whole_batch(dp: int, tp: int, pp: int) -> None:
    results = runs(dp, tp, pp)
    report(
        values_problems(results, dp, tp, pp),
        f"{label(dp, tp, pp)}, {STEPS} SGD steps in float64 (global batch {GLOBAL_BATCH}, "
        f"{MICROBATCHES} micro-batches per replica) against one process on the whole batch:",
    )


# ----------------------------------------------------------------------------- the work


@exercise("3.6")
@pytest.mark.parametrize(("dp", "tp", "pp"), CASES, ids=IDS)
def test_each_replica_runs_its_own_slice_in_microbatches(dp: int, tp: int, pp: int) -> None:
    results = runs(dp, tp, pp)
    micro = GLOBAL_BATCH // dp // MICROBATCHES
    want = [micro] * MICROBATCHES
    problems = []
    for rank, run in enumerate(results):
        for step, sizes in enumerate(run.microbatch_sizes, start=1):
            if sizes == want:
                continue
            hint = ""
            if sizes == [GLOBAL_BATCH // MICROBATCHES] * MICROBATCHES and dp > 1:
                hint = (
                    ": every replica ran the whole global batch (dp times the work, and the "
                    "pipeline's messages dp times larger); feed it replica_batch(inputs, "
                    "topology.dp_rank, topology.dp_size)"
                )
            problems.append(
                f"rank {rank}: step {step}'s first block ran forwards on {sizes} samples; "
                f"expected {MICROBATCHES} micro-batches of {GLOBAL_BATCH} / dp={dp} / "
                f"{MICROBATCHES} = {micro}{hint}"
            )
            break
    if not problems:  # the right sizes: are they the right samples? (stage 0 reads the data)
        fed = feeding_problem(results, dp)
        if fed:
            problems.append(fed)
    report(problems, f"{label(dp, tp, pp)}: the samples each stage processes in a step:")


def feeding_problem(results: list[Run3D], dp: int) -> str | None:
    """The first stage-0 rank whose micro-batches held other samples than its replica's."""
    for rank, run in enumerate(results):
        stage, replica, shard = run.coords
        if stage:
            continue
        for step, sums in enumerate(run.microbatch_sums):
            expected = microbatch_sums(step, dp)
            if _close(sums, expected[replica]):
                continue
            whose = [d for d in range(dp) if _close(sums, expected[d])]
            got = f"replica {whose[0]}'s samples" if whose else "other samples"
            return (
                f"rank {rank} (dp rank {replica}, tp rank {shard}): its micro-batches in "
                f"step {step + 1} held {got}, not replica {replica}'s (samples "
                f"{replica * GLOBAL_BATCH // dp}-{(replica + 1) * GLOBAL_BATCH // dp - 1}): "
                "the slice is picked by topology.dp_rank, so that every rank of a replica "
                "(all its tp ranks) sees the same samples and the replicas together see "
                "the whole batch"
            )
    return None


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        abs(a - b) <= 1e-9 for a, b in zip(got, want, strict=False)
    )


# ----------------------------------------------------------------------------- communication


def _kind(
    record: tuple[str, int, tuple[int, ...] | None, int | None], run: Run3D, world: int, act: int
) -> str:
    """Which of this rank's groups a record used: dp, tp, pp, or outside."""
    op, nbytes, ranks, peer = record
    if op in ("send", "isend", "recv", "irecv"):
        return "pp" if peer is not None and peer in run.groups["pp"] else "outside"
    members = tuple(range(world)) if ranks is None else ranks
    matches = [name for name in ("dp", "tp", "pp") if run.groups[name] == members]
    if not matches:
        return "outside"
    if len(matches) > 1:  # groups of one rank can coincide: tell them apart by the payload
        return "tp" if nbytes == act and "tp" in matches else matches[0]
    return matches[0]


def comm_problems(run: Run3D, rank: int, dp: int, tp: int, pp: int) -> list[str]:
    world = dp * tp * pp
    per = BLOCKS // pp
    act = GLOBAL_BATCH // dp // MICROBATCHES * HIDDEN * ELEMENT
    groups = run.groups
    problems = []
    by_kind: dict[str, list[tuple[str, int, Any, Any]]] = {"dp": [], "tp": [], "pp": []}
    for record in run.records:
        kind = _kind(record, run, world, act)
        op, nbytes, ranks, peer = record
        if kind != "outside":
            by_kind[kind].append(record)
            continue
        where = "the world group" if ranks is None else f"group {ranks}"
        if op in ("send", "isend", "recv", "irecv"):
            problems.append(
                f"rank {rank}: {op} of {nbytes} bytes with rank {peer}, outside its pp group "
                f"{groups['pp']}: pipeline messages go between neighbouring stages of one "
                "pipeline only (the executor takes group=topology.pp_group)"
            )
        elif nbytes == run.grad_bytes:
            problems.append(
                f"rank {rank}: {op} of {nbytes} bytes (its gradients) on {where}: the gradient "
                f"average must run on the dp group {groups['dp']} only; ranks outside it hold "
                "other shards or other blocks"
            )
        else:
            problems.append(
                f"rank {rank}: {op} of {nbytes} bytes on {where}, which is none of its groups "
                f"(dp {groups['dp']}, tp {groups['tp']}, pp {groups['pp']}): every collective "
                "needs group= from the topology"
            )
    misplaced = False  # the gradients' average was seen on another of its groups, and named
    for op, nbytes, _, _ in by_kind["pp"]:
        if op not in ("send", "isend", "recv", "irecv"):
            misplaced = misplaced or nbytes == run.grad_bytes
            problems.append(
                f"rank {rank}: {op} of {nbytes} bytes on its pp group {groups['pp']}: stages "
                "hold different blocks, so nothing is reduced across them (average on the dp "
                "group only)"
            )
    tp_ops = Counter((op, nbytes) for op, nbytes, _, _ in by_kind["tp"])
    if groups["tp"] != groups["dp"] and tp_ops.get(("all_reduce", run.grad_bytes)):
        misplaced = True
        problems.append(
            f"rank {rank}: all-reduced its {run.grad_bytes} bytes of gradients on its tp group "
            f"{groups['tp']}: tp ranks hold different shards of each weight (and identical "
            "gradients of the replicated bias), so averaging them mixes shards; average on the "
            f"dp group {groups['dp']} only"
            + (
                " (this tp group has one rank, so the values survive here; with tp > 1 they "
                "would not)"
                if len(groups["tp"]) == 1
                else ""
            )
        )
        tp_ops[("all_reduce", run.grad_bytes)] = 0
    # g in forward and f in backward per block and micro-batch; stage 0's first f has nothing
    # to do: the data needs no gradient, so autograd never calls that backward
    first_stage = run.coords[0] == 0
    want_tp = (2 * per - first_stage) * MICROBATCHES
    got_tp = +tp_ops
    if got_tp != Counter({("all_reduce", act): want_tp}):
        problems.append(
            f"rank {rank}: its tp group {groups['tp']} saw {dict(got_tp)} ((op, bytes): calls); "
            f"expected {want_tp} all-reduces of {act} bytes: one in forward (g) and one in "
            f"backward (f) for each of its {per} blocks and {MICROBATCHES} micro-batches"
            + (", less the first block's f (the data needs no gradient)" if first_stage else "")
        )
    dp_bytes = sum(nbytes for op, nbytes, _, _ in by_kind["dp"] if op == "all_reduce")
    others = [op for op, _, _, _ in by_kind["dp"] if op != "all_reduce"]
    allowed = {run.grad_bytes} | ({0} if dp == 1 else set())
    if others:
        problems.append(
            f"rank {rank}: {sorted(set(others))} on the dp group: the gradient average is an "
            "all-reduce (sum, then divide by the group's size)"
        )
    elif (
        dp_bytes not in allowed
        and not misplaced
        and not any(
            kind == "outside" and nbytes == run.grad_bytes
            for kind, (_, nbytes, _, _) in ((_kind(r, run, world, act), r) for r in run.records)
        )
    ):  # an average on the wrong group was named above
        if dp_bytes == 0:
            why = "no gradient average on the dp group: replicas would drift apart"
        elif dp_bytes == 2 * run.grad_bytes:
            why = "the gradients were averaged twice"
        else:
            why = "each of this rank's gradients must be averaged exactly once"
        problems.append(
            f"rank {rank}: all-reduced {dp_bytes} bytes on its dp group {groups['dp']} in a "
            f"step; its stage has {run.grad_bytes} bytes of gradients: {why}"
        )
    stage = run.coords[0]
    sends = Counter(
        (peer, nbytes) for op, nbytes, _, peer in by_kind["pp"] if op in ("send", "isend")
    )
    want_sends: Counter[tuple[Any, int]] = Counter()
    ring = groups["pp"]
    if stage < pp - 1:
        want_sends[(ring[stage + 1], act)] += MICROBATCHES  # activations forward
        want_sends[(ring[stage + 1], HEADER_BYTES)] += 1  # the step's shape header
    if stage > 0:
        want_sends[(ring[stage - 1], act)] += MICROBATCHES  # gradients backward
    if sends != want_sends:
        parts = []
        if stage < pp - 1:
            parts.append(
                f"{MICROBATCHES} activations of {act} bytes (micro-batch x hidden x 8) and one "
                f"header of {HEADER_BYTES} to the next stage, rank {ring[stage + 1]}"
            )
        if stage > 0:
            parts.append(
                f"{MICROBATCHES} gradients of {act} bytes to the previous stage, rank "
                f"{ring[stage - 1]}"
            )
        problems.append(
            f"rank {rank} (stage {stage}): sent {dict(sends)} ((peer, bytes): messages) in a "
            f"step; expected {dict(want_sends)}: " + "; ".join(parts)
        )
    return problems


@exercise("3.6")
@pytest.mark.parametrize(("dp", "tp", "pp"), CASES, ids=IDS)
def test_communication_of_a_step_stays_in_its_groups(dp: int, tp: int, pp: int) -> None:
    results = runs(dp, tp, pp)
    problems = [p for rank, run in enumerate(results) for p in comm_problems(run, rank, dp, tp, pp)]
    report(
        problems,
        f"{label(dp, tp, pp)}: the messages of one step (the second), counted per group:",
    )


# ----------------------------------------------------------------------------- references


def program(name: str) -> Any:
    return importlib.import_module(f"solutions.phase3_multi_node.{name}")


def demo_worker(impl_name: str) -> dict[str, Any]:
    demo = program("demos.parallel_3d")
    config = demo.DemoConfig(dp=1, tp=2, pp=2, steps=2, impl=impl_name)
    return demo.run_demo(config)


@exercise("3.6")
@pytest.mark.reference
def test_the_demo_matches_one_process_and_reports_every_rank() -> None:
    results = small_world(demo_worker, 4, impl())
    summary = results[0]
    assert summary["max_loss_diff"] <= TOLERANCE, (
        f"the demo's losses differ from one process's by up to {summary['max_loss_diff']:.3e} "
        f"(allowed {TOLERANCE:g}): per step (3D, one process) {summary['losses']}"
    )
    assert len(summary["ranks"]) == 4 and [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert all(r["comm"] for r in summary["ranks"]), "every rank must report its messages"
    kinds = {row[0] for r in summary["ranks"] for row in r["comm"]}
    assert kinds <= {"dp", "tp", "pp"}, f"messages outside the three groups: {kinds}"


@exercise("3.6")
@pytest.mark.reference
def test_the_demo_refuses_bad_degrees_before_starting() -> None:
    demo = program("demos.parallel_3d")
    with pytest.raises(ValueError) as caught:
        demo.validate(demo.DemoConfig(dp=2, tp=2, pp=2), 4)
    assert "dp=2 x tp=2 x pp=2 = 8 != world size 4" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        demo.validate(demo.DemoConfig(tp=3, pp=3, ffn_hidden=64, blocks=4), 9)
    assert "tp=3" in str(caught.value) and "pp=3" in str(caught.value)
    assert demo.main(["--tp", "3"]) == 2  # world of one: refused before any process group


@exercise("3.6")
@pytest.mark.reference
def test_the_strategies_benchmark_trains_one_model_every_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = program("benchmarks.strategies")
    measured: list[Any] = []

    def measure(config: Any) -> Any:  # keep the ranks' numbers to check the bytes
        measured.append(real_measure(config))
        return measured[-1]

    real_measure = bench.measure
    monkeypatch.setattr(bench, "measure", measure)
    args = ["--width", "32", "--layers", "2", "--global-batch", "8", "--steps", "2"]
    # a capacity factor of 0.5 drops choices for sure: the bytes formula must count drops
    moe = ["--experts", "4", "--k", "2", "--expert-hidden", "16", "--capacity-factor", "0.5"]
    # the reference strategies: under --impl templates they would need 1.2, 2.5, 3.1, 3.4, 3.5, 3.8
    assert bench.main([*args, *moe, "--microbatches", "2", "--impl", "solutions"]) == 0
    out = capsys.readouterr().out
    for name in bench.STRATEGIES:
        assert f"| {name} |" in out, f"no row for {name} in\n{out}"
    assert "1.000x" in out, f"torch DDP's row should be the 1.000x baseline:\n{out}"
    summary = out.split("per rank")[0]
    rows = {
        line.split("|")[1].strip(): line
        for line in summary.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip() in bench.STRATEGIES
    }
    assert len(rows) == len(bench.STRATEGIES), (
        f"the summary table has rows for {sorted(rows)}; expected one for each of "
        f"{sorted(bench.STRATEGIES)}:\n{summary}"
    )
    losses = {name: float(line.rstrip(" |").rsplit("|", 1)[1]) for name, line in rows.items()}
    models = {name: line.split("|")[2].strip() for name, line in rows.items()}
    assert models == {
        name: "MoE MLP" if name == bench.MOE_STRATEGY else "dense MLP" for name in rows
    }, f"the table must say which model each row trains:\n{summary}"
    fp32 = [losses[name] for name in bench.FP32_STRATEGIES]
    assert max(fp32) - min(fp32) <= 1e-4 * max(fp32), f"one model, one loss:\n{summary}"
    for name in set(bench.DENSE_STRATEGIES) - set(bench.FP32_STRATEGIES):  # bf16: rounding
        assert abs(losses[name] - fp32[0]) <= 5e-2 * fp32[0], f"{name}'s loss:\n{summary}"
    check_expert_parallel_row(bench, measured[0])
    assert bench.main(["--layers", "3"]) == 2  # 3 layers do not split into 2 stages


def expected_moe_bytes(
    census: list[list[int]], rank: int, hidden: int, ffn: int, factor: float
) -> dict[str, int]:
    """What rank ``rank`` hands to each collective in one step of the MoE row, from the census
    alone (written here apart from the benchmark's own formula): float32 rows, int64 counts."""
    world, experts = len(census), len(census[0])
    capacity = math.ceil(factor * sum(map(sum, census)) / experts - 1e-9)
    taken, kept = [0] * experts, []
    for counts in census:  # first come, first served in rank order
        kept.append([min(c, capacity - taken[e]) for e, c in enumerate(counts)])
        taken = [t + k for t, k in zip(taken, kept[-1], strict=True)]
    per = experts // world
    mine = range(rank * per, (rank + 1) * per)
    sent, received = sum(kept[rank]), sum(kept[s][e] for s in range(world) for e in mine)
    return {
        "all-to-all": 8 * experts + 2 * 4 * hidden * (sent + received),
        "all-gather": 8 * world * experts,
        "all-reduce world": 4 * (2 * (hidden * hidden + hidden) + experts * hidden),
        "all-reduce dp": 4 * per * (2 * hidden * ffn + ffn + hidden),
    }


def check_expert_parallel_row(bench: Any, per_rank: list[Any]) -> None:
    """The MoE row: every rank's counted bytes equal the formula (drops included), and its loss
    equals the same MoE model's in one process (a missing term of the loss or of a gradient
    shows there; a gradient off by a constant factor does not: AdamW's step ignores scale)."""
    dropped = 0
    for rank, numbers in enumerate(per_rank):
        traffic = numbers[bench.MOE_STRATEGY]["traffic"]
        want = expected_moe_bytes(traffic["census"], rank, hidden=32, ffn=16, factor=0.5)
        assert traffic["counted"] == want, (
            f"rank {rank}: one step of the expert-parallel row handed {traffic['counted']} bytes "
            f"to the collectives; the formula from the census {traffic['census']} gives {want} "
            "(all-to-all: 8E counts + 2 x 4h x (rows dispatched + rows received); the census "
            "all-gather 8NE; the replicated Linear layers and router all-reduced on the world; "
            "the experts on their dp group of one rank)"
        )
        assert traffic["formula"] == want, f"rank {rank}: the benchmark's own formula differs"
        dropped += sum(traffic["census"][rank]) - traffic["sent_rows"]
    assert dropped > 0, "capacity factor 0.5 must drop choices; none were dropped"
    loss = per_rank[0][bench.MOE_STRATEGY]["loss"]
    alone = per_rank[0][bench.MOE_STRATEGY]["one_process_loss"]
    tolerance = bench.loss_tolerance(per_rank[0]["device"])  # 1e-6 on CPU
    assert abs(loss - alone) <= tolerance * abs(alone), (
        f"the expert-parallel row's loss {loss} differs from the same MoE model's in one "
        f"process, {alone}, by more than {tolerance:g} relative: the two no longer train the "
        "same model the same way (gradients synced, load-balancing loss, data slices)"
    )
