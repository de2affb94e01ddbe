"""What the 4.7 grader runs inside its ranks, and the one-process references it compares with.

The model is course/language_model.py's, tiny (width 16, 4 heads, 4 layers, SwiGLU 32, 16
tokens; MoE on layers 1 and 2 where a layout has experts: 4 experts, top-2, GELU 16), in
float64. The global batch holds 8 sequences of random bytes whose targets are masked unevenly
(IGNORE_INDEX): the second half of the batch loses most of its targets and even rows their last
quarter, so data-parallel replicas and context-parallel shards hold different numbers of valid
targets. One process trains the model 3 AdamW steps (with ``clip_grad_norm_`` where a layout
clips); every layout must give the same losses and, on every rank, its pieces of the same
parameters after every step.

Worlds are few: every layout of one world size runs in ONE world, one after the other (a new
Topology each); the pieces' checks of ``grade_4_7_pieces.py`` share one world of 4 the same way.
Inside the ranks, the code under test's ``finish_gradients`` is wrapped to keep, after each step,
the gradients it left (:func:`recording_finish`), which the grader compares with one process's.

:data:`FAILED_PIECES` is how the two graders of 4.7 agree on one story: the pieces grader notes
each function whose own check failed, and the training layouts that run it step aside.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from grading import load

from course.language_model import IGNORE_INDEX, LMConfig, build_language_model, uneven_batch
from course.topology import Topology
from course.world import report_progress
from phase4_production.lm_layout import ParallelSettings

PHASE = "phase4_production"
DENSE = LMConfig(width=16, heads=4, layers=4, ffn=32, seq_len=16)
MOE = replace(DENSE, moe_layers=(1, 2), num_experts=4, top_k=2, expert_ffn=16)
GLOBAL_BATCH, STEPS, SEED = 8, 3, 0
LR = 3e-3
TOLERANCE = 1e-10  # relative, float64


def lm_parallel() -> Any:
    return load(PHASE, "lm_parallel")


def lm_sequence_parallel() -> Any:
    return load(PHASE, "lm_sequence_parallel")


# The 4.7 functions whose own check (grade_4_7_pieces.py, which runs first) failed in this run:
# function -> the test that says why. A training layout that uses one of them and goes wrong
# steps aside ("blocked by ...") instead of telling a second story about the same mistake.
FAILED_PIECES: dict[str, str] = {}


def piece_failed(functions: str | list[str], test: str) -> None:
    for function in [functions] if isinstance(functions, str) else functions:
        FAILED_PIECES.setdefault(function, test)


def function_of(name: str) -> Any:
    """The code under test's 4.7 function ``name`` (either of the exercise's two modules)."""
    for module in (lm_parallel(), lm_sequence_parallel()):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def at(name: str) -> str:
    """`` (phase4_production/template_lm_parallel.py:94 in loss_share)``: where the code under
    test defines the 4.7 function ``name``."""
    from grading import defined_at

    try:
        return defined_at(function_of(name))
    except Exception:  # a module that does not import: its own test says so
        return ""


def batch(step: int, config: LMConfig = DENSE) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens, and targets masked unevenly across the batch's rows
    and positions (``course.language_model.uneven_batch``)."""
    return uneven_batch(step, config, GLOBAL_BATCH)


@dataclass(frozen=True)
class Layout:
    """One layout of the training grader: its settings and the model it trains."""

    settings: ParallelSettings
    tied: bool = False
    moe: bool = False

    @property
    def config(self) -> LMConfig:
        return replace(MOE if self.moe else DENSE, tied=self.tied)

    @property
    def label(self) -> str:
        extras = [self.settings.label()]
        extras.append("tied head" if self.tied else "untied head")
        if self.moe:
            extras.append("MoE on layers 1-2")
        if self.settings.max_norm is not None:
            extras.append(f"clip {self.settings.max_norm:g}")
        return ", ".join(extras)


def layout(tied: bool = False, moe: bool = False, **settings: Any) -> Layout:
    return Layout(ParallelSettings(lr=LR, **settings), tied, moe)


# ----------------------------------------------------------------------------- one process


@dataclass
class Reference:
    """One process's run: (cross-entropy, balance) per step and the parameters after each."""

    losses: list[tuple[float, float]] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norms: list[float | None] = field(default_factory=list)
    valid: list[int] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # before clipping


_REFERENCES: dict[tuple[Any, ...], Reference] = {}


def reference(lay: Layout) -> Reference:
    """One process, the whole batch, the same AdamW (and clipping): computed once per model."""
    key = (lay.tied, lay.moe, lay.settings.max_norm)
    if key in _REFERENCES:
        return _REFERENCES[key]
    config, s = lay.config, lay.settings
    model = build_language_model(config, SEED)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, eps=1e-8
    )
    run = Reference()
    for step in range(STEPS):
        tokens, targets = batch(step, config)
        optimizer.zero_grad(set_to_none=True)
        ce, balance = model.loss(tokens, targets)
        (ce + config.aux_coefficient * balance).backward()
        run.grads.append({
            n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters(remove_duplicate=False)
        })  # fmt: skip
        norm = None
        if s.max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_norm))
        optimizer.step()
        run.losses.append((float(ce.detach()), float(balance.detach())))
        run.norms.append(norm)
        run.valid.append(int((targets != IGNORE_INDEX).sum()))
        run.states.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    _REFERENCES[key] = run
    return run


def expected_piece(full: torch.Tensor, how: str, fused_parts: int, tp_rank: int, tp: int) -> Any:
    """The piece of a one-process parameter a tp rank holds, cut here (not by the code under
    test): column = its rows of each fused block, row = its columns, else the whole tensor."""
    if how == "column":
        blocks = full.chunk(fused_parts, dim=0)
        width = blocks[0].shape[0] // tp
        return torch.cat([b[tp_rank * width : (tp_rank + 1) * width] for b in blocks])
    if how == "row":
        width = full.shape[1] // tp
        return full[:, tp_rank * width : (tp_rank + 1) * width]
    return full


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    scale = max(float(want.abs().max()), 1e-30)
    return float((got.double() - want.double()).abs().max()) / scale


# ----------------------------------------------------------------------------- inside the ranks


@dataclass
class RankRun:
    """What one rank of one layout did: its place, its reports, its pieces after each step."""

    coords: tuple[int, int, int, int] = (0, 0, 0, 0)  # (pp, dp, cp, tp)
    tp_size: int = 1
    reports: list[tuple[float, float, float | None, int]] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    pieces: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (how, parts)
    layers: list[list[int]] = field(default_factory=list)
    error: str | None = None  # a TODO not written yet (every rank raised it alike)
    # per step, the gradients finish_gradients left (the whole pieces: ZeRO slices are not kept)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def recording_finish(run: RankRun, finish: Any) -> Any:
    """The code under test's finish_gradients, noting what it leaves in ``run.grads``."""

    def finish_gradients(held: list[Any], topology: Topology, sequence_parallel: bool,
                         all_reduce_fn: Any = None) -> None:  # fmt: skip
        finish(held, topology, sequence_parallel, all_reduce_fn)
        run.grads.append({h.name: h.grad.detach().clone() for h in held if not h.reduced})

    return finish_gradients


def run_layouts(layouts: list[Layout]) -> list[RankRun]:
    """Train every layout in turn on this rank (a new Topology each); return one RankRun each."""
    out = []
    for lay in layouts:
        s = lay.settings
        topology = Topology.build(s.dp, s.tp, s.pp, cp=s.cp, ep=s.ep)
        run = RankRun(tuple(topology.coords), topology.tp_size)  # type: ignore[arg-type]
        try:
            model = lm_parallel().ParallelLanguageModel(
                build_language_model(lay.config, SEED), topology, s
            )
            fns = model.functions
            setattr(model, "functions",  # noqa: B010 - a ClassVar, replaced on this instance
                    replace(fns, finish_gradients=recording_finish(run, fns.finish_gradients)))
            run.pieces = {n: (p.how, p.fused_parts) for n, p in model.piece_of().items()}
            run.layers = [list(r) for r in model.chunk_layers()]
            for step in range(STEPS):
                report = model.train_step(*batch(step, lay.config))
                run.reports.append(
                    (report.cross_entropy, report.balance, report.grad_norm, report.valid_tokens)
                )
                run.states.append(model.local_state())
        except NotImplementedError as exc:  # every rank stops at the same TODO, before talking
            run.error = str(exc)
        dist.barrier()
        out.append(run)
        report_progress(len(out), len(layouts), "layouts")  # "world of 4: 3/8 layouts"
    return out
