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
all-reduced (MAX) over the scaler's ``group`` (the ranks that step together; the whole world by
default) before deciding.

The demo (data-parallel training in fp32, bf16 or fp16) is demos/mixed_precision.py:

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.mixed_precision --precision fp16
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class DynamicLossScaler:
    """Scale the loss, unscale the gradients, skip steps that overflowed, adapt the scale.

    The same methods as ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``),
    used in the same order; putting them in that order is ``mixed_precision_step`` below.

    ``group`` is the process group whose ranks must agree on skipping a step (all ranks that
    hold a part of the same model); None is the whole world. Without a process group the
    scaler works on this process alone.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
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
        self.group = group
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
        # TODO 2.2: unscale every gradient in place and decide, with the group, if any overflowed.
        # Invariant: afterwards grads equal GradScaler's unscaled grads bit for bit, and
        #   self._found_inf is the SAME bool on every rank of self.group: True if any gradient
        #   on any of its ranks has an inf or NaN. Every rank calls the collective, every time.
        # Hint 1: GradScaler multiplies every gradient by ONE float32 number computed once from
        #   the scale (the guide's "arithmetic of S" says how it is rounded); dividing each
        #   gradient by the scale rounds differently. The ranks of the group agree on "some
        #   rank overflowed" through one collective on a 0/1 flag.
        # Hint 2: three parts: the inverse scale, computed once; a loop that multiplies each
        #   gradient in place and folds "this gradient has a non-finite value" into a 0/1 float
        #   flag; one all-reduce of the flag that keeps the largest value, on the scaler's
        #   group, even with no gradients (when a process group exists). Record the flag as a
        #   bool in self._found_inf and set self._unscaled.
        # Hint 3: the inverse is the scale in float64, its reciprocal, rounded to float32
        #   once; each gradient is multiplied by it in place (mul_); "not torch.isfinite,
        #   anywhere in the gradient" is the overflow test; the flag is all-reduced with
        #   ReduceOp.MAX on the scaler's group whenever dist.is_initialized() says so.
        # See guidelines.md#22-mixed-precision
        # >>> solution
        device = grads[0].device if grads else torch.device("cpu")
        inv_scale = self._scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            grad.mul_(inv_scale.to(grad.device))
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float().to(device))
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
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
        # Invariant: bitwise the same scale sequence as torch.amp.GradScaler on the same
        #   overflow pattern, for any growth and backoff factor (1.3 and 0.7 too).
        # Hint 1: the guide's table "at update()" is the whole machine: an overflow backs off,
        #   growth_interval clean steps in a row grow. The trap is the rounding: GradScaler's
        #   kernel multiplies the float32 scale by the factor in float64 and rounds once.
        # Hint 2: overflow: back off and restart the clean-step count. No overflow: count one
        #   more clean step; at growth_interval grow (only if the grown scale is finite in
        #   float32) and restart the count. Compute each product in float64 and store it in the
        #   float32 scale tensor. Then clear the per-iteration state (found_inf back to None,
        #   not unscaled).
        # Hint 3: new scale = float(scale) × factor, a product of Python floats (float64),
        #   written into the float32 scale tensor in place (fill_ or copy_: one rounding). For
        #   growth, first make the product a float32 tensor and keep it only if torch.isfinite
        #   says it is finite.
        # See guidelines.md#22-mixed-precision
        # >>> solution
        # aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp: float scale * double factor,
        # assigned back to the float scale (one rounding)
        if self._found_inf:
            self._scale.fill_(float(self._scale) * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = torch.tensor(float(self._scale) * self.growth_factor, dtype=torch.float32)
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
    """One mixed-precision training step with loss scaling and optional gradient clipping.

    Returns (loss, whether the optimizer stepped). ``autocast_dtype=None`` runs in fp32.
    """
    # TODO 2.2: put the pieces together in the right order.
    # Invariant: clipping sees the true gradients (unscaled), an overflowing step changes
    #   neither the weights nor the optimizer state, and the scaler updates once per step.
    # Hint 1: the scaler is used as torch.amp.GradScaler is. Autocast covers the forward and
    #   the loss only (backward runs outside it); clipping needs the true gradients.
    # Hint 2: the order is: clear the gradients; forward and loss under autocast; backward of
    #   the scaled loss; unscale; clip (only when max_grad_norm is given); the scaler's step;
    #   the scaler's update, every iteration, also after a skipped step. Return the loss as a
    #   float and what the scaler's step returned.
    # Hint 3: torch.autocast takes the device type of the inputs, autocast_dtype, and
    #   enabled set to whether autocast_dtype was given; clipping is nn.utils.clip_grad_norm_
    #   over the model's parameters with max_grad_norm; the scaler's scale() wraps the loss
    #   before backward.
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
        # Hint 1: the optimizer only knows the masters: their gradients come from the model's,
        #   in fp32 (a missing gradient stays missing); a scaler decides whether the optimizer
        #   steps at all.
        # Hint 2: three pieces of work: each master's grad from its model parameter's grad;
        #   one step of the masters' optimizer, through the scaler when there is one (its step
        #   says whether it stepped); and only if it stepped, each model parameter overwritten
        #   in place from its master, without recording autograd.
        # Hint 3: a master's grad is its parameter's grad, detached and cast to float32 (or
        #   None when that is None); the scaler's step takes the masters' optimizer; the copy
        #   back is an in-place copy_ of each master into its parameter under torch.no_grad.
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
