"""Exercise 3.5, ZeRO stages 1-3: ``uv run pytest tests/test_phase3.py -m ex3_5``.

For stages 1, 2 and 3 on worlds of 2, 3 and 4 (a model of 107 parameters in layers of 49, 40 and
18: padding is needed everywhere), one run of 10 AdamW steps in float64 is checked for:

* values: the parameters after every step equal one process's AdamW on the whole batch (1e-12);
* bytes: parameters, gradients and optimizer state a rank holds after a step (distinct tensor
  storages) equal the ZeRO paper's formulas exactly, with Ψ the padded count (float64 here:
  8-byte parameters and gradients, K = 16 bytes of Adam state per parameter);
* communication: one step hands 2Ψ elements to collectives in stages 1-2 and 3Ψ in stage 3
  (all-gather outputs + reduce-scatter inputs), with reduce-scatter and all-gather only;
* stage 3 memory: parameters are the shards plus at most one gathered layer at any time, and
  just the shards between forward and backward.

Then stages 2 and 3 inside two groups of 2 in a world of 4; frozen and tied parameters (a model
with two frozen parameters, and one whose output layer reuses the embedding's weight) in every
stage on worlds of 2 and 3: ``unit_parameters`` alone, six steps against one process (frozen
parameters never move), bytes against the formulas with the frozen ones whole on every rank;
the library way, the demo and the benchmark (reference, not scored) come after the FSDP-style
tests, in grade_3_5_zero_programs.py (they run the FSDP-style units too).
"""

from __future__ import annotations

import re

import pytest
from grading import defined_at, exercise
from learner_calls import at_learner_call
from phase3_helpers import fail, first_problems, module, small_world
from subgroups import split_into_groups
from zero_helpers import (
    ADAM_K,
    ELEMENT,
    FROZEN,
    KINDS,
    SpecialRun,
    ZeroRun,
    adamw,
    needs_partition,
    partition_problem,
    small_mlp,
    special_run,
    unit_parameters_problem,
    zero_run,
)

from solutions.phase3_multi_node.references import zero_accounting as acc

CASES = [(stage, world) for stage in (1, 2, 3) for world in (2, 3, 4)]
_RUNS: dict[tuple[int, int], list[ZeroRun] | BaseException] = {}


def runs(stage: int, world: int) -> list[ZeroRun]:
    """One world per (stage, world size), shared by the tests below (a failure is re-raised)."""
    key = (stage, world)
    if key not in _RUNS:
        try:
            _RUNS[key] = small_world(zero_run, world, stage)
        except BaseException as exc:  # a rank's error: every test of this case reports it
            at_learner_call(exc, "3.5")
            _RUNS[key] = exc
    result = _RUNS[key]
    if isinstance(result, BaseException):
        raise result
    return result


RANK_PREFIX = re.compile(r"^rank (\d+)(?: \(group \d+\))?: (.*)$", re.DOTALL)


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


def label(stage: int, world: int) -> str:
    return f"3.5 ZeRO stage {stage} on {world} ranks"


# ----------------------------------------------------------------------------- the partition


@exercise("3.5")
def test_partition_pads_to_the_world_and_gives_each_rank_one_slice() -> None:
    problem = partition_problem()
    if problem:
        fail(problem)


@exercise("3.5")
def test_bad_stages_and_models_with_nothing_to_train_are_refused_before_communication() -> None:
    zero = module("zero")
    for stage in (0, 4, "2"):
        with pytest.raises(ValueError) as err:
            zero.zero_wrap(small_mlp(), adamw, stage)
        if "stage" not in str(err.value):
            fail(f"3.5 zero_wrap(stage={stage!r}) should say which stages exist; said: {err.value}")
    with pytest.raises(ValueError, match="trainable"):
        zero.zero_wrap(small_mlp().requires_grad_(False), adamw, 1)


@exercise("3.5")
def test_unit_parameters_give_each_trainable_parameter_one_unit_and_frozen_ones_none() -> None:
    zero = module("zero")
    problems = [p for kind in (*KINDS, "nested") if (p := unit_parameters_problem(zero, kind))]
    first_problems(
        problems,
        f"3.5 unit_parameters on a model with the frozen {' and '.join(FROZEN)}, on one whose "
        "output layer reuses the embedding's weight (head.weight is embed.weight), and on a "
        "layer that owns a parameter and has a child layer:",
    )


# ----------------------------------------------------------------------------- values


@exercise("3.5")
@pytest.mark.parametrize(("stage", "world"), CASES)
def test_ten_steps_equal_adamw_on_one_process(stage: int, world: int) -> None:
    needs_partition()
    report(
        [
            f"rank {r}: {run.value_problem}"
            for r, run in enumerate(runs(stage, world))
            if run.value_problem
        ],
        f"{label(stage, world)}, 10 AdamW steps in float64 (the global batch of 24 split "
        "evenly over the ranks):",
    )


# ----------------------------------------------------------------------------- bytes


NAMES = {
    "params": "parameters hold",
    "grads": "gradients hold",
    "optimizer": "optimizer state holds",
}


def bytes_problems(stage: int, world: int, rank: int, run: ZeroRun) -> list[str]:
    want = acc.formula_bytes(stage, run.psi, world, p=ELEMENT, g=ELEMENT, k=ADAM_K)
    got = run.held
    assert got is not None
    problems = []
    per_rank = run.psi // world
    kept = "only this rank's slice of the" if stage >= 2 else "the full"
    explain = {
        "params": (
            f"stage {stage} keeps {'1/N of the' if stage == 3 else 'all'} parameters "
            f"({ELEMENT} bytes x {per_rank if stage == 3 else run.psi} padded elements)"
            + (
                ": keep the model's parameters as views of the flat buffer, do not copy them"
                if stage < 3
                else ": free the gathered layers after use"
            )
        ),
        "grads": (
            f"stage {stage} keeps {kept} "
            f"gradient ({ELEMENT} x {per_rank if stage >= 2 else run.psi} elements)"
            + (
                ": after the reduce-scatter, drop the full gradients (param.grad = None)"
                if stage >= 2
                else ""
            )
        ),
        "optimizer": (
            f"Adam's state for this rank's slice only ({ADAM_K} x {per_rank} elements); "
            f"{got.optimizer // ADAM_K} elements have state here: build the optimizer on the "
            "shards, never on model.parameters()"
        ),
    }
    for part in ("params", "grads", "optimizer"):
        g, w = getattr(got, part), getattr(want, part)
        if g != w:
            problems.append(
                f"rank {rank}: {NAMES[part]} {g} bytes, the formula gives {w}: {explain[part]}"
            )
    return problems


@exercise("3.5")
@pytest.mark.parametrize(("stage", "world"), CASES)
def test_bytes_held_equal_the_papers_formulas(stage: int, world: int) -> None:
    needs_partition()
    results = runs(stage, world)
    psi = results[0].psi
    formula = {1: "2pΨ + KΨ/N", 2: "pΨ + (p+K)Ψ/N", 3: "(2p+K)Ψ/N"}[stage]
    report(
        [p for r, run in enumerate(results) for p in bytes_problems(stage, world, r, run)],
        f"{label(stage, world)}: bytes after one step vs {formula} with padded Ψ = {psi}, "
        f"p = {ELEMENT} (float64), K = {ADAM_K} (Adam's two moments):",
    )


# ----------------------------------------------------------------------------- communication


def calls_explained(stage: int, run: ZeroRun, want: dict[str, int], world: int) -> str:
    """Why the collectives of one step differ from the expected ones, from what was observed."""
    gathers = run.calls.get("all_gather_into_tensor", 0)
    if run.calls.get("all_reduce"):
        return (
            "the gradients must be reduce-scattered (each rank receives only its slice), not "
            "all-reduced: ZeroUnit.reduce_scatter forms each unit's slice of the group's sum"
            + defined_at(module("zero_units").ZeroUnit.reduce_scatter)
        )
    if stage == 3 and gathers < want["all_gather_into_tensor"]:
        shards = run.psi // world * ELEMENT
        if "free" in run.unit_problems:
            return (
                f"{run.unit_problems['free']}; so a layer stays gathered and the next gather() "
                "finds nothing to do"
            )
        if run.after_forward_param_bytes > shards:
            return (
                "the layers were still gathered when backward began (parameters held "
                f"{run.after_forward_param_bytes} bytes after forward, the shards are {shards}), "
                "so the backward pre-hook's gather() had nothing to do: free each layer right "
                "after its forward, in a forward hook"
            )
        return (
            "one all-gather per layer before its forward and one before its backward: the layers "
            "were freed after forward, so gather them again in a full backward pre-hook"
        )
    if gathers < want["all_gather_into_tensor"] and stage < 3:
        return (
            "one per layer; an all-gather is missing: after the inner optimizer's step every "
            "unit all-gathers its parameters (stages 1-2)"
        )
    return "one per layer" + (
        ", and in stage 3 one all-gather before forward and one before backward"
        if stage == 3
        else ""
    )


@exercise("3.5")
@pytest.mark.parametrize(("stage", "world"), CASES)
def test_one_step_moves_2_psi_or_3_psi_with_reduce_scatter_and_all_gather(
    stage: int, world: int
) -> None:
    needs_partition()
    results = runs(stage, world)
    run = results[0]
    units = run.units
    want_calls = {
        "reduce_scatter_tensor": units,
        "all_gather_into_tensor": 2 * units if stage == 3 else units,
    }
    want_volume = acc.formula_volume(stage, run.psi, ELEMENT)
    problems = []
    for rank, got in enumerate(results):
        if got.calls != want_calls:
            problems.append(
                f"rank {rank}: one step (forward, backward, optimizer step) called {got.calls}; "
                f"expected {want_calls}: " + calls_explained(stage, got, want_calls, world)
            )
        elif got.volume != want_volume:
            problems.append(
                f"rank {rank}: collectives of one step carried {got.volume} bytes of full buffers "
                f"(all-gather outputs + reduce-scatter inputs), expected {want_volume} = "
                f"{3 if stage == 3 else 2}Ψ x {ELEMENT} bytes"
            )
    report(problems, f"{label(stage, world)}: communication of one step:")


@exercise("3.5")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_stage3_holds_the_shards_plus_one_layer_at_most(world: int) -> None:
    needs_partition()
    results = runs(3, world)
    problems = []
    for rank, run in enumerate(results):
        shards = run.psi // world * ELEMENT
        layer = run.largest_layer * ELEMENT
        free_broken = run.unit_problems.get("free")
        if run.after_forward_param_bytes != shards:
            problems.append(
                f"rank {rank}: between forward and backward the parameters held "
                f"{run.after_forward_param_bytes} bytes; expected only the shards, {shards} "
                "bytes: "
                + (free_broken or "free each layer right after its forward (a forward hook)")
            )
        if run.peak_param_bytes != shards + layer:
            problems.append(
                f"rank {rank}: parameter bytes peaked at {run.peak_param_bytes} during forward "
                f"and backward; expected the shards plus the largest layer, {shards} + {layer} = "
                f"{shards + layer}: gather a layer just before it runs (forward and backward) "
                "and free it right after"
            )
        if run.after_step_param_bytes != shards:
            problems.append(
                f"rank {rank}: after the step the parameters held {run.after_step_param_bytes} "
                f"bytes; expected the shards, {shards}: "
                + (free_broken or "free each layer after its backward")
            )
    report(problems, f"3.5 ZeRO stage 3 on {world} ranks, parameter memory:")


# ----------------------------------------------------------------------------- subgroups


SUBGROUP_SIZE, SUBGROUP_WORLD = 2, 4  # two groups of 2 in a world of 4


def subgroup_worker(stage: int) -> tuple[str | None, list[str]]:
    info = split_into_groups(SUBGROUP_SIZE)
    run = zero_run(stage, seed=1 + info.index, subgroup=info)  # each group its own data
    return run.value_problem, run.other_group_calls


@exercise("3.5")
@pytest.mark.parametrize("stage", [2, 3])
def test_two_groups_of_two_train_independently(stage: int) -> None:
    needs_partition()
    results = small_world(subgroup_worker, SUBGROUP_WORLD, stage)
    problems = []
    for rank, (value, crossing) in enumerate(results):
        if value:
            problems.append(f"rank {rank} (group {rank // 2}): {value}")
        for call in crossing:
            problems.append(
                f"{call} outside its group {(rank // 2 * 2, rank // 2 * 2 + 1)}: pass "
                "group= to every collective and take ranks and sizes from the group"
            )
    report(problems, f"3.5 ZeRO stage {stage} in the groups (0, 1) and (2, 3):")


# ----------------------------------------------------------------------------- frozen and tied


_SPECIAL: dict[int, list[list[SpecialRun]] | BaseException] = {}


def special_worker() -> list[SpecialRun]:
    return [special_run(kind, stage) for kind in KINDS for stage in (1, 2, 3)]


def special_runs(world: int, kind: str) -> list[list[SpecialRun]]:
    """Per rank, the runs of ``kind`` in stages 1, 2, 3 (one world per size, shared)."""
    if world not in _SPECIAL:
        try:
            _SPECIAL[world] = small_world(special_worker, world)
        except BaseException as exc:
            at_learner_call(exc, "3.5")
            _SPECIAL[world] = exc
    result = _SPECIAL[world]
    if isinstance(result, BaseException):
        raise result
    return [[run for run in ranks if run.kind == kind] for ranks in result]


def special_label(kind: str, world: int) -> str:
    what = (
        f"a model with the frozen parameters {' and '.join(FROZEN)}"
        if kind == "frozen"
        else "a model whose output layer reuses the embedding's weight (tied)"
    )
    return f"3.5 ZeRO on {what}, {world} ranks"


@exercise("3.5")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_and_tied_parameters_train_like_one_process(kind: str, world: int) -> None:
    needs_partition()
    problems = []
    for rank, runs_ in enumerate(special_runs(world, kind)):
        stages: dict[str, list[str]] = {}  # the same remark in several stages: said once
        for run in runs_:
            found = run.placement or run.error or run.value_problem
            if found:
                stages.setdefault(found, []).append(str(run.stage))
        for found, which in stages.items():
            s = "s" if len(which) > 1 else ""
            problems.append(f"rank {rank}: stage{s} {', '.join(which)}: {found}")
    report(
        problems,
        f"{special_label(kind, world)}, six AdamW steps in float64 against one process (torch's "
        "AdamW skips parameters without a gradient):",
    )


@exercise("3.5")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_and_tied_bytes_equal_the_formulas(kind: str, world: int) -> None:
    needs_partition()
    problems = []
    for rank, runs_ in enumerate(special_runs(world, kind)):
        for run in runs_:
            if run.held is None or run.placement or run.error:
                continue  # reported by the test above
            stage, psi, frozen = run.stage, run.psi, run.frozen
            want = acc.formula_bytes(stage, psi, world, ELEMENT, ELEMENT, ADAM_K, frozen)
            for part in ("params", "grads", "optimizer"):
                got, expected = getattr(run.held, part), getattr(want, part)
                if got != expected:
                    extra = (
                        f" ({ELEMENT} x {frozen} frozen elements, whole on every rank, are part "
                        "of it)"
                        if part == "params" and frozen
                        else ""
                    )
                    problems.append(
                        f"rank {rank}: stage {stage}: {NAMES[part]} {got} bytes, the formula "
                        f"gives {expected} with Ψ = {psi} trainable (padded), Φ = {frozen} "
                        f"frozen{extra}"
                    )
            volume = acc.formula_volume(stage, psi, ELEMENT)
            again = extra_gathers = ""
            if kind == "tied" and stage == 3:
                shared = -(-66 // world) * world  # the embedding's unit, gathered a third time
                volume += ELEMENT * shared
                again = (
                    f" + {ELEMENT} x {shared}: the head's forward gathers the embedding's unit "
                    "again (its weight is the head's)"
                )
                surplus = run.volume - volume
                if surplus > 0 and surplus % (ELEMENT * shared) == 0:
                    extra_gathers = (
                        f"; the {surplus} bytes more are {surplus // (ELEMENT * shared)} more "
                        "all-gather(s) of the embedding's unit, which is still whole when the "
                        "embedding's own backward pre-hook asks for it (its gradient, from both "
                        "uses, is reduced and the unit freed only after that backward): gather() "
                        "on a unit that holds its whole buffer already must communicate nothing"
                    )
            if run.volume != volume:
                problems.append(
                    f"rank {rank}: stage {stage}: one step handed {run.volume} bytes to "
                    f"collectives; expected {volume} = {3 if stage == 3 else 2}Ψ x {ELEMENT}"
                    f"{again}{extra_gathers}"
                    + (": frozen parameters are never communicated" if frozen else "")
                )
    report(problems, f"{special_label(kind, world)}: bytes after one step and per step:")
