"""Randomized layouts of the language model against one process (issue 38).

The 4.7 grader trains 22 fixed layouts; settings that none of them combines can still train
wrong (FSDP-style units with activation checkpointing did, from step 2). This module draws
layouts from everything :class:`~phase4_production.lm_layout.ParallelSettings` accepts and the
model options beside it (degrees of worlds 1-8, sequence parallelism, every schedule,
micro-batches, chunks, ZeRO 0-3 and FSDP-style, the three all-reduces, recompute, clipping,
weight decay, AdamW's fused kernel, compiled chunks, tied heads, MoE with ep, and batches where whole replicas or context shards hold no
valid target), trains each 3 AdamW steps in float64 and compares with one process: every
step's report, every rank's own piece of every parameter, and AdamW's two moments (a gradient
off by a uniform factor hides from the parameters, Adam being scale-free, but not from
``exp_avg``). A draw that ``ParallelSettings.problems`` refuses is not trained: refusing by name
is the framework's answer for what it cannot make right.

**Which draws.** Pure random draws rarely combine two rare options. From a few thousand random
candidates of one world size (seeded), the draws are picked greedily, each covering the most
option pairs (``zero=fsdp`` with ``recompute``, ``tied`` with ``pp2``, ...) not yet covered:
pairwise covering arrays, the classic way to test many options on a budget (Cohen et al., "The
AETG System", IEEE TSE 1997). Any seed gives other candidates::

    uv run pytest tests/test_lm_random_layouts.py --impl solutions --lm-seed 7 --lm-draws 20

and a failure prints the layout as one line that reruns it alone::

    uv run python -m tests.lm_random_layouts --seed 7 --world 4 --draws 20 --draw 3
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course.language_model import IGNORE_INDEX, LMConfig, build_language_model
from course.topology import Topology
from phase4_production.lm_layout import SCHEDULES, ZERO_CHOICES, ParallelSettings

# the 4.7 grader's helpers (expected_piece), and what they import from tests/
for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parent / "phase4"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

STEPS = 3
# Relative, float64. Before any update (step 1's losses and gradient norm) only the order of
# sums differs: 1e-10. After an update, AdamW's m/(sqrt(v) + eps) turns the rounding of a
# gradient element that nearly cancels (a few ulp of the gradient's scale, ~1e-14 here) into a
# weight change of up to lr * 1e-14 / eps (eps = 1e-8, lr <= 2e-2: ~2e-8), which the next
# steps carry into every value (seen: 5e-10 on a gradient norm at step 3, dp2 x pp2 x ep2
# zb-v, seed 1). The mistakes this test exists for are off by 1e-5 or more.
TOLERANCE_BEFORE_UPDATE = 1e-10
TOLERANCE = 1e-7
CANDIDATES = 3000  # random candidates a world's draws are picked from
# compiled draws trace with TorchDynamo and run eagerly: what can break (tracing through the
# hooks, the custom autograd Functions, the collectives) shows, without Inductor's C++ builds
WORLD_ENV = {"DTFS_COMPILE_BACKEND": "eager", "TORCHDYNAMO_VERBOSE": "0"}
DEFAULT_SEED = 2026
EMPTY = ("none", "replica", "shard")  # which ranks hold no valid target in every batch


@dataclass(frozen=True)
class Draw:
    """One drawn layout: the settings, the model, the global batch and who gets no targets."""

    settings: ParallelSettings
    config: LMConfig
    batch: int
    empty: str = "none"

    def repro(self, seed: int, world: int, budget: int, index: int) -> str:
        """One line that reruns this draw alone (and what it is)."""
        return (
            f"uv run python -m tests.lm_random_layouts --seed {seed} --world {world} "
            f"--draws {budget} --draw {index}   # {self.describe()}"
        )

    def describe(self) -> str:
        c = self.config
        model = f"width {c.width}, heads {c.heads}, layers {c.layers}, seq {c.seq_len}"
        if c.tied:
            model += ", tied"
        if c.moe_layers:
            model += f", MoE {list(c.moe_layers)} E={c.num_experts} k={c.top_k}"
        extra = [f"batch {self.batch}"]
        if self.settings.max_norm is not None:
            extra.append(f"clip {self.settings.max_norm:g}")
        if self.settings.weight_decay:
            extra.append(f"wd {self.settings.weight_decay:g}")
        if self.empty != "none":
            extra.append(f"a {self.empty} without targets")
        return f"{self.settings.label()}; {model}; {', '.join(extra)}"


# ----------------------------------------------------------------------------- drawing


def _factorizations(world: int) -> list[tuple[int, int, int, int]]:
    """Every (dp, cp, tp, pp) whose product is ``world``."""
    out = []
    for dp, cp, tp in itertools.product(range(1, world + 1), repeat=3):
        if world % (dp * cp * tp) == 0:
            out.append((dp, cp, tp, world // (dp * cp * tp)))
    return out


def draw_layout(rng: random.Random, world: int) -> Draw | None:
    """A random layout of ``world`` ranks and a small model it can run, or None when the
    settings refuse the combination (the refusal is the answer then)."""
    dp, cp, tp, pp = rng.choice(_factorizations(world))
    schedule = rng.choice(SCHEDULES) if pp > 1 else rng.choice(("1f1b", "gpipe", "zb-h1"))
    chunks = rng.choice((2, 3)) if schedule == "interleaved" else 2
    microbatches = rng.choice((1, 2, 4)) * (pp if schedule == "interleaved" else 1)
    moe = rng.random() < 0.3
    ep = rng.choice([d for d in (1, 2, 4) if (dp * cp) % d == 0]) if moe else 1
    sp = tp > 1 and rng.random() < 0.5
    settings = ParallelSettings(
        dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, sequence_parallel=sp, schedule=schedule,
        microbatches=microbatches, chunks=chunks,
        zero=rng.choice(ZERO_CHOICES),
        max_norm=rng.choice((None, 0.05, 1.0)),
        lr=rng.choice((3e-3, 2e-2)),
        weight_decay=rng.choice((0.0, 0.1)),
        communication=rng.choice(("library", "ring", "tree")),
        activation_checkpointing=rng.random() < 0.4,
        fused_adamw=rng.random() < 0.3,
        compile=rng.random() < 0.15,
    )  # fmt: skip
    heads = tp * rng.choice((1, 2))
    seq_unit = math.lcm(2 * cp, cp * tp if sp else 1)
    seq_len = seq_unit * max(1, rng.choice((8, 12, 16)) // seq_unit)
    layers = max(settings.virtual_stages, rng.choice((2, 3)))
    experts = ep * rng.choice((1, 2)) if moe else 4
    config = LMConfig(
        width=heads * rng.choice((2, 4)), heads=heads, layers=layers, ffn=tp * rng.choice((3, 4)),
        seq_len=seq_len, tied=rng.random() < 0.5,
        moe_layers=tuple(sorted(rng.sample(range(layers), rng.choice((1, min(2, layers))))))
        if moe else (),
        num_experts=experts, top_k=rng.choice((1, 2)) if experts > 1 else 1,
        expert_ffn=rng.choice((3, 6)),
    )  # fmt: skip
    batch = dp * microbatches * rng.choice((1, 2))
    empty = rng.choice(EMPTY[:2] if cp == 1 else EMPTY)
    if dp == 1 and empty == "replica":
        empty = "none"
    if settings.problems(config, batch):
        return None
    return Draw(settings, config, batch, empty)


def features(draw: Draw) -> set[tuple[str, Any]]:
    """The option values a draw exercises, the units of pairwise coverage."""
    s, c = draw.settings, draw.config
    return {
        ("degrees", (s.dp > 1, s.cp > 1, s.tp > 1, s.pp > 1)),
        ("dp", s.dp > 1), ("cp", s.cp > 1), ("tp", s.tp > 1), ("pp", s.pp > 1),
        ("ep", s.ep > 1), ("sp", s.sequence_parallel),
        ("schedule", s.schedule if s.pp > 1 else "one stage"),
        ("microbatches", s.microbatches > 1), ("zero", s.zero), ("clip", s.max_norm is not None),
        ("communication", s.communication), ("recompute", s.activation_checkpointing),
        ("weight decay", s.weight_decay > 0), ("tied", c.tied), ("moe", bool(c.moe_layers)),
        ("fused AdamW", s.fused_adamw), ("compiled", s.compile),
        ("empty", draw.empty),
    }  # fmt: skip


def pick(seed: int, world: int, budget: int) -> list[Draw]:
    """``budget`` draws of ``world`` ranks that cover the most option pairs, greedily, from
    :data:`CANDIDATES` random candidates of ``seed``."""
    rng = random.Random(f"{seed}:{world}")
    candidates: list[Draw] = []
    seen: set[Draw] = set()
    for _ in range(CANDIDATES):
        draw = draw_layout(rng, world)
        if draw is not None and draw not in seen:
            seen.add(draw)
            candidates.append(draw)
    pairs = [set(itertools.combinations(sorted(features(d), key=repr), 2)) for d in candidates]
    covered: set[Any] = set()
    chosen: list[Draw] = []
    while candidates and len(chosen) < budget:
        best = max(range(len(candidates)), key=lambda i: len(pairs[i] - covered))
        chosen.append(candidates.pop(best))
        covered |= pairs.pop(best)
    return chosen


# Draws that once found a wrong training, kept whatever the seed picks: an MoE expert that no
# token chose was stepped (momentum) where one process leaves it alone; FSDP-style units with
# recompute read stale weights; a tied embedding summed before a ring's all-reduce over dp4
# rounded its two copies apart (world 8: run with --lm-worlds 2,4,8).
FOUND: dict[int, list[Draw]] = {
    2: [
        Draw(ParallelSettings(cp=2, ep=2, communication="ring", lr=3e-3),
             LMConfig(width=2, heads=1, layers=3, ffn=3, seq_len=8, tied=True,
                      moe_layers=(0, 1), num_experts=4, top_k=1, expert_ffn=3), 2, "shard"),
        Draw(ParallelSettings(dp=2, zero="fsdp", activation_checkpointing=True, lr=2e-2),
             LMConfig(width=4, heads=2, layers=1, ffn=5, seq_len=12), 2),
    ],
    8: [
        Draw(ParallelSettings(dp=4, pp=2, ep=4, communication="ring", max_norm=1.0,
                              weight_decay=0.1, lr=3e-3),
             LMConfig(width=4, heads=1, layers=2, ffn=4, seq_len=16, tied=True, moe_layers=(1,),
                      num_experts=8, top_k=1, expert_ffn=3), 8),
    ],
}  # fmt: skip


def draws_for(seed: int, world: int, budget: int) -> list[Draw]:
    """The ``budget`` draws :func:`pick` chooses, then the draws that once found a bug."""
    return pick(seed, world, budget) + FOUND.get(world, [])


# ----------------------------------------------------------------------------- the batches


def global_batch(draw: Draw, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes, targets masked unevenly; with ``empty`` the last data-parallel replica's
    rows (``replica``) or every position outside the first zig-zag chunk of each sequence
    (``shard``: the cp ranks holding only later chunks get none) hold no valid target."""
    c, rows = draw.config, draw.batch
    g = torch.Generator().manual_seed(7919 * step + 17)
    tokens = torch.randint(0, c.vocab, (rows, c.seq_len), generator=g)
    targets = torch.randint(0, c.vocab, (rows, c.seq_len), generator=g)
    masked = torch.rand(rows, c.seq_len, generator=g) < 0.3
    masked[0, 0] = False  # the batch keeps at least one valid target
    if draw.empty == "replica":
        masked[rows - rows // draw.settings.dp :] = True
    elif draw.empty == "shard":
        masked[:, c.seq_len // (2 * draw.settings.cp) :] = True
    return tokens, targets.masked_fill(masked, IGNORE_INDEX)


# ----------------------------------------------------------------------------- one process


@dataclass
class Expected:
    """One process's run: per step the report, the parameters and AdamW's moments."""

    reports: list[tuple[float, float, float | None, int]] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    moments: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)


def one_process(draw: Draw) -> Expected:
    """The same model, whole batch, AdamW (and clip_grad_norm_), float64."""
    s = draw.settings
    model = build_language_model(draw.config, 0)
    named = dict(model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, eps=1e-8,
        fused=s.fused_adamw or None,
    )  # fmt: skip
    out = Expected()
    for step in range(STEPS):
        tokens, targets = global_batch(draw, step)
        optimizer.zero_grad(set_to_none=True)
        ce, balance = model.loss(tokens, targets)
        (ce + draw.config.aux_coefficient * balance).backward()
        norm = None
        if s.max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_norm))
        optimizer.step()
        valid = int((targets != IGNORE_INDEX).sum())
        out.reports.append((float(ce.detach()), float(balance.detach()), norm, valid))
        out.states.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        out.moments.append({
            key: {n: optimizer.state[p].get(key, torch.zeros_like(p)).clone()
                  for n, p in named.items()}
            for key in ("exp_avg", "exp_avg_sq")
        })  # fmt: skip
    return out


# ----------------------------------------------------------------------------- in the ranks


@dataclass
class RankResult:
    """What one rank of one draw did."""

    coords: tuple[int, int, int, int] = (0, 0, 0, 0)  # (pp, dp, cp, tp)
    tp_size: int = 1
    reports: list[tuple[float, float, float | None, int]] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    moments: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    pieces: dict[str, tuple[str, int]] = field(default_factory=dict)
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # full_state() at the end
    error: str | None = None


def run_draws(draws: list[Draw], impl: str = "solutions") -> list[RankResult]:
    """Train every draw in turn on this rank (a new Topology each)."""
    from course.impl import load_impl
    from course.world import report_progress

    lm = load_impl("phase4_production", "lm_parallel", impl)
    out = []
    for index, draw in enumerate(draws):
        s = draw.settings
        topology = Topology.build(s.dp, s.tp, s.pp, cp=s.cp, ep=s.ep)
        result = RankResult(tuple(topology.coords), topology.tp_size)  # type: ignore[arg-type]
        try:
            model = lm.ParallelLanguageModel(build_language_model(draw.config, 0), topology, s)
            result.pieces = {n: (p.how, p.fused_parts) for n, p in model.piece_of().items()}
            for step in range(STEPS):
                r = model.train_step(*global_batch(draw, step))
                result.reports.append((r.cross_entropy, r.balance, r.grad_norm, r.valid_tokens))
                result.states.append(model.local_state())
                result.moments.append(
                    {key: model.local_optimizer_state(key) for key in ("exp_avg", "exp_avg_sq")}
                )
            result.whole = model.full_state()
        except Exception as exc:  # every rank of the draw reports it; the next draw goes on
            result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        dist.barrier()
        out.append(result)
        report_progress(index + 1, len(draws), "layouts")
    return out


# ----------------------------------------------------------------------------- comparing


def _piece(full: torch.Tensor, how: str, parts: int, tp_rank: int, tp: int) -> torch.Tensor:
    """The piece of a one-process tensor a tp rank holds (cut here, not by the code under test)."""
    from lm_helpers import expected_piece

    return expected_piece(full, how, parts, tp_rank, tp)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return math.inf
    scale = max(float(want.abs().max()), 1e-30)
    return float((got.double() - want.double()).abs().max()) / scale


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= tolerance * max(abs(b), 1e-30)


def draw_problems(draw: Draw, per_rank: list[RankResult], want: Expected) -> list[str]:
    """What differs from one process, first step first (empty when nothing does)."""
    errors = {r.error for r in per_rank if r.error}
    if errors:
        return [f"raised {sorted(errors)[0]}"]
    for step in range(STEPS):
        got = per_rank[0].reports[step]
        if len({r.reports[step] for r in per_rank}) != 1:
            return [f"step {step + 1}: the ranks reported different losses"]
        names = ("cross-entropy", "balance loss", "gradient norm")
        tolerance = TOLERANCE_BEFORE_UPDATE if step == 0 else TOLERANCE
        for name, mine, theirs in zip(names, got[:3], want.reports[step][:3], strict=True):
            if not _close(mine, theirs, tolerance):
                return [f"step {step + 1}: {name} {mine!r}, one process {theirs!r}"]
        if got[3] != want.reports[step][3]:
            return [f"step {step + 1}: {got[3]} valid targets, one process {want.reports[step][3]}"]
        for rank, result in enumerate(per_rank):
            pp, dp, cp, tp = result.coords
            where = f"rank {rank} (pp={pp}, dp={dp}, cp={cp}, tp={tp}) after step {step + 1}"
            for name, (how, parts) in result.pieces.items():
                expected = _piece(want.states[step][name], how, parts, tp, result.tp_size)
                error = _relative(result.states[step][name], expected)
                if not error <= TOLERANCE:
                    return [f"{where}: parameter {name} off by {error:.2e} (relative)"]
                for key, values in want.moments[step].items():
                    expected = _piece(values[name], how, parts, tp, result.tp_size)
                    error = _relative(result.moments[step][key][name], expected)
                    if not error <= tolerance:  # step 1's moments come before any update
                        return [f"{where}: AdamW's {key} of {name} off by {error:.2e} (relative)"]
    for name, value in per_rank[0].whole.items():
        error = _relative(value, want.states[-1][name])
        if not error <= TOLERANCE:
            return [f"full_state() after the last step: {name} off by {error:.2e} (relative)"]
    return []


def check(
    seed: int, world: int, budget: int, draws: list[Draw], per_rank: list[list[RankResult]]
) -> list[str]:
    """One line per draw that differs: what differs, then the line that reruns it (``budget``:
    the draws picked before the found ones, as :func:`draws_for` lists them)."""
    lines = []
    for index, draw in enumerate(draws):
        found = draw_problems(draw, [runs[index] for runs in per_rank], one_process(draw))
        if found:
            lines.append(f"{found[0]}\n    {draw.repro(seed, world, budget, index)}")
    return lines


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rerun randomized layouts of the LM.")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--world", type=int, choices=(1, 2, 4, 8), default=4)
    parser.add_argument("--draws", type=int, default=8, help="draws to pick for this world")
    parser.add_argument("--draw", type=int, default=None, help="rerun only this one")
    parser.add_argument("--impl", choices=("solutions", "templates"), default="solutions")
    args = parser.parse_args(argv)
    draws = draws_for(args.seed, args.world, args.draws)
    if args.draw is not None:
        if not 0 <= args.draw < len(draws):
            parser.error(f"--draw {args.draw}: --draws {args.draws} gives draws 0-{len(draws) - 1}")
        draws = [draws[args.draw]]
    from course.world import run_world

    per_rank = run_world(run_draws, args.world, (draws, args.impl), timeout=600, env=WORLD_ENV)
    lines = check(args.seed, args.world, args.draws, draws, per_rank)
    if args.draw is not None:  # one draw: its line names its place in the whole list
        lines = [line.replace("--draw 0 ", f"--draw {args.draw} ") for line in lines]
    for index, draw in enumerate(draws):
        print(f"{args.draw if args.draw is not None else index}: {draw.describe()}")
    print("\n".join(lines) if lines else f"all {len(draws)} equal one process")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

