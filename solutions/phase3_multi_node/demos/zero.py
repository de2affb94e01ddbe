"""Demo of exercise 3.5: train an MLP under ZeRO stage 1, 2 or 3 and compare bytes with the paper.

Trains ``MLP`` on the built-in pattern dataset with ``zero_wrap(model, AdamW, stage)``, each rank on
its part of every global batch, then prints, per rank, the bytes of parameters, gradients and
optimizer state it holds against the ZeRO paper's formulas (fp32: 4Ψ, 4Ψ, 8Ψ sharded by stage),
and the bytes handed to collectives in one step against 2Ψ (stages 1-2) or 3Ψ (stage 3).
``--impl templates`` runs your own ``phase3_multi_node/template_zero*.py``.

``--fsdp`` trains with the FSDP-style ZeRO-3 of 3.5 instead (``fsdp_wrap``: every Linear a unit,
``--policy`` its mixed precision, ``--prefetch`` its window) and prints the bytes of one step per
dtype against 2Ψ·b_param + Ψ·b_reduce, and the bytes held against 16Ψ/N.

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.zero \
        --stage 2
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.zero \
        --stage 3 --impl templates
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.zero \
        --fsdp --policy bf16-fp32 --prefetch 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.datasets import make_pattern_dataset
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.models import MLP
from course.rank_logging import log0
from course.seeding import seed_everything
from phase3_multi_node.zero_fsdp_support import POLICIES
from solutions.phase3_multi_node.references import zero_accounting as acc

PHASE = "phase3_multi_node"


@dataclass
class ZeroDemoConfig:
    """Flags of the demo; every rank must be given the same values."""

    stage: int = field(default=2, metadata={"choices": [1, 2, 3], "help": "ZeRO stage"})
    steps: int = field(
        default=20, metadata={"ge": 1, "le": 10000, "fix": "1 to 10000 steps, e.g. 20"}
    )
    global_batch_size: int = field(
        default=64,
        metadata={
            "help": "samples per step, all ranks",
            "ge": 1,
            "le": 1 << 16,
            "fix": "a multiple of the world size, e.g. 64",
        },
    )
    hidden: int = field(
        default=128, metadata={"ge": 1, "le": 8192, "fix": "a width from 1 to 8192, e.g. 128"}
    )
    lr: float = field(
        default=1e-3,
        metadata={"gt": 0, "le": 10, "fix": "a positive learning rate up to 10, e.g. 1e-3"},
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "FSDP-style ZeRO-3 (fsdp_wrap) instead of zero_wrap (--stage unused)"},
    )
    policy: str = field(
        default="bf16-fp32",
        metadata={"choices": list(POLICIES), "help": "mixed precision of --fsdp"},
    )
    prefetch: int = field(
        default=1,
        metadata={"ge": 0, "le": 64, "help": "units gathered ahead (--fsdp)",
                  "fix": "0 (none) to 64 units, e.g. 1"},
    )  # fmt: skip
    impl: str = field(
        default="solutions",
        metadata={
            "choices": IMPLS,
            "help": "run the reference or your phase3_multi_node templates",
        },
    )


def validate(config: ZeroDemoConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = []
    for name in ("steps", "hidden"):
        if getattr(config, name) < 1:
            problems.append(f"--{name} {getattr(config, name)} must be >= 1")
    if config.global_batch_size < world_size or config.global_batch_size % world_size:
        problems.append(
            f"--global-batch-size {config.global_batch_size} must be a positive multiple of the "
            f"world size {world_size}"
        )
    defaults = ZeroDemoConfig()
    if not config.fsdp and (config.policy, config.prefetch) != (defaults.policy, defaults.prefetch):
        problems.append("--policy and --prefetch choose the FSDP-style wrapper: add --fsdp")
    if problems:
        raise ValueError("; ".join(problems))


def format_bytes_table(
    rows: list[tuple[int, acc.ModelStateBytes]], want: acc.ModelStateBytes
) -> str:
    lines = [
        "| rank | params | grads | optimizer | total | formula total | equal |",
        "|---" * 7 + "|",
    ]
    for rank, got in rows:
        lines.append(
            f"| {rank} | {got.params} | {got.grads} | {got.optimizer} | {got.total} | "
            f"{want.total} | {'yes' if got == want else 'NO'} |"
        )
    return "\n".join(lines)


def run_fsdp(config: ZeroDemoConfig, rank: int, world: int) -> None:
    """``--fsdp``: train under ``fsdp_wrap`` and print the bytes against the formulas."""
    fsdp = load_impl(PHASE, "zero_fsdp", config.impl)
    data = make_pattern_dataset(config.steps * config.global_batch_size)
    model = MLP(16 * 16, hidden=config.hidden)
    units = [m for m in model.modules() if isinstance(m, nn.Linear)]
    policy = POLICIES[config.policy]
    model, optimizer = fsdp.fsdp_wrap(
        model, units, lambda ps: torch.optim.AdamW(ps, lr=config.lr), policy, config.prefetch
    )
    psi = sum(unit.layout.padded_numel for unit in optimizer.units)
    log0(
        f"FSDP-style ZeRO-3 ({config.impl}) on {world} ranks: {len(units)} units, Ψ = {psi} "
        f"padded, {policy.describe()}, prefetch {config.prefetch}"
    )
    per_rank = config.global_batch_size // world
    comm: dict[str, dict[str, int]] = {}
    for step in range(config.steps):
        start = step * config.global_batch_size + rank * per_rank
        x, y = (data.tensors[i][start : start + per_rank] for i in (0, 1))
        with acc.DtypeCounter() as counter:
            loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
        if step == 0:
            comm, held = counter.by_op or {}, acc.held_bytes(model, optimizer)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if step % 5 == 0 or step == config.steps - 1:
            log0(f"step {step:3d}  loss {mean.item() / world:.4f}")
    want = acc.fsdp_formula_volume(
        psi, policy.compute_dtype(torch.float32), policy.reduction_dtype(torch.float32)
    )
    log0(f"\nbytes of one step per op and dtype (rank {rank}): {comm}")
    log0(f"formula 2Ψ·b_param + Ψ·b_reduce:              {want}  equal: {comm == want}")
    formula = acc.formula_bytes(3, psi, world)
    log0(f"bytes held after a step: {held}; formula 16Ψ/N: {formula}  equal: {held == formula}")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ZeroDemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    if config.fsdp:
        with distributed_session() as info:
            seed_everything(0)
            run_fsdp(config, info.rank, info.world_size)
        return 0
    zero = load_impl(PHASE, "zero", config.impl)
    with distributed_session() as info:
        seed_everything(0)
        rank, world = info.rank, info.world_size
        data = make_pattern_dataset(config.steps * config.global_batch_size)
        model = MLP(16 * 16, hidden=config.hidden)
        psi_unpadded = sum(p.numel() for p in model.parameters())
        model, optimizer = zero.zero_wrap(
            model, lambda ps: torch.optim.AdamW(ps, lr=config.lr), config.stage
        )
        psi = acc.padded_psi(model, world)
        per_rank = config.global_batch_size // world
        log0(
            f"ZeRO stage {config.stage} ({config.impl}) on {world} ranks: Ψ = {psi_unpadded} "
            f"parameters, {psi} with padding to multiples of {world} per layer"
        )
        volume = 0
        for step in range(config.steps):
            start = step * config.global_batch_size + rank * per_rank
            x, y = (
                data.tensors[0][start : start + per_rank],
                data.tensors[1][start : start + per_rank],
            )
            with CommCounter() as comm:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
            if step == 0:
                volume = acc.collective_volume(comm.records, world)
                held = acc.held_bytes(model, optimizer)
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if step % 5 == 0 or step == config.steps - 1:
                log0(f"step {step:3d}  loss {mean.item() / world:.4f}")
        everyone: list[acc.ModelStateBytes | None] = [None] * world
        dist.all_gather_object(everyone, held)
        want = acc.formula_bytes(config.stage, psi, world)
        log0("\nbytes held per rank after a step (distinct tensor storages):")
        log0(format_bytes_table([(r, b) for r, b in enumerate(everyone) if b], want))
        log0(
            f"formula: params {want.params}, grads {want.grads}, optimizer {want.optimizer} "
            f"(unsharded data parallel: {acc.formula_bytes(0, psi_unpadded, world).total})"
        )
        log0(
            f"communication per step: {volume} bytes of full buffers handed to collectives, "
            f"formula {acc.formula_volume(config.stage, psi)} ({3 if config.stage == 3 else 2}Ψ x "
            f"4 bytes); a ring rank sends {acc.bus_bytes(volume, world):.0f} of them (bus bytes)"
        )
    return 0


if __name__ == "__main__":
    run_main(main)
