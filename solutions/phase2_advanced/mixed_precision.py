"""Exercise 2.2: mixed precision: autocast, a dynamic loss scaler, fp32 master weights.

Low precision halves activation memory and speeds up matrix units, but fp16 has a narrow range:
small gradients underflow to zero. The recipe of Micikevicius et al., "Mixed Precision Training"
(ICLR 2018), which ``torch.amp`` implements:

* **autocast** runs matmuls/convolutions in fp16/bf16 and keeps reductions and losses in fp32;
* **loss scaling** multiplies the loss by S before backward so gradients are S times larger and
  stay representable, then divides the gradients by S before the optimizer sees them. S is
  *dynamic*: when a gradient overflows (inf/NaN) the step is skipped and S backs off; after
  ``growth_interval`` clean steps S grows. Same state machine as ``torch.amp.GradScaler``
  (torch/amp/grad_scaler.py and the ``_amp_update_scale_`` kernel);
* **master weights**: the optimizer updates an fp32 copy; the low-precision model is a cast of it,
  so updates smaller than the low-precision spacing are not lost.

bf16 has fp32's exponent range, so it needs no loss scaling; fp16 does. Every rank must make
the same skip decision: with data parallelism averaging spreads an inf to every rank anyway, but
with model-parallel shards (or ZeRO) each rank sees different gradients, so the overflow flag is
all-reduced (MAX) across ranks before deciding.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.mixed_precision --precision bf16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from solutions.common.distributed import distributed_session
from solutions.common.models import BabyCNN
from solutions.common.rank_logging import log0
from solutions.common.seeding import seed_everything
from solutions.common.training import LoopConfig, global_batch_error, train_data_parallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class DynamicLossScaler:
    """Scale the loss, unscale the gradients, skip steps that overflowed, adapt the scale.

    Use it like ``torch.amp.GradScaler``::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)      # optional: needed before clipping
        clip_grad_norm_(...)
        scaler.step(optimizer)          # skipped if any rank saw inf/NaN
        scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor={growth_factor}: it must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor}: it must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval}: it must be >= 1")
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        # float32 like GradScaler, so the two produce the same numbers
        self._scale = torch.tensor(init_scale, dtype=torch.float32)
        self._growth_tracker = 0
        self._found_inf: bool | None = None  # set by unscale_, consumed by update()
        self._unscaled = False

    def get_scale(self) -> float:
        return float(self._scale) if self.enabled else 1.0

    @property
    def found_inf(self) -> bool:
        """Whether this step's gradients overflowed on any rank (after ``unscale_``)."""
        return bool(self._found_inf)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: backward of it yields gradients ``scale`` times too large."""
        if not self.enabled:
            return loss
        return loss * self._scale.to(loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place; detect inf/NaN on any rank."""
        if not self.enabled or self._unscaled:
            return
        grads = _grads(_optimizer_params(optimizer))
        # TODO 2.2: unscale every gradient in place and decide, with all ranks, if any overflowed.
        # Invariant: afterwards grads hold their true (unscaled) values, and self._found_inf is
        #   the SAME bool on every rank: True if any gradient on any rank has an inf or NaN.
        # Hint 1: multiply by the reciprocal computed in float64 then cast to float32 (what
        #   GradScaler does, so results match bit for bit); torch.isfinite tells overflow; an
        #   all-reduce with MAX of a 0/1 flag makes all ranks agree (when dist.is_initialized()).
        # Hint 2: inv = self._scale.double().reciprocal().float(); flag = torch.zeros((),
        #   device=...); for g in grads: g.mul_(inv.to(g.device)); flag = max(flag,
        #   (~torch.isfinite(g)).any()); dist.all_reduce(flag, op=MAX); self._found_inf =
        #   bool(flag); self._unscaled = True.
        # See guidelines.md#22-mixed-precision
        # >>> solution
        device = grads[0].device if grads else torch.device("cpu")
        inv_scale = self._scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            grad.mul_(inv_scale.to(grad.device))
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float().to(device))
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._found_inf = bool(found.item())
        self._unscaled = True
        # <<< solution

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet, then step unless an overflow was found; True if it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps in a row."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() without unscale_()/step() this iteration")
        # TODO 2.2: the loss scale's state machine.
        # Invariant: same scale sequence as torch.amp.GradScaler on the same overflow pattern.
        # Hint 1: overflow: scale *= backoff_factor and the clean-step count restarts at 0.
        #   No overflow: count one more clean step; at growth_interval, scale *= growth_factor
        #   (only if the result is finite) and the count restarts at 0.
        # Hint 2: work on self._scale in place (self._scale.mul_(...)) and self._growth_tracker;
        #   finally clear the per-iteration state: self._found_inf = None; self._unscaled = False.
        # See guidelines.md#22-mixed-precision
        # >>> solution
        if self._found_inf:
            self._scale.mul_(self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = self._scale * self.growth_factor
                if torch.isfinite(grown):
                    self._scale.copy_(grown)
                self._growth_tracker = 0
        self._found_inf = None
        self._unscaled = False
        # <<< solution

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.get_scale(), "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])


def mixed_precision_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    scaler: DynamicLossScaler,
    autocast_dtype: torch.dtype | None,
    max_grad_norm: float | None = None,
) -> tuple[float, bool]:
    """One step: forward under autocast, scaled backward, unscale, clip, step, update.

    Returns (loss, whether the optimizer stepped). ``autocast_dtype=None`` runs in fp32.
    """
    # TODO 2.2: put the pieces together in the right order.
    # Invariant: clipping sees the true gradients (unscaled), an overflowing step changes
    #   neither the weights nor the optimizer state, and the scaler updates once per step.
    # Hint 1: torch.autocast(device_type=inputs.device.type, dtype=..., enabled=...) around
    #   the forward and loss only (backward runs outside it); clip between unscale_ and step.
    # Hint 2: zero_grad; with autocast: loss = loss_fn(model(inputs), targets);
    #   scaler.scale(loss).backward(); scaler.unscale_(optimizer); if max_grad_norm:
    #   nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm); stepped =
    #   scaler.step(optimizer); scaler.update(); return loss.item(), stepped.
    # See guidelines.md#22-mixed-precision
    # >>> solution
    optimizer.zero_grad(set_to_none=True)
    enabled = autocast_dtype is not None
    with torch.autocast(device_type=inputs.device.type, dtype=autocast_dtype, enabled=enabled):
        loss = loss_fn(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    stepped = scaler.step(optimizer)
    scaler.update()
    return loss.item(), stepped
    # <<< solution


class MasterWeights:
    """fp32 master copies of a low-precision model's trainable parameters.

    The optimizer steps the fp32 masters; the model's bf16/fp16 parameters are refreshed from
    them after every step. Per step: backward on the model, then ``step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.optimizer = make_optimizer(self.master_params)

    def zero_grad(self) -> None:
        for param in self.model_params + self.master_params:
            param.grad = None

    def step(self, scaler: DynamicLossScaler | None = None) -> bool:
        """Move gradients to the masters, step them (through ``scaler`` if given), copy back."""
        # TODO 2.2: gradients model -> fp32 masters, optimizer step on masters, weights back.
        # Invariant: masters stay fp32 and accumulate updates too small for the model's dtype;
        #   after a real step every model parameter equals its master cast to the model dtype;
        #   after a skipped step nothing changes.
        # Hint 1: a master's grad is the model grad cast to float32 (None stays None); with a
        #   scaler, scaler.step(self.optimizer) unscales the masters' grads and may skip.
        # Hint 2: for p, m in zip(model_params, master_params): m.grad = None if p.grad is None
        #   else p.grad.float(); stepped = scaler.step(opt) if scaler else (opt.step(), True)[1];
        #   if stepped: with torch.no_grad(): p.copy_(m) for each pair. Return stepped.
        # See guidelines.md#22-mixed-precision
        # >>> solution
        for param, master in zip(self.model_params, self.master_params, strict=True):
            master.grad = None if param.grad is None else param.grad.detach().float()
        if scaler is not None:
            stepped = scaler.step(self.optimizer)
        else:
            self.optimizer.step()
            stepped = True
        if stepped:
            with torch.no_grad():
                for param, master in zip(self.model_params, self.master_params, strict=True):
                    param.copy_(master)
        return stepped
        # <<< solution


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="data-parallel mixed-precision training")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--train-samples", type=int, default=4096)
    args = parser.parse_args(argv)
    if (error := global_batch_error(args.global_batch_size)) is not None:
        return error
    with distributed_session() as info:
        seed_everything(0)
        dtype = PRECISIONS[args.precision]
        # fp16 needs loss scaling; bf16 has fp32's range and does not
        scaler = DynamicLossScaler(growth_interval=50, enabled=dtype is torch.float16)
        skipped = 0

        def step(
            model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            nonlocal skipped
            loss, stepped = mixed_precision_step(
                model,
                optimizer,
                nn.functional.cross_entropy,
                x,
                y,
                scaler,
                dtype,
                args.max_grad_norm,
            )
            skipped += not stepped
            return loss

        log0(
            f"mixed precision: {args.precision} autocast on {info.device.type}, loss scaling "
            f"{'on' if scaler.enabled else 'off'}, world {info.world_size}"
        )
        config = LoopConfig(
            epochs=args.epochs,
            global_batch_size=args.global_batch_size,
            train_samples=args.train_samples,
        )
        train_data_parallel(BabyCNN(), step, config, info)
        log0(f"final loss scale {scaler.get_scale():g}, skipped steps {skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
