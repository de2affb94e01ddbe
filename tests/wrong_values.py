"""One realistic wrong value per exercise, planted in the exercise's first function.

A raise planted at the top of a function (tests/first_failure.py) is found by the first test
that calls it. A wrong value is what a learner really writes, and it is found only by a test
that checks that value: the exercise's first real failure. tests/learner_loop_bench.py times
it for every exercise (issue 49, item 7: within 10 s on 2 quiet cores).

Each plant is a text substitution in the completed template (the solution's code in place of
every TODO): the reference's own text, and the mistake a learner makes in its place. The
function is the exercise's first TODO function (:func:`first_plant`: the first of its first
module, where a learner writes first), and the reference's text must lie inside it, so a plant
that drifts from the solution fails loudly instead of timing a passing run
(tests/test_first_failure.py checks every plant without running it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exercises import BY_ID
from first_failure import Plant, _functions, plants

from course.template_maker import make_completed_template, solution_files, template_path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WrongValue:
    """A mistake in one function: the reference's text and what a learner writes instead."""

    right: str
    wrong: str

    @property
    def shown(self) -> str:
        """The mistake in one short line, for a table."""
        text = " ".join(self.wrong.split()) or f"(removed) {' '.join(self.right.split())}"
        return text if len(text) <= 70 else text[:67] + "..."


# exercise -> the mistake, in the exercise's first TODO function (first_plant)
WRONG_VALUES: dict[str, WrongValue] = {
    # DistributedShardSampler.__init__: rounds down without drop_last, leaving samples out
    "1.1": WrongValue("self.num_samples = math.ceil(n / num_replicas)",
                      "self.num_samples = n // num_replicas"),
    # broadcast_parameters: the parameters only, not the buffers
    "1.2": WrongValue("for tensor in [*model.parameters(), *model.buffers()]:",
                      "for tensor in model.parameters():"),
    # reduce_broadcast_all_reduce: the root's own contribution first, not in group-rank order
    "1.3": WrongValue("contributions = [tensor if peer == root else buffers[peer] for peer in "
                      "range(world)]", "contributions = [tensor, *buffers.values()]"),
    # validate_config: a batch the world does not divide is accepted
    "1.4": WrongValue("if config.global_batch_size < world_size or config.global_batch_size % "
                      "world_size:", "if config.global_batch_size < world_size:"),
    # accumulate_gradients: every micro-batch weighted 1/k, a short last one too
    "2.1": WrongValue("* (len(targets) / total)", "* (1 / len(micro_batches))"),
    # DynamicLossScaler.unscale_: each rank decides alone whether it overflowed
    "2.2": WrongValue("        if dist.is_initialized():\n"
                      "            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)\n",
                      ""),
    # CheckpointFunction.forward: the RNG state read after the forward ran, not before it
    "2.3": WrongValue("        with torch.no_grad():\n            return run_function(*args)",
                      "        outputs = run_function(*args)\n"
                      "        if preserve_rng_state:\n"
                      "            ctx.cpu_rng = torch.get_rng_state()\n"
                      "        return outputs"),
    # split_sizes: the whole remainder on the last rank
    "2.4": WrongValue("return [base + (1 if rank < extra else 0) for rank in range(world_size)]",
                      "return [base] * (world_size - 1) + [base + extra]"),
    # gpipe_rank_actions: the backwards last-in first-out
    "2.5": WrongValue("backwards = [backward(mb) for mb in range(num_microbatches)]",
                      "backwards = [backward(mb) for mb in reversed(range(num_microbatches))]"),
    # CopyToTensorParallelRegion.forward: f sums over the group, as g does
    "2.6": WrongValue("        return tensor.view_as(tensor)",
                      "        total = tensor.clone()\n"
                      "        dist.all_reduce(total, group=group)\n"
                      "        return total"),
    # zigzag_chunk_ids: the second chunk taken from the back half in order, not mirrored
    "2.7": WrongValue("return rank, 2 * cp - 1 - rank", "return rank, cp + rank"),
    # chunk_bounds: the whole remainder in the last chunk
    "3.1": WrongValue("stop = start + base + (1 if i < extra else 0)",
                      "stop = start + base + (extra if i == n - 1 else 0)"),
    # halving_doubling_all_reduce: the folded rank's tensor replaces its partner's, not added
    "3.2": WrongValue("        combine_(flat, incoming, op)\n", "        flat.copy_(incoming)\n"),
    # hierarchical_all_reduce: the middle all-reduce on the node's group, not across nodes
    "3.3": WrongValue("ring_all_reduce(chunk, op, topology.inter_node_group)",
                      "ring_all_reduce(chunk, op, topology.intra_node_group)"),
    # assign_buckets: parameters in registration order, not the order backward produces them
    "3.4": WrongValue("for index in reversed(range(len(sizes))):",
                      "for index in range(len(sizes)):"),
    # padded_size: a whole extra row when the world already divides numel
    "3.5": WrongValue("return -(-numel // world_size) * world_size",
                      "return numel + world_size - numel % world_size"),
    # build_stage: the blocks dealt round-robin, not a contiguous run per stage
    "3.6": WrongValue("blocks[first : first + per_stage]",
                      "blocks[topology.pp_rank :: topology.pp_size]"),
    # balanced_assignment: greedy in key order, not largest first
    "3.7": WrongValue("for key in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):",
                      "for key in range(len(sizes)):"),
    # route: the top-k probabilities not renormalised
    "3.8": WrongValue("weights = top_probs / top_probs.sum(dim=-1, keepdim=True)",
                      "weights = top_probs"),
    # atomic_write: no fsync before the rename
    "4.1": WrongValue("            os.fsync(f.fileno())\n", ""),
    # advance: an epoch that ends exactly is not rolled over
    "4.2": WrongValue("if position >= epoch_samples:", "if position > epoch_samples:"),
    # plan_batches: scale-lr keeps the base learning rate
    "4.3": WrongValue("return BatchPlan(world_size, micro_batch, 1, unit, base_lr * unit / "
                      "global_batch)", "return BatchPlan(world_size, micro_batch, 1, unit, "
                      "base_lr)"),
    # cast_compress_hook: divided in the bucket's dtype, then cast (one rounding, not torch's two)
    "4.4": WrongValue("compressed = buffer.to(dtype).div_(dist.get_world_size(group))",
                      "compressed = buffer.div(dist.get_world_size(group)).to(dtype)"),
    # StepTimer.mark: a section marked twice keeps only its last time
    "4.5": WrongValue("self.sections[section] = self.sections.get(section, 0.0) + (now - "
                      "self.last)", "self.sections[section] = now - self.last"),
    # token_positions: contiguous positions, not the tokens' zig-zag layout
    "4.7": WrongValue("cp, zigzag=True, dim=0)", "cp, zigzag=False, dim=0)"),
}  # fmt: skip


def first_plant(exercise: str) -> Plant:
    """The function of the exercise's first TODO as the preflight names it (the first in file
    order, in the order of the exercise's modules): where a learner writes first, and what the
    exercise's first tests call."""
    ex = BY_ID[exercise]
    order = {f"{ex.phase}/template_{module}.py": i for i, module in enumerate(ex.modules)}
    found = [plant for plant in plants() if plant.exercise == exercise and plant.template in order]
    if not found:
        raise SystemExit(f"exercise {exercise} has no template function with a TODO to plant in")
    return min(found, key=lambda plant: order[plant.template])  # the first of the first module


def completed_template(template: str) -> str:
    """The completed text of ``template`` (e.g. "phase2_advanced/template_split.py"): the
    solution's code in place of every TODO, as a learner who got it all right leaves it."""
    for solution in solution_files():
        if str(template_path(solution).relative_to(ROOT)) == template:
            return make_completed_template(solution)
    raise LookupError(f"no solution has the template {template}")


def planted_text(text: str, plant: Plant, mistake: WrongValue) -> str:
    """``text`` (a completed template) with the mistake in place of the reference's text, which
    must lie inside ``plant``'s function; a ValueError names what is missing."""
    at = text.find(mistake.right)
    if at < 0:
        raise ValueError(
            f"{plant.exercise}: the reference text {mistake.right!r} is not in {plant.template}: "
            "tests/wrong_values.py's plant has drifted from the solution"
        )
    fn = dict(_functions(ast.parse(text))).get(plant.qualname)
    if fn is None:
        raise ValueError(f"{plant.exercise}: no function {plant.qualname} in {plant.template}")
    line = text.count("\n", 0, at) + 1
    if not fn.lineno <= line <= (fn.end_lineno or fn.lineno):
        raise ValueError(
            f"{plant.exercise}: the reference text {mistake.right!r} is at {plant.template}:"
            f"{line}, outside {plant.qualname} (lines {fn.lineno}-{fn.end_lineno})"
        )
    return text[:at] + mistake.wrong + text[at + len(mistake.right) :]


@contextmanager
def substituted(scratch: Path, template: str, right: str, wrong: str) -> Iterator[None]:
    """``right`` replaced by ``wrong`` (its first occurrence) in ``scratch``'s ``template`` for
    the block; a SystemExit when ``right`` is not there."""
    path = scratch / template
    original = path.read_text()
    if right not in original:
        raise SystemExit(f"{template}: the reference text {right!r} is not there")
    path.write_text(original.replace(right, wrong, 1))
    try:
        yield
    finally:
        path.write_text(original)


@contextmanager
def planted_wrong(scratch: Path, plant: Plant) -> Iterator[WrongValue]:
    """The exercise's wrong value planted in ``scratch``'s completed template for the block."""
    mistake = WRONG_VALUES[plant.exercise]
    path = scratch / plant.template
    original = path.read_text()
    try:
        text = planted_text(original, plant, mistake)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    path.write_text(text)
    try:
        yield mistake
    finally:
        path.write_text(original)
