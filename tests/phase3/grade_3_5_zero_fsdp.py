"""Exercise 3.5, ZeRO-3 the FSDP way: ``uv run pytest tests/test_phase3.py -m ex3_5``.

Four blocks (units of 97, 71, 123 and 45 parameters), one world of 2 ranks and one of 3:

* ``FsdpUnit`` alone, per policy: ``start_gather`` issues ONE asynchronous all-gather of this
  rank's shard already cast to the compute dtype, into ``flat_param``; ``wait_gather`` waits
  for it (or gathers a unit nobody prefetched); ``reduced_gradient`` reduce-scatters in the
  reduce dtype and returns the mean slice in the master dtype (fp32);
* prefetch windows 0, 1 and 2 in float64 against one process's AdamW (1e-12), with gathers that
  deliver their values only at ``wait()``; at every unit's forward and backward start the units
  holding memory are exactly the window (that unit and the next ``prefetch`` ones), and with a
  window the next unit's all-gather is issued before the current unit's compute ends and waited
  for after it (event order, not timings);
* against ``torch.distributed.fsdp.fully_shard`` with the same ``MixedPrecisionPolicy``, fp32
  masters, 4 AdamW steps: bitwise equal on 2 ranks for every policy (no mixed precision;
  bf16 compute with fp32 or bf16 reduction; fp16 compute and reduction), and within 1e-6 on 3
  ranks with fp32 reductions (the sum's order follows each element's home rank, which
  FSDP2's per-parameter rows and the flat layout assign differently);
* bytes per step per dtype: two all-gathers per unit in the compute dtype, one reduce-scatter
  in the reduce dtype, 2Ψ·b_param + Ψ·b_reduce in all; bytes held after a step: fp32 shards,
  gradients and Adam state, 16Ψ/N (no compute buffer left).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from fsdp_helpers import (
    STEPS,
    WIDTHS,
    WINDOWS,
    Call,
    Event,
    PolicyRun,
    RecomputeRun,
    WindowRun,
    blocks_model,
    fsdp_module,
    policy_run,
    recompute_run,
    unit_problems,
    unit_sizes,
    window_run,
)
from grading import defined_at, exercise
from learner_calls import at_learner_call
from phase3_helpers import fail, first_problems, small_world
from torch import nn
from zero_helpers import needs_partition

from phase3_multi_node.zero_fsdp_support import POLICIES
from solutions.phase3_multi_node.references import zero_accounting as acc

WORLDS = (2, 3)
# the policies each world compares with fully_shard, and the largest difference allowed
FULLY_SHARD = {
    2: {"bf16-fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "off": 0.0},
    3: {"bf16-fp32": 1e-6, "off": 1e-6},
}
N_UNITS = len(WIDTHS)
RECOMPUTE_WINDOWS = (1, 2)  # a window of 0 prefetches nothing, in a recompute or not


def fsdp_worker(world: int) -> dict[str, Any]:
    """Everything one world checks; training only when every unit method behaves alone."""
    found = {name: unit_problems(name) for name in FULLY_SHARD[world]}
    out: dict[str, Any] = {"units": found, "windows": [], "policies": []}
    if any(found.values()):
        return out
    out["windows"] = [window_run(w) for w in WINDOWS]
    if not any(run.error for run in out["windows"]):  # real async gathers need the waits right
        out["policies"] = [policy_run(name) for name in FULLY_SHARD[world]]
        out["recompute"] = [recompute_run(w) for w in RECOMPUTE_WINDOWS]
    return out


_RUNS: dict[int, list[dict[str, Any]] | BaseException] = {}


def runs(world: int) -> list[dict[str, Any]]:
    if world not in _RUNS:
        try:
            _RUNS[world] = small_world(fsdp_worker, world, world)
        except BaseException as exc:
            at_learner_call(exc, "3.5")
            _RUNS[world] = exc
    result = _RUNS[world]
    if isinstance(result, BaseException):
        raise result
    return result


def unit_lines(results: list[dict[str, Any]]) -> list[str]:
    """Each remark once, with the ranks that made it."""
    ranks: dict[str, list[str]] = {}
    for rank, result in enumerate(results):
        for policy, problems in result["units"].items():
            for text in problems.values():
                line = f"policy {policy} ({POLICIES[policy].describe()}): {text}"
                ranks.setdefault(line, []).append(str(rank))
    return [f"rank{'s' * (len(r) > 1)} {', '.join(r)}, {line}" for line, r in ranks.items()]


def require_units(results: list[dict[str, Any]], world: int) -> None:
    """Later tests need working units: say which method failed alone, as the first test does."""
    lines = unit_lines(results)
    if lines:
        first_problems(
            lines,
            f"3.5 FSDP-style on {world} ranks: not trained, because FsdpUnit's methods tried "
            "alone misbehave (fix these first):",
        )


def require_training(results: list[dict[str, Any]], world: int) -> None:
    """The fully_shard comparisons run real (not deferred) gathers only after the float64 runs
    trained without an error."""
    require_units(results, world)
    if any(not result["policies"] for result in results):
        lines = [line for line in window_value_lines(results) if "raised" in line]
        first_problems(
            lines or ["the float64 runs failed"],
            f"{label(world)}: not compared with fully_shard, because training with the prefetch "
            "windows failed first:",
        )


def label(world: int) -> str:
    return f"3.5 FSDP-style ZeRO-3 on {world} ranks ({N_UNITS} units)"


# ----------------------------------------------------------------------------- one unit


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_unit_casts_before_gathering_and_reduces_in_the_reduce_dtype(world: int) -> None:
    needs_partition()
    first_problems(
        unit_lines(runs(world)),
        f"{label(world)}: FsdpUnit's methods tried alone on one block, rank-distinct values:",
    )


# ----------------------------------------------------------------------------- windows


def computed_unwaited(run: WindowRun) -> str | None:
    """A unit whose compute began while its last all-gather had not been waited for."""
    in_flight: set[int] = set()
    for event in run.events:
        if event.unit is None:
            continue
        if event.kind == "issue":
            in_flight.add(event.unit)
        elif event.kind == "wait":
            in_flight.discard(event.unit)
        elif event.kind in ("fwd_start", "bwd_start") and event.unit in in_flight:
            where = "forward" if event.kind == "fwd_start" else "backward"
            return (
                f"unit {event.unit}'s {where} began while its all-gather was still in flight "
                "(issued, not waited for): the unit about to compute must be waited for "
                "(wait_gather) before its parameters are read" + before_site()
            )
    return None


def before_site() -> str:
    """Where the learner's Prefetcher.before is: the order of gathers, waits and computes is its
    doing once FsdpUnit's methods behave alone (require_units has checked them first)."""
    return defined_at(fsdp_module().Prefetcher.before)


def window_value_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for rank, result in enumerate(results):
        for run in result["windows"]:
            assert isinstance(run, WindowRun)
            found = run.error or run.value_problem
            unwaited = computed_unwaited(run)
            if found and unwaited:
                lines.append(f"rank {rank}, prefetch {run.window}: {unwaited} ({found})")
            elif found:
                if run.unwaited or "NaN" in found:
                    found += (
                        f" ({run.unwaited} all-gather(s) of that step were never waited for: a "
                        "gather's values arrive only when its Work's wait() returns)"
                    )
                lines.append(f"rank {rank}, prefetch {run.window}: {found}")
    return lines


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_with_prefetch_windows_trains_like_one_process_in_float64(world: int) -> None:
    needs_partition()
    results = runs(world)
    require_units(results, world)
    first_problems(
        window_value_lines(results),
        f"{label(world)}, no mixed precision, float64, prefetch windows {WINDOWS}, "
        f"{STEPS} AdamW steps against one process on the whole batch:",
    )


def expected_window(order: list[int], position: int, window: int) -> tuple[int, ...]:
    return tuple(sorted(order[position : position + 1 + window]))


def _first(events: list[Event], kind: str, unit: int, start: int = 0) -> int | None:
    for index in range(start, len(events)):
        if events[index].kind == kind and events[index].unit == unit:
            return index
    return None


def window_problems(run: WindowRun) -> list[str]:
    """The units holding memory at every compute start, and the order of issue, compute end
    and wait, against the window."""
    events, window = run.events, run.window
    forward = list(range(N_UNITS))
    backward = forward[::-1]
    problems = []
    for event in events:
        if event.kind not in ("fwd_start", "bwd_start") or event.unit is None:
            continue
        order = forward if event.kind == "fwd_start" else backward
        want = expected_window(order, order.index(event.unit), window)
        if event.gathered != want:
            where = "forward" if event.kind == "fwd_start" else "backward"
            more = set(event.gathered) - set(want)
            less = set(want) - set(event.gathered)
            why = (
                f"units {sorted(more)} hold memory beyond the window: start at most the next "
                f"{window} units' gathers, and free each unit after its {where}"
                if more
                else f"units {sorted(less)} were not started: start the next {window} units' "
                "gathers (fewer at the end) when a unit is about to compute"
            )
            if event.unit in less:
                why = f"unit {event.unit} itself was not gathered when its {where} began"
            problems.append(
                f"at unit {event.unit}'s {where}, units {list(event.gathered)} held memory; with "
                f"prefetch {window} expected {list(want)}: {why}" + before_site()
            )
            break
    if window == 0 or problems:
        return problems
    backward_start = next((i for i, e in enumerate(events) if e.kind == "bwd_start"), len(events))
    for section, order, end_kind, start in (
        ("forward", forward, "fwd_end", 0),
        ("backward", backward, "reduce", backward_start),
    ):
        for current, after in itertools.pairwise(order):
            issue = _first(events, "issue", after, start)
            end = _first(events, end_kind, current, start)
            wait = _first(events, "wait", after, start)
            compute = f"unit {current}'s {section}" + (
                " (its gradients' reduce-scatter)" if section == "backward" else ""
            )
            if issue is None or end is None:
                continue  # the window test above already said so
            if issue > end:
                problems.append(
                    f"{section}: unit {after}'s all-gather was issued after {compute} ended: "
                    "issue it when the unit before it starts computing"
                )
            elif wait is None:
                problems.append(
                    f"{section}: unit {after}'s all-gather was issued during {compute} but "
                    "never waited for: its values arrive at wait(); wait when the unit is about "
                    "to compute"
                )
            elif wait < end:
                problems.append(
                    f"{section}: unit {after}'s all-gather was issued during {compute}, as it "
                    "should, but waited for before that compute ended: nothing overlaps; wait "
                    f"for a unit only when it is about to compute (at unit {after}'s own start)"
                )
            if problems:
                return [problems[0] + before_site()]
    return problems


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_gathers_ahead_within_the_prefetch_window(world: int) -> None:
    needs_partition()
    results = runs(world)
    require_units(results, world)
    problems = []
    for rank, result in enumerate(results):
        for run in result["windows"]:
            gathers: dict[int | None, int] = {}
            for call in run.calls:
                if call.op == "all_gather":
                    gathers[call.unit] = gathers.get(call.unit, 0) + 1
            unwaited = computed_unwaited(run)
            found = [unwaited] if unwaited else window_problems(run)
            if not found and not run.error and gathers != dict.fromkeys(range(N_UNITS), 2):
                found = [
                    f"one step all-gathered the units {dict(sorted(gathers.items(), key=str))} "
                    "(unit: times); expected each unit twice, once for its forward and once for "
                    "its backward"
                ]
            lines = [f"rank {rank}, prefetch {run.window}: {line}" for line in found]
            if run.unwaited and not found:
                lines.append(
                    f"rank {rank}, prefetch {run.window}: {run.unwaited} all-gather(s) were never "
                    "waited for"
                )
            problems += lines
    first_problems(
        problems,
        f"{label(world)}: the units holding memory at each compute start, and the order of "
        "issue, compute end and wait (the second step; gathers deliver at wait()):",
    )


# ----------------------------------------------------------------------------- recompute


def recompute_problem(run: RecomputeRun, where: str) -> str | None:
    """What a run with every block checkpointed did wrong, the cause named only when the
    events single it out."""
    if run.left_behind:
        units = ", ".join(str(u) for u in run.left_behind)
        issuers = run.issued_in_recompute
        if issuers:
            unit, by = next(iter(issuers.items()))
            return (
                f"after backward of step {run.step}, units [{units}] still held memory; unit "
                f"{unit}'s all-gather was issued while unit {by}'s forward was recomputed inside "
                f"backward (Prefetcher.before with recompute=True{where}): backward had passed "
                f"unit {unit}, so no hook ever waits for that gather, and the next step's "
                f"forward finds it issued and computes with unit {unit}'s weights from before "
                "the optimizer step. In a recompute, gather the unit itself and start nothing"
                + (f" ({run.value_problem})" if run.value_problem else "")
            )
        return (
            f"after backward of step {run.step}, units [{units}] still held memory (gathered "
            "or with an all-gather in flight): every gather issued in a pass must be waited for "
            "by its unit in that pass, and each unit frees after its gradients are reduced"
        )
    if run.error or run.value_problem:
        return run.error or run.value_problem
    if run.gathers != dict.fromkeys(range(N_UNITS), 2):
        return (
            f"one step all-gathered the units {dict(sorted(run.gathers.items(), key=str))} "
            "(unit: times); expected each unit twice, as without checkpointing: once for its "
            "forward and once for its recompute, which its backward then uses"
        )
    return None


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_with_activation_checkpointing_leaves_no_gather_behind(world: int) -> None:
    needs_partition()
    results = runs(world)
    require_training(results, world)
    where = defined_at(fsdp_module().Prefetcher.before).removeprefix(" (").removesuffix(")")
    where = f", {where}" if where else ""
    ranks: dict[str, list[str]] = {}
    for rank, result in enumerate(results):
        for run in result["recompute"]:
            found = recompute_problem(run, where)
            if found:
                ranks.setdefault(f"prefetch {run.window}: {found}", []).append(str(rank))
    first_problems(
        [f"rank{'s' * (len(r) > 1)} {', '.join(r)}, {line}" for line, r in ranks.items()],
        f"{label(world)}, every block checkpointed (2.3's checkpoint runs its forward again "
        f"inside backward), float64, prefetch windows {RECOMPUTE_WINDOWS}, {STEPS} AdamW steps "
        "against one process:",
    )


# ----------------------------------------------------------------------------- fully_shard


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_equals_fully_shard_with_the_same_mixed_precision_policy(world: int) -> None:
    needs_partition()
    results = runs(world)
    require_training(results, world)
    problems = []
    for rank, result in enumerate(results):
        for run in result["policies"]:
            assert isinstance(run, PolicyRun)
            allowed = FULLY_SHARD[world][run.policy]
            if not run.diff <= allowed:
                what = "NaN" if math.isnan(run.diff) else f"{run.diff:.3e}"
                problems.append(
                    f"rank {rank}, policy {run.policy} ({POLICIES[run.policy].describe()}): "
                    f"after {STEPS} steps {run.where} differs from fully_shard's by {what} "
                    f"(allowed {allowed:g}): compute with the parameters cast to the compute "
                    "dtype and the inputs too, reduce in the reduce dtype with divide_factors' "
                    "split, and step the fp32 shard"
                )
    first_problems(
        problems,
        f"{label(world)}, prefetch 1, fp32 masters, {STEPS} AdamW steps against "
        "torch.distributed.fsdp.fully_shard on every block with the same MixedPrecisionPolicy:",
    )


def dtype_bytes(calls: list[Call], op: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for call in calls:
        if call.op == op:
            size = torch.empty(0, dtype=getattr(torch, call.dtype)).element_size()
            out[call.dtype] = out.get(call.dtype, 0) + call.numel * size
    return out


@exercise("3.5")
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_bytes_per_step_per_dtype_equal_the_formula(world: int) -> None:
    needs_partition()
    results = runs(world)
    require_training(results, world)
    psi = sum(unit_sizes(world))
    problems = []
    for rank, result in enumerate(results):
        for run in result["policies"]:
            policy = POLICIES[run.policy]
            compute = policy.compute_dtype(torch.float32)
            reduce = policy.reduction_dtype(torch.float32)
            c_name, r_name = (str(d).removeprefix("torch.") for d in (compute, reduce))
            want_ag = {c_name: 2 * psi * compute.itemsize}
            want_rs = {r_name: psi * reduce.itemsize}
            got_ag = dtype_bytes(run.calls, "all_gather")
            got_rs = dtype_bytes(run.calls, "reduce_scatter")
            where = f"rank {rank}, policy {run.policy} ({policy.describe()})"
            if got_ag != want_ag:
                doubled = got_ag == {"float32": 2 * psi * 4} and c_name != "float32"
                problems.append(
                    f"{where}: one step's all-gathers carried {got_ag} bytes per dtype; expected "
                    f"{want_ag} = 2 gathers x Ψ {psi} x {compute.itemsize} bytes"
                    + (
                        ": the master's fp32 elements travelled, twice the bytes; cast each "
                        "shard to the compute dtype before the all-gather"
                        if doubled
                        else ""
                    )
                )
            if got_rs != want_rs:
                problems.append(
                    f"{where}: one step's reduce-scatters carried {got_rs} bytes per dtype (full "
                    f"buffers); expected {want_rs} = Ψ {psi} x {reduce.itemsize} bytes of "
                    f"{r_name}, the policy's reduce dtype"
                )
            want_held = acc.formula_bytes(3, psi, world)
            if run.held is not None and run.held != want_held:
                problems.append(
                    f"{where}: bytes held after a step {run.held}; expected {want_held}: fp32 "
                    "shards, their fp32 gradients and Adam's state (16Ψ/N), every compute "
                    "buffer freed"
                )
    first_problems(
        problems,
        f"{label(world)}: bytes handed to collectives in one step (the second), per dtype, "
        f"against 2Ψ·b_param + Ψ·b_reduce with padded Ψ = {psi}:",
    )


# ----------------------------------------------------------------------------- refusals


@exercise("3.5")
@pytest.mark.reference  # the refusals are given code: nothing of the learner's is graded here
def test_fsdp_wrap_refuses_what_it_cannot_shard_before_communicating() -> None:
    fsdp = fsdp_module()
    model = blocks_model()
    cases: list[tuple[Any, str]] = [((model, list(model), -1), "prefetch"),
                                    ((model, [nn.Linear(2, 2)], 1), "not part of the model")]  # fmt: skip
    frozen = blocks_model()
    frozen.get_parameter("0.0.bias").requires_grad_(False)
    cases.append(((frozen, list(frozen), 1), "frozen"))
    tied = blocks_model()
    tied.get_submodule("1.2").bias = tied.get_parameter("0.2.bias")  # one bias, two units
    cases.append(((tied, list(tied), 1), "tied"))
    for (m, modules, prefetch), words in cases:
        with pytest.raises(ValueError) as err:
            fsdp.fsdp_wrap(m, modules, torch.optim.AdamW, None, prefetch)
        if words not in str(err.value):
            fail(f"3.5 fsdp_wrap should refuse with a message saying {words!r}; said: {err.value}")


DEMO_REFUSALS = [
    (["--fsdp", "--prefetch", "-1"], ("--prefetch", "-1")),
    (["--fsdp", "--prefetch", "65"], ("--prefetch", "65")),
    (["--prefetch", "2"], ("--prefetch", "--fsdp")),
    (["--policy", "bf16"], ("--policy", "--fsdp")),
]


@exercise("3.5")
@pytest.mark.reference
@pytest.mark.parametrize(("argv", "words"), DEMO_REFUSALS, ids=lambda v: " ".join(v))
def test_the_demo_refuses_bad_fsdp_settings_before_starting(
    argv: list[str], words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import importlib

    import torch.distributed as dist

    demo = importlib.import_module("solutions.phase3_multi_node.demos.zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def started(*_: Any, **__: Any) -> None:
        raise AssertionError("a process group started before the settings were checked")

    monkeypatch.setattr(dist, "init_process_group", started)
    try:
        code = demo.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    said = (out.err + out.out).strip()
    assert code == 2 and len(said.splitlines()) == 1, f"{argv}: exit {code}:\n{said}"
    assert all(word in said for word in words), f"{argv}: the refusal lacks {words}: {said}"


def demo_worker(impl_name: str) -> int:
    import importlib

    demo = importlib.import_module("solutions.phase3_multi_node.demos.zero")
    return int(demo.main(["--fsdp", "--steps", "2", "--hidden", "16", "--impl", impl_name]))


@exercise("3.5")
@pytest.mark.reference
def test_the_demo_runs_fsdp_style_on_two_ranks() -> None:
    needs_partition()
    from grading import impl

    assert small_world(demo_worker, 2, impl()) == [0, 0]
