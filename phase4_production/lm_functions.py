"""Given for exercise 4.7: the functions of every exercise that the composition calls.

Not an exercise. The runtime (``lm_runtime.py``) and the blocks (``lm_blocks.py``) are given
code, and given code never imports an answer: they call the functions named here, which the
exercise module (``template_lm_parallel.py``) fills with its own imports: your 2.5 executor and
schedules, 2.6 layers, 2.7 ring attention and layout, 3.1 and 3.2 all-reduces, 3.5 ZeRO and
FSDP-style wrappers, 3.6 clipping, 3.8 MoE layer, and this exercise's own functions. With
``--impl solutions`` the same record holds the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (phase, module) of every exercise module the composition runs, earliest first: what must be
# written before a learner's composition can train (tests and tests.bench ask each in turn)
COMPOSITION_MODULES: tuple[tuple[str, str], ...] = (
    *(
        ("phase2_advanced", m)
        for m in ("activation_checkpointing", "pipeline_schedules", "pipeline_comm",
                  "pipeline_executor", "tensor_parallel_ops", "tensor_parallel_layers",
                  "context_parallel_layout", "context_parallel")
    ),
    *(
        ("phase3_multi_node", m)
        for m in ("ring_allreduce", "tree_allreduce", "zero_partition", "zero_units", "zero",
                  "zero_fsdp_units", "zero_fsdp",
                  "grad_clipping", "moe_routing", "expert_parallel")
    ),
    ("phase4_production", "lm_parallel"),
    ("phase4_production", "lm_sequence_parallel"),
)  # fmt: skip


@dataclass(frozen=True)
class CompositionFunctions:
    """Everything the composition runs that a learner writes somewhere in the course."""

    # exercise 4.7
    enter_tensor_parallel: Callable[..., Any]
    leave_tensor_parallel: Callable[..., Any]
    token_positions: Callable[..., Any]
    count_valid_tokens: Callable[..., Any]
    loss_share: Callable[..., Any]
    balance_loss_share: Callable[..., Any]
    finish_gradients: Callable[..., Any]
    gradient_placements: Callable[..., Any]
    # earlier exercises
    column_parallel: Any  # 2.6 ColumnParallelLinear
    row_parallel: Any  # 2.6 RowParallelLinear
    ring_attention: Callable[..., Any]  # 2.7
    shard_sequence: Callable[..., Any]  # 2.7
    executor: Any  # 2.5 PipelineExecutor
    make_schedule: Callable[..., Any]  # 2.5
    placement_of: Callable[..., Any]  # 2.5
    zero_wrap: Callable[..., Any]  # 3.5
    full_state_dict: Callable[..., Any]  # 3.5
    fsdp_wrap: Callable[..., Any]  # 3.5
    clip_grad_norm: Callable[..., Any]  # 3.6
    moe_layer: Any  # 3.8 MoELayer
    checkpoint: Callable[..., Any]  # 2.3, for activation_checkpointing
    # the hand-made all-reduces the settings' ``communication`` may choose
    ring_all_reduce: Callable[..., Any]  # 3.1
    halving_doubling_all_reduce: Callable[..., Any]  # 3.2
