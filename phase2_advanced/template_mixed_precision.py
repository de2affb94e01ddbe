# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
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
with model-parallel shards (or ZeRO) each rank sees different gradients, so the ranks of the
scaler's ``group`` (the ranks that step together; the whole world by default) must agree on the
overflow before deciding.

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
        """Turn the optimizer's gradients into the true ones, in place, as GradScaler does; find
        whether any gradient on any rank of the group holds an inf or NaN."""
        if not self.enabled or self._unscaled:
            return
        grads = _grads(_optimizer_params(optimizer))
        # TODO 2.2: unscale every gradient in place; decide with the group whether any overflowed.
        # Invariant: afterwards the gradients equal GradScaler's unscaled ones bit for bit, and
        #   self._found_inf is the SAME bool on every rank of self.group: True if any gradient on
        #   any of its ranks holds an inf or NaN; a step() after this in the same iteration leaves
        #   the gradients alone. Every rank of the group takes part every iteration, gradients or
        #   none.
        # Hint 1: GradScaler does not divide each gradient by the scale. The flags of the group's
        #   ranks must end up equal: what one call makes a value the same on every rank?
        # More hints: uv run python -m tests.hint 2.2
        # See guidelines.md#22-mixed-precision
        raise NotImplementedError(
            "TODO 2.2: unscale every gradient in place; decide with the group whether any "
            "overflowed "
            "(see phase2_advanced/guidelines.md#22-mixed-precision)"
        )

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
        # Invariant: bitwise the same scale sequence as torch.amp.GradScaler on the same overflow
        #   pattern, for any growth and backoff factor (1.3 and 0.7 too); the iteration's flag and
        #   _unscaled are forgotten afterwards.
        # Hint 1: the guide's table "at update()" is the transition; the question is the arithmetic.
        #   S is a float32 tensor, and a factor is a Python float.
        # More hints: uv run python -m tests.hint 2.2
        # See guidelines.md#22-mixed-precision
        raise NotImplementedError(
            "TODO 2.2: the loss scale's state machine "
            "(see phase2_advanced/guidelines.md#22-mixed-precision)"
        )

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
    # TODO 2.2: one training step with autocast, loss scaling and optional clipping.
    # Invariant: with autocast_dtype the matrix products run in it and the loss in float32; the
    #   clipping limits the true (unscaled) gradients; an overflowing step changes neither the
    #   weights nor the optimizer state; the scaler updates once per step, a skipped step included.
    # Hint 1: the scaler is used as torch.amp.GradScaler is. What does the clipping need to see, and
    #   which of the scaler's methods gives it that?
    # More hints: uv run python -m tests.hint 2.2
    # See guidelines.md#22-mixed-precision
    raise NotImplementedError(
        "TODO 2.2: one training step with autocast, loss scaling and optional clipping "
        "(see phase2_advanced/guidelines.md#22-mixed-precision)"
    )


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
        """One optimizer step on the masters (through ``scaler`` if given), after a backward on
        the model; returns whether it stepped."""
        # TODO 2.2: one optimizer step on the fp32 masters, and the model refreshed from them.
        # Invariant: the masters stay fp32 and accumulate updates too small for the model's dtype; a
        #   parameter without a gradient is left alone; after a real step every model parameter
        #   equals its master cast to the model's dtype; after a skipped step nothing changes.
        # Hint 1: the optimizer only knows the masters. Where do their gradients come from, and who
        #   decides whether the optimizer steps at all?
        # More hints: uv run python -m tests.hint 2.2
        # See guidelines.md#22-mixed-precision
        raise NotImplementedError(
            "TODO 2.2: one optimizer step on the fp32 masters, and the model refreshed from them "
            "(see phase2_advanced/guidelines.md#22-mixed-precision)"
        )
