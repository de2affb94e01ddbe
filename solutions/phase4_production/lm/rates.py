"""The measured rates the layout planner predicts from: compute, activations, links, this machine.

The planner (``lm/planner.py``) never guesses a speed: every rate it uses is measured here, on
the machine it plans for, and carries the sentence that says how (``Rates.sources``):

* **compute**: one dense layer of the model (``course/language_model.py``'s ``Block``) timed
  forward, and forward + backward, in one process with one thread (as every rank computes) on
  four token counts; a least-squares line ``c0 + c1·tokens`` through each (medians of
  repeats). The RMSNorms' share is timed apart: it is the part tensor parallelism does not divide
  when sequence parallelism is off. The embedding, final norm, head and loss are timed the same
  way, per token; and the layer's backward split as a zero-bubble schedule splits it (B to the
  input, then W to the weights) over the one backward (``zero_bubble_walks``);
* **activations**: the bytes autograd saves for one layer's backward, per token
  (``SavedTensorMeter``, parameters excluded), and the part of them the two norms save (whole on
  every tp rank without sequence parallelism);
* **the optimizer**: AdamW's step per parameter element;
* **links**: 3.2's alpha-beta model fitted (``fit_alpha_beta``) on all-reduces of 1 KiB to 4 MiB
  over a world of the planned size (gloo here, NCCL on GPUs: ranks that share cores slow each
  other's collectives too, and the fit sees it), and on point-to-point messages of the same sizes
  exchanged by every pair of ranks at once. When the world spans nodes (``per_node`` ranks each,
  at least 2), two kinds: the all-reduce inside each node (every node at once) is the measured
  link, and the all-reduce across nodes among the ranks of the same local rank (every such group
  at once) is ``inter_node``, which the planner charges to any group that spans nodes;
* **cores**: the CPUs this process may use (``os.sched_getaffinity``): more ranks than cores on
  one machine share them, so each computes ``ranks / cores`` times slower;
* **what the ranks' work costs the cores they share** (for a machine with more ranks than cores,
  where the kernel's scheduler lends each core to whichever rank can run, and a step takes about
  the CPU time of all the ranks divided by the cores): the layer at each tensor-parallel degree
  (``lm.shard_compute``: one rank's share is timed, not divided); the CPU time a rank spends per
  collective (an alpha-beta fit on the process's CPU seconds, gloo's threads included, of the
  same all-reduces and messages as the links, each run after one layer's work as in a step);
  how much slower a layer computes when every rank computes at once than alone
  (``contention``); the framework's own CPU per pipeline action, per collective call and per
  ring round (``action_cpu``, ``call_cpu``, ``round_cpu``: 4.7's step on a model too small to
  compute anything, in the running world: :func:`framework_cpu`); and, given the model, its own
  steps at eight layouts in that world (``lm.anchors``), which the planner calibrates the rest
  by (they then stand in for ``call_cpu`` and ``round_cpu``).

Measuring has its own deadline, :func:`rates_timeout` (120 s, or ``DTFS_RATES_TIMEOUT``), not the
tests' 20 s world deadline: a quiet 2-core machine measures everything for a world of 4 in about 24
s and for one of 8 in about 40 s (starting the world included), but on a busy one a world that
measures slowly is not hung, and was reported as "another rank skipped or reordered a collective"
(issue 38). Past the deadline, :class:`MachineTooBusy` says so with the machine's load and the
fixes.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from course.cli import Refusal
from course.impl import load_impl
from course.language_model import (
    Block,
    LMConfig,
    build_language_model,
    causal_attention,
    rotary_tables,
)
from course.memory import SavedTensorMeter
from course.topology import GroupPool, RankGrid, Topology
from course.world import WorldHung, WorldStillComputing, run_world
from phase4_production.lm_layout import ParallelSettings
from solutions.phase3_multi_node.alpha_beta import AlphaBeta, Cost, fit_alpha_beta, ring_cost
from solutions.phase4_production.lm.anchors import Anchor, measure_anchors
from solutions.phase4_production.lm.shard_compute import ShardedBlock, tp_degrees

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22]  # bytes per collective / message
RATES_TIMEOUT_ENV = "DTFS_RATES_TIMEOUT"
DEFAULT_RATES_TIMEOUT = 120.0


def rates_timeout() -> float:
    """Seconds each measurement (the compute, the links) may take: ``DTFS_RATES_TIMEOUT`` or
    120, about 40 times what a quiet 2-core machine needs."""
    raw = os.environ.get(RATES_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_RATES_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise Refusal(
            f"{RATES_TIMEOUT_ENV}={raw!r}: not a positive number of seconds (fix: e.g. "
            f"{RATES_TIMEOUT_ENV}=600, or unset it for {DEFAULT_RATES_TIMEOUT:g})"
        )
    return value


class MachineTooBusy(Refusal):
    """A measurement ran past :func:`rates_timeout`: the machine is too busy to measure, which
    is not a bug of the program (exit status 1, one line, no traceback)."""

    exit_code = 1

    def __init__(self, what: str, seconds: float) -> None:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
        super().__init__(
            f"the machine was too busy to measure {what} within {seconds:g} s: load {load:.1f} "
            f"on {cores} cores (fix: measure when the machine is quieter, or allow longer with "
            f"{RATES_TIMEOUT_ENV}={max(4 * seconds, DEFAULT_RATES_TIMEOUT):g})"
        )


@dataclass(frozen=True)
class Line:
    """``fixed + per_token · tokens`` seconds."""

    fixed: float
    per_token: float

    def seconds(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens


@dataclass(frozen=True)
class Rates:
    """Everything the planner multiplies, each measured on this machine."""

    layer_forward: Line
    layer_backward: Line  # backward alone (forward + backward minus forward)
    norm_share: float  # of a layer's compute, the part tensor parallelism leaves whole (no SP)
    head_per_token: float  # embedding + final norm + head + loss, forward and backward
    activation_bytes_per_token: float  # one layer
    norm_activation_bytes_per_token: float  # of which the two norms save
    optimizer_per_element: float
    all_reduce: AlphaBeta
    point_to_point: AlphaBeta
    cores: int
    dtype: str
    sources: dict[str, str] = field(default_factory=dict)
    inter_node: AlphaBeta | None = None  # measured across nodes; None: one node, one kind
    # for ranks that share cores (see the module doc); empty / None / 0: not measured
    tp_layers: dict[int, tuple[Line, Line]] = field(default_factory=dict)  # tp -> (fwd, bwd)
    comm_cpu: AlphaBeta | None = None  # a rank's CPU seconds per ring round and byte sent
    contention: float = 1.0  # a layer's CPU time with every rank computing / alone
    action_cpu: float = 0.0  # the framework's CPU seconds per pipeline action (F, B or W)
    call_cpu: float = 0.0  # the framework's CPU seconds per collective call, beyond comm_cpu
    round_cpu: float = 0.0  # and per ring round of its collectives (waiting on more ranks)
    anchors: tuple[Anchor, ...] = ()  # the model's own steps, one layout per kind (lm.anchors)
    zero_bubble_walks: float = 2.0  # a layer's B and W together over its one backward

    def layer_seconds(self, tokens: float, tp: int) -> tuple[float, float]:
        """One tp rank's forward and backward CPU seconds for one layer's ``tokens``: its share
        timed when measured, else one rank's time divided by ``tp`` (the norms whole)."""
        if tp in self.tp_layers:
            forward, backward = self.tp_layers[tp]
            return forward.seconds(tokens), backward.seconds(tokens)
        share = (1 - self.norm_share) / tp + self.norm_share
        return (
            self.layer_forward.seconds(tokens) * share,
            self.layer_backward.seconds(tokens) * share,
        )

    def rank_layer_seconds(
        self, tokens: float, tp: int, sequence_parallel: bool
    ) -> tuple[float, float]:
        """One tp rank's forward and backward seconds for one layer: its measured share
        (:meth:`layer_seconds`), less the norms' work that sequence parallelism divides."""
        forward, backward = self.layer_seconds(tokens, tp)
        if sequence_parallel and tp > 1:
            norms = self.norm_share * (1 - 1 / tp)
            forward -= norms * self.layer_forward.seconds(tokens)
            backward -= norms * self.layer_backward.seconds(tokens)
        return forward, backward


def _median_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def process_cpu() -> float:
    """CPU seconds this process has used, all its threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _median_wall_and_cpu(work: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians of the wall seconds and of the process's CPU seconds of ``work``."""
    work()  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, started = process_cpu(), time.perf_counter()
        work()
        walls.append(time.perf_counter() - started)
        cpus.append(process_cpu() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _line(points: Sequence[tuple[float, float]]) -> Line:
    """Least squares ``seconds = fixed + per_token · tokens`` through (tokens, seconds), each
    point's error relative to its own time (as 3.2's alpha-beta fit weighs its sizes): an
    absolute fit is decided by the largest counts and missed a one-sequence micro-batch by
    15-18% here, where pipelines of many micro-batches live. Both parts at least 0."""
    weights = [1.0 / s**2 if s > 0 else 0.0 for _, s in points]
    sw = sum(weights)
    swt = sum(w * t for w, (t, _) in zip(weights, points, strict=True))
    swtt = sum(w * t * t for w, (t, _) in zip(weights, points, strict=True))
    sws = sum(w * s for w, (_, s) in zip(weights, points, strict=True))
    swts = sum(w * t * s for w, (t, s) in zip(weights, points, strict=True))
    det = sw * swtt - swt * swt
    if sw == 0 or det <= 0:  # one count or no time: a line through the origin and the mean
        mean_t = sum(t for t, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        return Line(0.0, mean_s / mean_t if mean_t > 0 else 0.0)
    per_token = (sw * swts - swt * sws) / det
    fixed = (sws - per_token * swt) / sw
    if per_token < 0:  # no growth with tokens: the weighted mean, fixed
        return Line(max(sws / sw, 0.0), 0.0)
    if fixed < 0:  # through the origin, still relative: sum(w t s) / sum(w t t)
        return Line(0.0, max(swts / swtt, 0.0))
    return Line(fixed, per_token)


def measure_compute(
    config: LMConfig, dtype: torch.dtype, repeats: int = 5, deadline: float | None = None
) -> dict[str, Any]:
    """Layer and head times and activation bytes, one process, from ``config``'s shapes;
    :class:`MachineTooBusy` when they take more than ``deadline`` seconds (default
    :func:`rates_timeout`; checked between token counts)."""
    deadline = rates_timeout() if deadline is None else deadline
    began = time.monotonic()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank computes (torchrun and the harness set one thread)
    block = Block(config, 0).to(dtype)
    positions = torch.arange(config.seq_len)
    cos, sin = rotary_tables(positions, config.head_dim, config.rope_base, dtype)
    counts = (1, 2, 4, 8, 16)  # sequences: a pipeline's micro-batches go down to one
    forward, backward, norms = [], [], []
    saved = norm_saved = 0
    for batch in counts:
        x = torch.randn(batch, config.seq_len, config.width, dtype=dtype, requires_grad=True)
        tokens = batch * config.seq_len

        def fwd(x: torch.Tensor = x) -> torch.Tensor:
            return block(x, cos, sin, causal_attention)[0]

        def both(x: torch.Tensor = x) -> None:
            fwd(x).sum().backward()

        def norm(x: torch.Tensor = x) -> None:
            (block.attention_norm(x) + block.mlp_norm(x)).sum().backward()

        f = _median_seconds(fwd, repeats)
        forward.append((tokens, f))
        backward.append((tokens, max(_median_seconds(both, repeats) - f, 0.0)))
        norms.append(_median_seconds(norm, repeats))
        with SavedTensorMeter(exclude=list(block.parameters())) as meter:
            fwd(x).sum().backward()
        saved = meter.peak_bytes // tokens
        with SavedTensorMeter(exclude=list(block.parameters())) as meter:
            norm(x)
        norm_saved = meter.peak_bytes // tokens
        if time.monotonic() - began > deadline:
            torch.set_num_threads(threads)
            raise MachineTooBusy("one layer's compute", deadline)
    layer_forward, layer_backward = _line(forward), _line(backward)
    walks = zero_bubble_walks(block, config, cos, sin, repeats)
    tp_layers = {}
    for tp in tp_degrees(config):
        shard = ShardedBlock(config, tp).to(dtype)
        points: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
        for batch in counts:
            x = torch.randn(batch, config.seq_len, config.width, dtype=dtype, requires_grad=True)

            def shard_forward(x: torch.Tensor = x, shard: ShardedBlock = shard) -> torch.Tensor:
                return shard(x, cos, sin)

            def shard_both(x: torch.Tensor = x) -> None:
                shard_forward(x).sum().backward()

            f = _median_seconds(shard_forward, repeats)
            b = max(_median_seconds(shard_both, repeats) - f, 0.0)
            points[0].append((batch * config.seq_len, f))
            points[1].append((batch * config.seq_len, b))
        tp_layers[tp] = (_line(points[0]), _line(points[1]))
        if time.monotonic() - began > deadline:
            torch.set_num_threads(threads)
            raise MachineTooBusy("one layer's compute", deadline)
    big = counts[-1] * config.seq_len
    whole = layer_forward.seconds(big) + layer_backward.seconds(big)
    model = build_language_model(config, 0, dtype)
    data = torch.randint(0, config.vocab, (counts[-1], config.seq_len))

    def head() -> None:
        logits = model.head(model.final_norm(model.embedding(data)))
        torch.nn.functional.cross_entropy(logits.view(-1, config.vocab), data.view(-1)).backward()

    flat = torch.zeros(1 << 20, dtype=dtype, requires_grad=True)
    flat.grad = torch.randn_like(flat)
    optimizer = torch.optim.AdamW([flat], lr=1e-3)
    result = {
        "layer_forward": layer_forward,
        "layer_backward": layer_backward,
        "norm_share": min(norms[-1] / whole, 1.0) if whole > 0 else 0.0,
        "head_per_token": _median_seconds(head, repeats) / big,
        "activation_bytes_per_token": float(saved),
        "norm_activation_bytes_per_token": float(norm_saved),
        "optimizer_per_element": _median_seconds(optimizer.step, repeats) / flat.numel(),
        "tp_layers": tp_layers,
        "zero_bubble_walks": walks,
    }
    torch.set_num_threads(threads)
    return result


def zero_bubble_walks(
    block: Block, config: LMConfig, cos: torch.Tensor, sin: torch.Tensor, repeats: int
) -> float:
    """A layer's split backward over its whole backward, timed: B (autograd to the input
    alone, the graph kept) then W (autograd to the weights, 2.5's ``_backward_weight``) against
    one ``backward()``, at 4 sequences. Not 2: B skips the weights' products, and W walks back
    through the layer again only as far as its weights need (Qi et al., 2023, "Zero Bubble
    Pipeline Parallelism", split B and W the same way)."""
    params = [p for p in block.parameters() if p.requires_grad]

    def timed(split: bool) -> float:
        times = []
        for _ in range(repeats + 1):
            x = torch.randn(4, config.seq_len, config.width, dtype=cos.dtype, requires_grad=True)
            y = block(x, cos, sin, causal_attention)[0]
            g = torch.randn_like(y)
            started = time.perf_counter()
            if split:
                torch.autograd.grad(y, x, g, retain_graph=True)
                torch.autograd.backward(y, g, inputs=params)
            else:
                y.backward(g)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    whole = timed(False)
    return timed(True) / whole if whole > 0 else 2.0


def two_kinds(world: int, per_node: int | None) -> bool:
    """Whether a world is measured as two kinds of links: several nodes of >= 2 ranks each."""
    return per_node is not None and 2 <= per_node < world and world % per_node == 0


def out_of_time(began: float, deadline: float) -> bool:
    """Whether any rank has measured for more than ``deadline`` seconds (a MAX all-reduce of
    one flag, so that every rank stops after the same size)."""
    late = torch.tensor([float(time.monotonic() - began > deadline)])
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def link_times(
    repeats: int,
    per_node: int | None = None,
    deadline: float | None = None,
    model: LMConfig | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """On every rank: median seconds of an all-reduce over the world (over this rank's node
    when the world spans nodes, see :func:`two_kinds`, and then also across nodes), and of a
    send/recv exchange with the neighbouring rank (every pair at once), per size. With a
    ``deadline`` (seconds; torchrun's world, where no harness watches the clock) every rank
    raises :class:`MachineTooBusy` after the size during which it passed. With ``model``, also
    its anchor steps (``lm.anchors``, at ``batch`` where they take it), under ``"anchors"``."""
    began = time.monotonic()
    out: dict[str, Any] = {
        "all_reduce": [], "point_to_point": [], "all_reduce_cpu": [], "point_to_point_cpu": []
    }  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    node_group: Any = None  # the world; new_group types non-members as a sentinel
    across_group: Any = None
    if per_node is not None and two_kinds(world, per_node):
        grid = RankGrid.for_world(world, ranks_per_node=per_node)
        for ranks in grid.intra_node_groups():  # every rank creates every group, in order
            group = dist.new_group(list(ranks))
            node_group = group if rank in ranks else node_group
        for ranks in grid.inter_node_groups():
            group = dist.new_group(list(ranks))
            across_group = group if rank in ranks else across_group
        out["inter_node"] = []
    layer = _layer_work()
    alone, layer_cpu = contention(layer, repeats)
    out["contention"] = [layer_cpu / alone if alone > 0 else 1.0]
    for size in SIZES:
        tensor = torch.zeros(size // 4, dtype=torch.float32)

        def reduce(tensor: torch.Tensor = tensor) -> None:
            dist.all_reduce(tensor, group=node_group)

        def across(tensor: torch.Tensor = tensor) -> None:
            dist.all_reduce(tensor, group=across_group)

        def exchange(tensor: torch.Tensor = tensor) -> None:
            if rank % 2 == 0:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            else:
                dist.recv(tensor, peer)
                dist.send(tensor, peer)

        dist.barrier()
        out["all_reduce"].append(_median_seconds(reduce, repeats))
        dist.barrier()
        out["point_to_point"].append(_median_seconds(exchange, repeats) / 2)  # one way
        # the CPU they cost between computations, as in a step: each after one layer's work
        dist.barrier()
        busy = _median_wall_and_cpu(partial(_after, layer, reduce), repeats)[1]
        out["all_reduce_cpu"].append(busy - layer_cpu)
        dist.barrier()
        busy = _median_wall_and_cpu(partial(_after, layer, exchange), repeats)[1]
        out["point_to_point_cpu"].append((busy - layer_cpu) / 2)  # one sent and one received
        if across_group is not None:
            dist.barrier()
            out["inter_node"].append(_median_seconds(across, repeats))
        if deadline is not None and out_of_time(began, deadline):
            raise MachineTooBusy(f"the links of {world} ranks", deadline)
    out.update({f"framework_{k}": [v] for k, v in framework_cpu(repeats).items()})
    if model is not None:
        out["anchors"] = measure_anchors(model, 2 * repeats, batch)  # the steps vary the most
    if deadline is not None and out_of_time(began, deadline):
        raise MachineTooBusy(f"the links of {world} ranks", deadline)
    return out


def _after(first: Callable[[], None], then: Callable[[], None]) -> None:
    first()
    then()


def _layer_work() -> Callable[[], None]:
    """One dense layer's forward and backward (the default model's width, two sequences, one
    thread): the work a rank does between its collectives."""
    torch.manual_seed(0)
    config = LMConfig()
    block = Block(config, 0)
    cos, sin = rotary_tables(torch.arange(config.seq_len), config.head_dim, config.rope_base,
                             torch.float32)  # fmt: skip
    x = torch.randn(2, config.seq_len, config.width, requires_grad=True)

    def layer() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        block(x, cos, sin, causal_attention)[0].sum().backward()
        torch.set_num_threads(threads)

    return layer


def contention(layer: Callable[[], None], repeats: int) -> tuple[float, float]:
    """``layer``'s CPU seconds on rank 0 alone (the others waiting in a barrier, asleep; 0.0 on
    the other ranks) and on this rank with every rank of the world computing it at once."""
    dist.barrier()
    alone = _median_wall_and_cpu(layer, 3 * repeats)[1] if dist.get_rank() == 0 else 0.0
    dist.barrier()
    together = _median_wall_and_cpu(layer, 3 * repeats)[1]
    return alone, together


def framework_cpu(repeats: int) -> dict[str, float]:
    """A rank's CPU seconds that the layers' compute and the bare collectives do not explain,
    measured with 4.7's step on a model too small to compute anything (width 16, two layers,
    16 tokens), data parallel over the whole world:

    * ``action``: per pipeline action (one micro-batch's forward or backward of a chunk): four
      micro-batches against one, over the three more micro-batches' two actions (the tiny
      layers' own cost per call is in it too);
    * ``zero_world``: what ZeRO-2 adds to plain data parallelism, per step
      (:data:`TINY_UNITS` units, a reduce-scatter and an all-gather each over the world, against
      one all-reduce);
    * ``zero_pairs``: the same with data parallelism over pairs (dp2 x tp ``world / 2``), when
      the tiny model's heads divide that way: its collectives take one ring round each, so the
      two together tell the CPU per call from the CPU per round (:func:`fit_links`).

    The steps are played in turn, round after round, and each figure is the median of the
    rounds' differences (a load that comes and goes lands on all of them alike)."""
    lm = load_impl("phase4_production", "lm_parallel", "solutions")
    world = dist.get_world_size()
    config = LMConfig(width=16, heads=4, layers=TINY_UNITS - 3, ffn=32, seq_len=16)
    data = torch.randint(0, config.vocab, (4 * world, config.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    layouts = [(world, 1, 1, 0), (world, 1, 4, 0), (world, 1, 1, 2)]  # dp, tp, m, zero
    pairs = world > 2 and config.heads % (world // 2) == 0
    if pairs:
        layouts += [(2, world // 2, 1, 0), (2, world // 2, 1, 2)]
    steps = []
    pool = GroupPool()  # one group per rank set for the tiny layouts, freed after them
    for dp, tp, m, zero in layouts:
        settings = ParallelSettings(dp=dp, tp=tp, microbatches=m, zero=zero, lr=1e-3)
        topology = Topology.build(dp, tp, 1, pool=pool)
        model = lm.ParallelLanguageModel(build_language_model(config, 0, torch.float32),
                                         topology, settings)  # fmt: skip
        model.train_step(tokens, targets)  # warm-up
        steps.append(partial(model.train_step, tokens, targets))
    rounds: list[list[float]] = []
    for _ in range(3 * repeats):
        cpu = []
        for step in steps:
            dist.barrier()
            started = process_cpu()
            step()
            cpu.append(process_cpu() - started)
        rounds.append(cpu)
    steps.clear()
    pool.destroy()
    out = {
        "action": max(statistics.median((c[1] - c[0]) / (3 * 2) for c in rounds), 0.0),
        "zero_world": statistics.median(c[2] - c[0] for c in rounds),
    }
    if pairs:
        out["zero_pairs"] = statistics.median(c[4] - c[3] for c in rounds)
    return out


TINY_UNITS = 5  # framework_cpu's model: two blocks, the embedding, the final norm, the head
ZERO2_EXTRA_CALLS = 2 * TINY_UNITS - 1  # its ZeRO-2 step's calls beyond plain data parallelism


def framework_call_and_round(
    times: dict[str, list[float]], world: int, comm_cpu: AlphaBeta
) -> tuple[float, float]:
    """The framework's CPU per collective call and per ring round, beyond ``comm_cpu``, from
    :func:`framework_cpu`'s ZeRO-2 differences: over the world each extra call takes
    ``world - 1`` rounds (less the all-reduce's ``2 (world - 1)``), over pairs one. Both kept
    >= 0; with one measurement, all of it per call."""
    calls = ZERO2_EXTRA_CALLS
    added = 2 * TINY_UNITS - 2  # rounds added, in units of (group size - 1)
    whole = times["zero_world"][0] - added * (world - 1) * comm_cpu.alpha
    if "zero_pairs" not in times or world <= 2:
        return max(whole / calls, 0.0), 0.0
    pairs = times["zero_pairs"][0] - added * comm_cpu.alpha
    per_round = max((whole - pairs) / (added * (world - 2)), 0.0)
    return max((pairs - added * per_round) / calls, 0.0), per_round


@dataclass(frozen=True)
class Links:
    all_reduce: AlphaBeta  # inside a node when the world spans nodes
    point_to_point: AlphaBeta
    inter_node: AlphaBeta | None
    comm_cpu: AlphaBeta | None = None
    contention: float = 1.0
    action_cpu: float = 0.0
    call_cpu: float = 0.0
    round_cpu: float = 0.0
    anchors: tuple[Anchor, ...] = ()


def fit_links(times: dict[str, Any], world: int, per_node: int | None = None) -> Links:
    """3.2's alpha and beta through :func:`link_times`' medians (ring costs for each group's
    size, one message for point to point)."""
    inside = per_node if per_node is not None and two_kinds(world, per_node) else world
    ring = fit_alpha_beta([ring_cost(size, inside) for size in SIZES], times["all_reduce"])
    p2p = fit_alpha_beta([Cost(1, size) for size in SIZES], times["point_to_point"])
    inter = None
    if "inter_node" in times:
        nodes = world // inside
        inter = fit_alpha_beta([ring_cost(size, nodes) for size in SIZES], times["inter_node"])
    comm_cpu = None
    if times.get("all_reduce_cpu") and times.get("point_to_point_cpu"):
        costs = [ring_cost(size, inside) for size in SIZES] + [Cost(1, size) for size in SIZES]
        cpus = [max(t, 1e-7) for t in times["all_reduce_cpu"] + times["point_to_point_cpu"]]
        comm_cpu = fit_alpha_beta(costs, cpus)
    call_cpu = round_cpu = 0.0
    if comm_cpu is not None and times.get("framework_zero_world"):
        framework = {k.removeprefix("framework_"): v for k, v in times.items()}
        call_cpu, round_cpu = framework_call_and_round(framework, world, comm_cpu)
    return Links(ring, p2p, inter, comm_cpu, times.get("contention", [1.0])[0],
                 times.get("framework_action", [0.0])[0], call_cpu, round_cpu,
                 tuple(times.get("anchors", ())))  # fmt: skip


def measure_links(
    world: int = 2,
    repeats: int = 7,
    per_node: int | None = None,
    deadline: float | None = None,
    model: LMConfig | None = None,
    batch: int | None = None,
) -> Links:
    """The links' alpha and beta, fitted in a world of ``world`` ranks (even), as nodes of
    ``per_node`` ranks when that makes two kinds (:func:`two_kinds`). The world runs under
    ``deadline`` (default :func:`rates_timeout`), not the tests' world deadline; running past it
    is :class:`MachineTooBusy` (a deadlock the harness sees is still reported as one)."""
    if world < 2 or world % 2:
        raise ValueError(f"world={world}: the links are measured by pairs, in an even world")
    deadline = rates_timeout() if deadline is None else deadline
    try:
        times = run_world(link_times, world, (repeats, per_node, None, model, batch), {},
                          timeout=deadline, ceiling=deadline)[0]  # fmt: skip
    except (WorldHung, WorldStillComputing) as hung:
        if isinstance(hung, WorldHung) and hung.deadlocked_after is not None:
            raise
        raise MachineTooBusy(f"the links of {world} ranks", deadline) from None
    return fit_links(times, world, per_node)


def measure_rates(
    config: LMConfig,
    dtype: torch.dtype = torch.float32,
    world: int = 2,
    per_node: int | None = None,
    deadline: float | None = None,
    batch: int | None = None,
) -> Rates:
    """Every rate, on this machine (a world of ``world`` ranks is started for the links and the
    anchor steps, these at ``batch``, the global batch to be planned); each measurement within
    ``deadline`` seconds (default :func:`rates_timeout`)."""
    compute = measure_compute(config, dtype, deadline=deadline)
    links = measure_links(world, per_node=per_node, deadline=deadline, model=config, batch=batch)
    cores = len(os.sched_getaffinity(0))
    name = str(dtype).removeprefix("torch.")
    sources = {
        "compute": f"one dense layer (width {config.width}, seq {config.seq_len}, {name}) timed "
        "forward and backward at 2-16 sequences in one process, one thread, a line through each",
        "activations": "SavedTensorMeter on one layer's forward and backward, per token",
        "links": f"3.2's alpha-beta fitted on all-reduces and send/recv of 1 KiB-4 MiB, "
        f"{world} ranks"
        + (
            f", nodes of {per_node}: inside and across apart"
            if links.inter_node is not None
            else ""
        ),
        "cores": f"{cores} cores this process may use (os.sched_getaffinity)",
    }
    return rates_from(compute, links, cores, name, sources)


def rates_from(
    compute: dict[str, Any], links: Links, cores: int, dtype: str, sources: dict[str, str]
) -> Rates:
    """:class:`Rates` from :func:`measure_compute`'s dict and :func:`fit_links`' links."""
    return Rates(
        layer_forward=compute["layer_forward"],
        layer_backward=compute["layer_backward"],
        norm_share=float(compute["norm_share"]),
        head_per_token=float(compute["head_per_token"]),
        activation_bytes_per_token=float(compute["activation_bytes_per_token"]),
        norm_activation_bytes_per_token=float(compute["norm_activation_bytes_per_token"]),
        optimizer_per_element=float(compute["optimizer_per_element"]),
        all_reduce=links.all_reduce,
        point_to_point=links.point_to_point,
        cores=cores,
        dtype=dtype,
        sources=sources,
        inter_node=links.inter_node,
        tp_layers=compute.get("tp_layers", {}),
        comm_cpu=links.comm_cpu,
        contention=links.contention,
        action_cpu=links.action_cpu,
        call_cpu=links.call_cpu,
        round_cpu=links.round_cpu,
        anchors=links.anchors,
        zero_bubble_walks=float(compute.get("zero_bubble_walks", 2.0)),
    )
