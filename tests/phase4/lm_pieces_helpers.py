"""What the 4.7 pieces grader runs in its world of 4, and its one-process expectations.

Each part calls one of your functions on chosen inputs, on one or more topologies built in the
same world, and records what came back (and, for the sequence collectives and the regions, every
collective it issued: kind, group and bytes, with course/comm_counter.py); the grader
(``grade_4_7_pieces.py``) compares, and ``lm_namers.py`` says what a difference means. A part
whose function is not written yet records the TODO and where it stands (every rank stops at the
same ``raise``, before any message) and the world goes on with the next part.

The tensor-parallel group of the collectives and regions is a strict subgroup of the world (tp2
x dp2: groups (0, 1) and (2, 3)), so a collective that forgot its ``group=`` runs on all four
ranks and shows.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from grading import load
from lm_helpers import lm_parallel, lm_sequence_parallel
from lm_namers import BalanceLayout, balance_inputs, local_slice

from course.comm_counter import CommCounter
from course.language_model import IGNORE_INDEX, Routing, sequence_balance_loss
from course.topology import RankGrid, Topology
from phase3_multi_node.clip_placement import GradShard
from phase4_production.lm_support import HeldGradient

ROOT = Path(__file__).resolve().parents[2]
# top-3 of 5 experts: k, E, the batch and the layouts' dp, cp and tp sizes differ, so a share
# off by one of them is told from a share off by another (issue 49)
SEQ, BATCH, EXPERTS, K = 16, 4, 5, 3
SP_SHAPE = (4, 3, 5)  # [batch, tokens of one tp rank's share, width]
SP_DEGREES = {"dp": 2, "tp": 2}  # the sequence collectives' and regions' layout: tp groups of 2
SP_TP = SP_DEGREES["tp"]
WORLD = 4


def sp_share(x: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    return x.chunk(tp, dim=1)[tp_rank]


def sp_grid() -> RankGrid:
    return RankGrid.for_world(WORLD, SP_DEGREES["dp"], SP_DEGREES["tp"])


# ----------------------------------------------------------------------------- inputs


def sp_input(rank: int, tokens: int = SP_SHAPE[1]) -> torch.Tensor:
    """A distinct, integer-valued [4, tokens, 5] tensor per (global) rank (sums are exact)."""
    base = torch.arange(SP_SHAPE[0] * tokens * SP_SHAPE[2], dtype=torch.float64)
    return (base.view(SP_SHAPE[0], tokens, SP_SHAPE[2]) % 7 + 10 * rank + 1).clone()


def sp_weight(rank: int, tokens: int) -> torch.Tensor:
    """The rank's weight of the loss sum(out * weight): another distinct integer tensor."""
    return (sp_input(rank, tokens) % 5 - 2) * (rank + 2)


def region_shapes(which: str, sp: bool) -> tuple[int, int]:
    """(tokens of the input, tokens of the output) of a region call on the tp group."""
    share, whole = SP_SHAPE[1], SP_TP * SP_SHAPE[1]
    if which == "enter":
        return (share, whole) if sp else (whole, whole)
    return (whole, share) if sp else (whole, whole)


def count_targets() -> torch.Tensor:
    """[BATCH, SEQ] targets masked unevenly over rows and positions."""
    g = torch.Generator().manual_seed(7)
    targets = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    rows = torch.arange(BATCH)[:, None]
    cols = torch.arange(SEQ)[None, :]
    masked = (torch.rand(BATCH, SEQ, generator=g) < torch.where(rows >= 2, 0.7, 0.1)) | (
        (rows == 0) & (cols >= 12)
    )
    return targets.masked_fill(masked, IGNORE_INDEX)


COUNT_LAYOUTS = {"dp2 x cp2": {"dp": 2, "cp": 2}, "cp2 x tp2": {"cp": 2, "tp": 2}}


def count_grid(label: str) -> RankGrid:
    d = COUNT_LAYOUTS[label]
    return RankGrid.for_world(WORLD, d.get("dp", 1), d.get("tp", 1), cp=d.get("cp", 1))


@cache
def routing() -> tuple[torch.Tensor, torch.Tensor]:
    """Router probabilities [BATCH, SEQ, EXPERTS] (float64) and top-K choices."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(BATCH, SEQ, EXPERTS, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(logits, dim=-1)
    return probs, probs.topk(K, dim=-1).indices


def balance_reference() -> tuple[float, torch.Tensor]:
    """The balance loss of the whole batch and its gradient with respect to the probabilities."""
    probs, experts = routing()
    probs = probs.clone().requires_grad_()
    loss = sequence_balance_loss(Routing(probs, experts), EXPERTS)
    loss.backward()
    assert probs.grad is not None
    return float(loss.detach()), probs.grad


BALANCE_LAYOUTS = (
    BalanceLayout("dp2 x cp2", 2, 2, 1, False),
    BalanceLayout("cp4", 1, 4, 1, False),  # k = 3, cp = 4, dp = 1: pairwise different
    BalanceLayout("cp2 x tp2 with sequence parallelism", 1, 2, 2, True),
    BalanceLayout("cp2 x tp2 without sequence parallelism", 1, 2, 2, False),
)


def gradient_value(rank: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The synthetic gradient rank ``rank`` holds for ``name``: small distinct integers."""
    seed = sum(ord(c) for c in name) * 31 + rank
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64)


# what each finish_gradients case holds: (name, shape, tp_replicated, tied, expert, reduced);
# "TIED" / "END" stand for the embedding on the first stage and the head on the last (tied or
# not), "E" in a name for the expert's global index. Every tensor has at least 6 elements, so
# the 4 ranks' gradients are independent and a result tells which ranks' parts it sums.
HeldSpec = tuple[str, tuple[int, ...], bool, bool, bool, bool]
FINISH_CASES: dict[str, dict[str, Any]] = {
    "dp2 x cp2, experts on ep2": {
        "degrees": {"dp": 2, "cp": 2, "ep": 2},
        "sp": False,
        "held": [
            ("blocks.0.attention.qkv.weight", (3, 2), False, False, False, False),
            ("blocks.0.mlp_norm.weight", (6,), True, False, False, False),
            ("blocks.1.mlp.router.weight", (2, 4), True, False, False, False),
            ("blocks.1.mlp.experts.E.fc1.weight", (2, 3), True, False, True, False),
        ],
    },
    "dp2 x tp2, sequence parallel, ZeRO slices": {
        "degrees": {"dp": 2, "tp": 2},
        "sp": True,
        "held": [
            ("blocks.0.attention_norm.weight", (6,), True, False, False, False),
            ("blocks.0.mlp.down.weight", (2, 3), False, False, False, False),
            ("final_norm.weight", (7,), True, False, False, True),
            ("blocks.0.mlp.gate_up.weight", (8,), False, False, False, True),
        ],
    },
    "dp2 x tp2, no sequence parallelism, experts on ep2": {  # the world is not dp x cp
        "degrees": {"dp": 2, "tp": 2, "ep": 2},
        "sp": False,
        "held": [
            ("blocks.0.attention_norm.weight", (6,), True, False, False, False),
            ("blocks.0.mlp.down.weight", (2, 3), False, False, False, False),
            ("blocks.1.mlp.experts.E.fc1.weight", (2, 3), True, False, True, False),
        ],
    },
    "pp2 x tp2, sequence parallel": {  # tp x dp x cp = 2, not the world: tp sums differ
        "degrees": {"tp": 2, "pp": 2},
        "sp": True,
        "held": [
            ("blocks.0.attention_norm.weight", (6,), True, False, False, False),
            ("blocks.0.mlp.down.weight", (2, 3), False, False, False, False),
        ],
    },
    "pp2 x dp2, tied embedding": {
        "degrees": {"dp": 2, "pp": 2},
        "sp": False,
        "held": [
            ("TIED", (4, 3), True, True, False, False),
            ("blocks.0.mlp_norm.weight", (6,), True, False, False, False),
        ],
    },
    "pp2 x dp2, untied embedding and head": {
        "degrees": {"dp": 2, "pp": 2},
        "sp": False,
        "held": [
            ("END", (4, 3), True, False, False, False),
            ("blocks.0.mlp_norm.weight", (6,), True, False, False, False),
        ],
    },
}


@cache
def finish_grid(case: str) -> RankGrid:
    d = FINISH_CASES[case]["degrees"]
    return RankGrid.for_world(
        WORLD, d.get("dp", 1), d.get("tp", 1), d.get("pp", 1), cp=d.get("cp", 1), ep=d.get("ep", 1)
    )


def held_name(name: str, grid: RankGrid, rank: int, expert: bool) -> str:
    """The name rank ``rank`` gives a HeldSpec entry (the end it holds, the expert's id)."""
    if name in ("TIED", "END"):
        return "embedding.weight" if grid.coords(rank).pp == 0 else "head.weight"
    if expert:
        return name.replace("E", str(grid.group_of("ep", rank).index(rank)))
    return name


def entry_inputs(case: str, entry: HeldSpec) -> list[torch.Tensor]:
    """Every rank's gradient of one entry before finish_gradients, rank order."""
    return list(_entry_inputs(case, entry))


@cache
def _entry_inputs(case: str, entry: HeldSpec) -> tuple[torch.Tensor, ...]:
    grid = finish_grid(case)
    name, shape, *_ = entry
    return tuple(gradient_value(q, held_name(name, grid, q, entry[4]), shape) for q in range(WORLD))


def held_for(case: str, topology: Topology) -> list[HeldGradient]:
    """This rank's HeldGradients of a finish_gradients case."""
    grid = finish_grid(case)
    held = []
    for name, shape, tp_rep, tied, expert, reduced in FINISH_CASES[case]["held"]:
        real = held_name(name, grid, topology.rank, expert)
        grad = gradient_value(topology.rank, real, shape)
        held.append(HeldGradient(real, grad, tp_rep, tied, expert, reduced))
    return held


HAND_MADE = ", with a hand-made all-reduce"
WIRE = ", on the wire"  # count_valid_tokens' collectives and the dtypes they carried


def recording_all_reduce(seen: list[tuple[int, ...]]) -> Callable[..., torch.Tensor]:
    """An all-reduce (torch's) that notes the ranks of every group it is handed."""

    def all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
        seen.append(tuple(dist.get_process_group_ranks(group)))
        dist.all_reduce(tensor, group=group)
        return tensor

    return all_reduce


NORM_SHARDS = [  # (name, shape, replicated_on) as 4.7 places them on cp2 x tp2
    ("a tp shard", (3, 2), frozenset({"dp_cp"})),
    ("a norm", (4,), frozenset({"dp_cp", "tp"})),
]


def norm_shard_value(rank: int, name: str, shape: tuple[int, ...], replicated: frozenset[str],
                     place: dict[str, int]) -> torch.Tensor:  # fmt: skip
    """The same tensor on every rank of a set of copies: seeded by the coordinates that are
    not replicated (here: tp for a shard, nothing for a norm)."""
    key = place["tp"] if "tp" not in replicated else 0
    return gradient_value(key, name, shape)


# ----------------------------------------------------------------------------- inside the ranks


def project_frames(exc: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of the course's frames an error came through (not the grader's,
    not the libraries'), outermost first."""
    frames = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename).resolve()
        try:
            rel = path.relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[0] in ("tests", ".venv"):
            continue
        frames.append((str(path), frame.lineno or 0, frame.name))
    return frames


def attempt(work: Callable[[], Any]) -> Any:
    """``work()``, or what stopped it: ``{"todo": ...}`` for an unwritten TODO, ``{"error": ...}``
    for another exception (with the frames of the course's code it came through)."""
    try:
        return work()
    except NotImplementedError as exc:  # every rank raises alike, before any message
        return {"todo": str(exc), "where": project_frames(exc)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "where": project_frames(exc)}


def stopped(value: Any) -> bool:
    return isinstance(value, dict) and ("todo" in value or "error" in value)


_TOPOLOGIES: dict[tuple[int, ...], Topology] = {}


def topology(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> Topology:
    """One Topology per layout for the whole world (built in the same order on every rank)."""
    key = (dp, tp, pp, cp, ep)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = Topology.build(dp, tp, pp, cp=cp, ep=ep)
    return _TOPOLOGIES[key]


def counted(call: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """``call()``'s result and every collective it issued (CommCounter records)."""
    with CommCounter() as comm:
        result = attempt(call)
    return result, list(comm.records)


def _sequence_collectives() -> dict[str, Any]:
    lsp = lm_sequence_parallel()
    top = topology(**SP_DEGREES)
    group, rank = top.tp_group, top.rank
    out: dict[str, Any] = {}
    share = sp_input(rank)
    handed = share.clone()
    gathered, records = counted(lambda: lsp.all_gather_sequence(handed, group))
    out["all_gather"] = (gathered, records, torch.equal(handed, share))
    whole = sp_input(rank, tokens=SP_TP * SP_SHAPE[1])
    handed = whole.clone()
    scattered, records = counted(lambda: lsp.reduce_scatter_sequence(handed, group))
    if isinstance(scattered, torch.Tensor):
        scattered = scattered.detach().clone()  # the grader reads it after the input is gone
    out["reduce_scatter"] = (scattered, records, torch.equal(handed, whole))
    return out


def _region(lsp: Any, which: str, sp: bool, group: Any, rank: int) -> Any:
    tokens_in, tokens_out = region_shapes(which, sp)
    x = sp_input(rank, tokens=tokens_in).requires_grad_()
    fn = lsp.enter_tensor_parallel if which == "enter" else lsp.leave_tensor_parallel
    result = fn(x, group, sp)
    out = result.detach().clone() if isinstance(result, torch.Tensor) else result
    weight = sp_weight(rank, tokens_out)
    if isinstance(result, torch.Tensor) and result.shape == weight.shape and result.requires_grad:
        (result * weight).sum().backward()
    return out, x.grad


def _regions() -> dict[str, Any]:
    lsp = lm_sequence_parallel()
    top = topology(**SP_DEGREES)
    out: dict[str, Any] = {}
    for sp in (True, False):
        for which in ("enter", "leave"):
            out[f"{which}_{sp}"] = counted(partial(_region, lsp, which, sp, top.tp_group, top.rank))
    return out


def _count_valid() -> dict[str, Any]:
    lm = lm_parallel()
    out: dict[str, Any] = {}
    targets = count_targets()
    for label, d in COUNT_LAYOUTS.items():
        top = topology(d.get("dp", 1), d.get("tp", 1), cp=d["cp"])
        mine = local_slice(targets, top.dp_rank, top.dp_size, top.cp_rank, top.cp_size)
        own = int((mine != IGNORE_INDEX).sum())
        done, records = counted(partial(lm.count_valid_tokens, mine.clone(), top))
        out[label] = (done, own)
        out[label + WIRE] = [(r.op, r.dtype) for r in records]  # what the count travelled as
    return out


def _balance_one(lm: Any, layout: BalanceLayout) -> tuple[float, torch.Tensor | None]:
    probs, experts = routing()
    top = topology(layout.dp, layout.tp, cp=layout.cp)
    p, e = balance_inputs(layout, probs, experts, top.rank)
    p = p.clone().requires_grad_()
    share = lm.balance_loss_share(p, e.clone(), EXPERTS, SEQ, BATCH, top, layout.sp)
    if isinstance(share, torch.Tensor) and share.requires_grad:
        share.backward()
    return float(share.detach() if isinstance(share, torch.Tensor) else share), p.grad


def _balance() -> dict[str, Any]:
    """Per layout: (share, gradient) or what stopped it, and the collectives it issued."""
    lm = lm_parallel()
    return {lay.label: counted(partial(_balance_one, lm, lay)) for lay in BALANCE_LAYOUTS}


def group_names(records: list[Any], grid: RankGrid, rank: int) -> frozenset[str] | None:
    """The names of the groups a rank's collectives ran on ("world" for no group=); None when
    one is none of the layout's groups."""
    names = set()
    for record in records:
        if record.op == "barrier":
            continue
        if record.group_ranks is None:
            names.add("world")
            continue
        found = [
            n for n in ("cp", "tp", "dp", "dp_cp") if grid.group_of(n, rank) == record.group_ranks
        ]
        if not found:
            return None
        names.add(found[0])
    return frozenset(names)


def _finish() -> dict[str, Any]:
    """Each case twice (torch's all-reduce, then a hand-made one): the gradients after
    finish_gradients, and whether it called a collective on the world group (no group=)."""
    lm = lm_parallel()
    out: dict[str, Any] = {}
    for case, spec in FINISH_CASES.items():
        d = spec["degrees"]
        top = topology(
            d.get("dp", 1), d.get("tp", 1), d.get("pp", 1), d.get("cp", 1), d.get("ep", 1)
        )
        held = held_for(case, top)
        done, records = counted(partial(lm.finish_gradients, held, top, spec["sp"]))
        on_world = any(r.group_ranks is None for r in records)
        out[case] = done if stopped(done) else ({h.name: h.grad for h in held}, on_world)
        # again, with a hand-made all-reduce (the config's communication): which groups it saw
        seen: list[tuple[int, ...]] = []
        held = held_for(case, top)
        hand_made = recording_all_reduce(seen)
        done = attempt(partial(lm.finish_gradients, held, top, spec["sp"], hand_made))
        out[case + HAND_MADE] = done if stopped(done) else ({h.name: h.grad for h in held}, seen)
    return out


def _global_norm() -> dict[str, Any]:
    clipping = load("phase3_multi_node", "grad_clipping")
    top = topology(1, 2, cp=2)  # cp2 x tp2
    place = {"tp": top.tp_rank, "cp": top.cp_rank}
    shards = [
        GradShard(name, norm_shard_value(top.rank, name, shape, axes, place), axes)
        for name, shape, axes in NORM_SHARDS
    ]
    return {str(p): float(clipping.global_grad_norm(shards, p, top)) for p in (2.0, float("inf"))}


PARTS: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("sequence_collectives", _sequence_collectives),
    ("regions", _regions),
    ("count_valid_tokens", _count_valid),
    ("balance_loss_share", _balance),
    ("finish_gradients", _finish),
    ("global_norm", _global_norm),
)


# The tie's order, graded on dp4 x pp2 (a world of its own, 8 ranks): at dp x cp = 2 the
# data-parallel sum has two terms, a + b = b + a, and any order of the reductions leaves both
# copies of a tied embedding with the same bits; with four terms the order of additions depends
# on where the element sits in the flat buffer, and the two stages hold it at different places
# (the embedding first on stage 0, the head last on stage 1). Values of mixed magnitudes make
# nearly every order round differently.
TIE_WORLD = 8
TIE_DEGREES = {"dp": 4, "pp": 2}
TIE_SHAPE = (16, 8)
TIE_OTHERS = {0: ("blocks.0.mlp_norm.weight", (20,)), 1: ("blocks.1.mlp_norm.weight", (36,))}


def tie_value(rank: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A gradient of mixed magnitudes (1e-3 to 1e3), so that sums in another order round
    differently: the synthetic integers of ``gradient_value`` add up exactly in any order."""
    g = torch.Generator().manual_seed(sum(ord(c) for c in name) * 131 + rank)
    scale = torch.pow(10.0, torch.randint(-3, 4, shape, generator=g).to(torch.float64))
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def tie_held(rank: int, stage: int) -> list[HeldGradient]:
    """Stage 0 holds the tied embedding first, stage 1 the tied head last."""
    other, shape = TIE_OTHERS[stage]
    norm = HeldGradient(other, tie_value(rank, other, shape), tp_replicated=True)
    end = "embedding.weight" if stage == 0 else "head.weight"
    tied = HeldGradient(end, tie_value(rank, end, TIE_SHAPE), tp_replicated=True, tied=True)
    return [tied, norm] if stage == 0 else [norm, tied]


def tie_order_worker() -> dict[str, Any]:
    """On this rank of dp4 x pp2: the tied copy's gradient after finish_gradients, with its
    stage and its data-parallel index (or what stopped the learner's code)."""
    lm = lm_parallel()
    top = Topology.build(TIE_DEGREES["dp"], 1, TIE_DEGREES["pp"])
    stage = int(top.rank_in("pp"))
    held = tie_held(top.rank, stage)
    done = attempt(partial(lm.finish_gradients, held, top, False))
    if stopped(done):
        return done
    tied = next(h for h in held if h.tied)
    return {"grad": tied.grad, "stage": stage, "dp": int(top.rank_in("dp")),
            "name": tied.name}  # fmt: skip


# A tie across four stages (pp4, a world of 4): the embedding on stage 0, the head on stage 3,
# the middle stages hold neither. At pp2 the pipeline group and the embedding group hold the same
# two ranks, so a tie summed over the pipeline group passes there; here it cannot.
PP4_DEGREES = {"dp": 1, "pp": 4}


def pp4_tie_held(rank: int, stage: int, stages: int) -> list[HeldGradient]:
    norm = f"blocks.{stage}.mlp_norm.weight"
    held = [HeldGradient(norm, tie_value(rank, norm, (6,)), tp_replicated=True)]
    if stage in (0, stages - 1):
        end = "embedding.weight" if stage == 0 else "head.weight"
        tied = HeldGradient(end, tie_value(rank, end, TIE_SHAPE), tp_replicated=True, tied=True)
        held.insert(0 if stage == 0 else 1, tied)
    return held


def pp4_tie_worker() -> dict[str, Any]:
    """On this rank of pp4: every gradient it holds after finish_gradients (or what stopped)."""
    lm = lm_parallel()
    top = Topology.build(PP4_DEGREES["dp"], 1, PP4_DEGREES["pp"])
    stage = int(top.rank_in("pp"))
    held = pp4_tie_held(top.rank, stage, PP4_DEGREES["pp"])
    done = attempt(partial(lm.finish_gradients, held, top, False))
    return done if stopped(done) else {h.name: h.grad for h in held}


def tie_expected(grid: RankGrid) -> torch.Tensor:
    """What both copies must hold: each end's mean over the data-parallel ranks, summed."""
    total = torch.zeros(TIE_SHAPE, dtype=torch.float64)
    for rank in range(TIE_WORLD):
        end = "embedding.weight" if grid.coords(rank).pp == 0 else "head.weight"
        total += tie_value(rank, end, TIE_SHAPE)
    return total / TIE_DEGREES["dp"]


def pieces_worker() -> dict[str, Any]:
    """Every part in turn, on this rank of a world of 4."""
    results: dict[str, Any] = {}
    for name, part in PARTS:
        results[name] = attempt(part)
        dist.barrier()
    return results
