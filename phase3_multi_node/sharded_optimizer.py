"""The shell of an optimizer that steps only this rank's shards (given; 3.5, ZeRO and FSDP-style).

Both of 3.5's wrappers hand the training loop an object that looks like a torch optimizer but
wraps ``inner``, a torch optimizer built on this rank's *shards* only, so its ``state`` holds 1/N
of the model's elements (Rajbhandari et al., "ZeRO", SC 2020, Section 5; FSDP2 builds the user's
optimizer on its ``DTensor`` shards the same way). What the two share lives here: ``state`` and
``param_groups`` are the inner optimizer's, and ``pending`` counts, per unit, the gradients seen
in the current backward, so that a step after a backward that reached only some of a unit's
parameters is refused instead of reducing a half-filled buffer. What differs (which collectives
a step runs, how gradients are zeroed) is each wrapper's own ``step`` and ``zero_grad``.
"""

from __future__ import annotations

from typing import Any

import torch


class ShardedOptimizer:
    """``inner`` steps this rank's shards; ``units`` are the wrapper's units in forward order."""

    def __init__(self, inner: torch.optim.Optimizer, units: list[Any]) -> None:
        self.inner, self.units = inner, units
        self.pending: dict[int, int] = {}  # unit index -> gradients seen in this backward

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def refuse_partial_backward(self, why: str) -> None:
        """Raise ``RuntimeError`` when the last backward gave gradients to only some of a unit's
        parameters; ``why`` says what the wrapper needs instead."""
        partial = [i for i, seen in self.pending.items() if seen]
        if partial:
            raise RuntimeError(
                f"units {partial} received gradients for only some of their parameters in the "
                f"last backward: {why}"
            )
