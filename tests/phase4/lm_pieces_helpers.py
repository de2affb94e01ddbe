"""What the 4.7 pieces grader runs in its world of 4, and its one-process expectations.

Each part calls one of your functions on chosen inputs, on one or more topologies built in the
same world, and records what came back; the grader (``grade_4_7_pieces.py``) compares. A part
whose function is not written yet records the TODO (every rank stops at the same ``raise``,
before any message) and the world goes on with the next part.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from grading import load
from lm_helpers import lm_parallel, lm_sequence_parallel

from course.language_model import IGNORE_INDEX, Routing, sequence_balance_loss
from course.topology import Topology
from phase3_multi_node.clip_placement import GradShard
from phase4_production.lm_support import HeldGradient

SEQ, BATCH, EXPERTS, K = 16, 4, 4, 2
SP_SHAPE = (4, 3, 5)  # [batch, tokens of one tp rank's share, width]


def zigzag(rank: int, cp: int) -> list[int]:
    """The grader's own zig-zag chunks (2.7): rank r holds chunk r and chunk 2cp-1-r."""
    return [rank, 2 * cp - 1 - rank]


def zigzag_positions(seq: int, rank: int, cp: int) -> list[int]:
    size = seq // (2 * cp)
    return [p for c in zigzag(rank, cp) for p in range(c * size, (c + 1) * size)]


def local_slice(x: torch.Tensor, dp_rank: int, dp: int, cp_rank: int, cp: int) -> torch.Tensor:
    """A rank's rows (dp) and zig-zag positions (cp) of a [batch, seq, ...] tensor."""
    rows = x.shape[0] // dp
    mine = x[dp_rank * rows : (dp_rank + 1) * rows]
    return mine[:, zigzag_positions(x.shape[1], cp_rank, cp)]


def sp_share(x: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    return x.chunk(tp, dim=1)[tp_rank]


# ----------------------------------------------------------------------------- inputs


def sp_input(rank: int, tokens: int = SP_SHAPE[1]) -> torch.Tensor:
    """A distinct, integer-valued [4, tokens, 5] tensor per rank (sums are exact)."""
    base = torch.arange(SP_SHAPE[0] * tokens * SP_SHAPE[2], dtype=torch.float64)
    return (base.view(SP_SHAPE[0], tokens, SP_SHAPE[2]) % 7 + 10 * rank + 1).clone()


def sp_weight(rank: int, tokens: int) -> torch.Tensor:
    """The rank's weight of the loss sum(out * weight): another distinct integer tensor."""
    return (sp_input(rank, tokens) % 5 - 2) * (rank + 2)


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


def gradient_value(rank: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The synthetic gradient rank ``rank`` holds for ``name``: small distinct integers."""
    seed = sum(ord(c) for c in name) * 31 + rank
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64)


# what each finish_gradients case holds: (name, shape, tp_replicated, tied, expert, reduced)
HeldSpec = tuple[str, tuple[int, ...], bool, bool, bool, bool]
FINISH_CASES: dict[str, dict[str, Any]] = {
    "dp2 x cp2, experts on ep2": {
        "degrees": {"dp": 2, "cp": 2, "ep": 2},
        "sp": False,
        "held": [
            ("blocks.0.attention.qkv.weight", (3, 2), False, False, False, False),
            ("blocks.0.mlp_norm.weight", (4,), True, False, False, False),
            ("blocks.1.mlp.router.weight", (2, 2), True, False, False, False),
            ("blocks.1.mlp.experts.E.fc1.weight", (2, 3), True, False, True, False),
        ],
    },
    "dp2 x tp2, sequence parallel, ZeRO slices": {
        "degrees": {"dp": 2, "tp": 2},
        "sp": True,
        "held": [
            ("blocks.0.attention_norm.weight", (4,), True, False, False, False),
            ("blocks.0.mlp.down.weight", (2, 3), False, False, False, False),
            ("final_norm.weight", (3,), True, False, False, True),
            ("blocks.0.mlp.gate_up.weight", (5,), False, False, False, True),
        ],
    },
    "dp2 x tp2, no sequence parallelism": {
        "degrees": {"dp": 2, "tp": 2},
        "sp": False,
        "held": [
            ("blocks.0.attention_norm.weight", (4,), True, False, False, False),
            ("blocks.0.mlp.down.weight", (2, 3), False, False, False, False),
        ],
    },
    "pp2 x dp2, tied embedding": {
        "degrees": {"dp": 2, "pp": 2},
        "sp": False,
        "held": [
            ("TIED", (4, 3), True, True, False, False),
            ("blocks.0.mlp_norm.weight", (3,), True, False, False, False),
        ],
    },
}


def held_for(case: str, topology: Topology) -> list[HeldGradient]:
    """This rank's HeldGradients of a finish_gradients case (the tied copy is the embedding on
    the first stage, the head on the last; the expert's name carries its global id)."""
    held = []
    for name, shape, tp_rep, tied, expert, reduced in FINISH_CASES[case]["held"]:
        if name == "TIED":
            name = "embedding.weight" if topology.is_first_stage else "head.weight"
        if expert:
            name = name.replace("E", str(topology.rank_in("ep")))
        grad = gradient_value(topology.rank, name, shape)
        held.append(HeldGradient(name, grad, tp_rep, tied, expert, reduced))
    return held


def _held_name(name: str, place: dict[str, Any], expert: bool) -> str:
    """The name a rank gives a HeldSpec entry (the tied copy's end, the expert's id)."""
    if name == "TIED":
        return "embedding.weight" if place["first"] else "head.weight"
    return name.replace("E", str(place["ep_rank"])) if expert else name


def _zeros(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


def _after_tp_and_tie(
    spec: dict[str, Any], entry: HeldSpec, grids: dict[int, Any], r: int
) -> torch.Tensor:
    """Rank r's gradient of ``entry`` once summed over tp (sequence parallelism, replicated
    weights) and over the embedding group (tied copies)."""
    name, shape, tp_rep, tied, expert, _ = entry

    def own(q: int) -> torch.Tensor:
        return gradient_value(q, _held_name(name, grids[q], expert), shape)

    def tp_summed(q: int) -> torch.Tensor:
        if spec["sp"] and tp_rep:
            return sum((own(t) for t in grids[q]["tp"]), _zeros(shape))
        return own(q)

    if tied:
        return sum((tp_summed(q) for q in grids[r]["embedding"]), _zeros(shape))
    return tp_summed(r)


def expected_finish(case: str, grids: dict[int, Any], rank: int) -> dict[str, torch.Tensor]:
    """The complete gradients rank ``rank`` must hold after finish_gradients, from the synthetic
    values of every rank (``grids``: rank -> its place: first stage, ep rank, group ranks)."""
    spec = FINISH_CASES[case]
    place = grids[rank]
    dp_cp = len(place["dp_cp"])
    out = {}
    for entry in spec["held"]:
        name, shape, _, _, expert, reduced = entry
        real = _held_name(name, place, expert)
        if expert:
            total = sum(
                (_after_tp_and_tie(spec, entry, grids, q) for q in place["edp"]), _zeros(shape)
            )
            out[real] = total / dp_cp
        elif reduced:
            out[real] = _after_tp_and_tie(spec, entry, grids, rank)
        else:
            total = sum(
                (_after_tp_and_tie(spec, entry, grids, q) for q in place["dp_cp"]), _zeros(shape)
            )
            out[real] = total / dp_cp
    return out


# ----------------------------------------------------------------------------- the world


def _part(results: dict[str, Any], key: str, work: Callable[[], Any]) -> None:
    """Run one part; a TODO not written yet, or an error every rank raises alike, is recorded
    for that part's test and the world goes on with the next part."""
    try:
        results[key] = work()
    except NotImplementedError as exc:  # every rank raises alike, before any message
        results[key] = {"todo": str(exc)}
    except Exception as exc:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} in {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)
            if "/tests/" not in f.filename and ".venv" not in f.filename
        ]
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "where": frames[-3:]}
    dist.barrier()


def _sequence_collectives() -> dict[str, Any]:
    lsp = lm_sequence_parallel()
    topology = Topology.build(tp=4)
    group, rank = topology.tp_group, topology.tp_rank
    whole = sp_input(rank, tokens=4 * SP_SHAPE[1])
    scattered = lsp.reduce_scatter_sequence(whole.clone(), group)
    return {
        "all_gather": lsp.all_gather_sequence(sp_input(rank).clone(), group),
        "reduce_scatter": scattered,
        "input_unchanged": bool(torch.equal(whole, sp_input(rank, tokens=4 * SP_SHAPE[1]))),
    }


def _regions() -> dict[str, Any]:
    lsp = lm_sequence_parallel()
    topology = Topology.build(tp=4)
    group, rank = topology.tp_group, topology.tp_rank
    out: dict[str, Any] = {}
    for sp in (True, False):
        x = sp_input(rank, tokens=SP_SHAPE[1] if sp else 4 * SP_SHAPE[1]).requires_grad_()
        entered = lsp.enter_tensor_parallel(x, group, sp)
        (entered * sp_weight(rank, entered.shape[1])).sum().backward()
        out[f"enter_{sp}"] = (entered.detach(), x.grad)
        y = sp_input(rank, tokens=4 * SP_SHAPE[1]).requires_grad_()
        left = lsp.leave_tensor_parallel(y, group, sp)
        (left * sp_weight(rank, left.shape[1])).sum().backward()
        out[f"leave_{sp}"] = (left.detach(), y.grad)
    return out


def _count_valid() -> dict[str, Any]:
    lm = lm_parallel()
    out = {}
    targets = count_targets()
    for label, degrees in (("dp2 x cp2", {"dp": 2, "cp": 2}), ("cp2 x tp2", {"cp": 2, "tp": 2})):
        topology = Topology.build(degrees.get("dp", 1), degrees.get("tp", 1), cp=degrees["cp"])
        mine = local_slice(targets, topology.dp_rank, topology.dp_size, topology.cp_rank, 2)
        out[label] = (
            lm.count_valid_tokens(mine.clone(), topology),
            int((mine != IGNORE_INDEX).sum()),
        )
    return out


def _balance() -> dict[str, Any]:
    lm = lm_parallel()
    probs, experts = routing()
    out = {}
    for label, degrees, sp in (
        ("dp2 x cp2", {"dp": 2, "cp": 2}, False),
        ("cp2 x tp2 with sequence parallelism", {"cp": 2, "tp": 2}, True),
        ("cp2 x tp2 without sequence parallelism", {"cp": 2, "tp": 2}, False),
    ):
        topology = Topology.build(degrees.get("dp", 1), degrees.get("tp", 1), cp=degrees["cp"])
        p = local_slice(probs, topology.dp_rank, topology.dp_size, topology.cp_rank, 2)
        e = local_slice(experts, topology.dp_rank, topology.dp_size, topology.cp_rank, 2)
        if sp:
            p = sp_share(p, topology.tp_rank, topology.tp_size)
            e = sp_share(e, topology.tp_rank, topology.tp_size)
        p = p.clone().requires_grad_()
        share = lm.balance_loss_share(p, e.clone(), EXPERTS, SEQ, BATCH, topology, sp)
        share.backward()
        out[label] = (float(share.detach()), p.grad)
    return out


def _finish() -> dict[str, Any]:
    lm = lm_parallel()
    out: dict[str, Any] = {}
    for case, spec in FINISH_CASES.items():
        d = spec["degrees"]
        topology = Topology.build(
            d.get("dp", 1), d.get("tp", 1), d.get("pp", 1), cp=d.get("cp", 1), ep=d.get("ep", 1)
        )
        held = held_for(case, topology)
        place = {
            "first": topology.is_first_stage,
            "ep_rank": topology.rank_in("ep"),
            **{g: topology.group_ranks(g) for g in ("tp", "dp_cp", "edp", "embedding")},
        }
        lm.finish_gradients(held, topology, spec["sp"])
        out[case] = (place, {h.name: h.grad for h in held})
        # again, with a hand-made all-reduce (the config's communication): which groups it saw
        seen: list[tuple[int, ...]] = []
        held = held_for(case, topology)
        lm.finish_gradients(held, topology, spec["sp"], recording_all_reduce(seen))
        out[case + HAND_MADE] = (place, {h.name: h.grad for h in held}, seen)
    return out


HAND_MADE = ", with a hand-made all-reduce"


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


def _global_norm() -> dict[str, Any]:
    clipping = load("phase3_multi_node", "grad_clipping")
    topology = Topology.build(1, 2, cp=2)  # cp2 x tp2
    place = {"tp": topology.tp_rank, "cp": topology.cp_rank}
    shards = [
        GradShard(name, norm_shard_value(topology.rank, name, shape, axes, place), axes)
        for name, shape, axes in NORM_SHARDS
    ]
    return {
        str(p): float(clipping.global_grad_norm(shards, p, topology)) for p in (2.0, float("inf"))
    }


def pieces_worker() -> dict[str, Any]:
    """Every part in turn, on this rank of a world of 4."""
    results: dict[str, Any] = {}
    _part(results, "sequence_collectives", _sequence_collectives)
    _part(results, "regions", _regions)
    _part(results, "count_valid_tokens", _count_valid)
    _part(results, "balance_loss_share", _balance)
    _part(results, "finish_gradients", _finish)
    _part(results, "global_norm", _global_norm)
    return results
