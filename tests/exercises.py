"""The course's exercises: id, title, where the learner writes it, and its guidelines section.

The scoreboard and the "next TODO" pointer read this table; tests refer to exercises by id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    phase: str  # the phase folder, e.g. "phase1_data_parallel"
    modules: tuple[str, ...]  # solution module names; the template is template_<name>.py
    anchor: str  # section of <phase>/guidelines.md

    @property
    def marker(self) -> str:
        """The pytest marker that selects this exercise: ``pytest -m ex1_2``."""
        return "ex" + self.id.replace(".", "_")


PHASE_TITLES = {
    "phase1_data_parallel": "Phase 1: data parallel on one node",
    "phase2_advanced": "Phase 2: advanced single node",
    "phase3_multi_node": "Phase 3: multi-node",
    "phase4_production": "Phase 4: production",
}

EXERCISES = [
    Exercise(
        "1.1",
        "distributed sampler",
        "phase1_data_parallel",
        ("data_loader",),
        "11-the-distributed-sampler",
    ),
    Exercise(
        "1.2",
        "broadcast, gradient averaging, DP step",
        "phase1_data_parallel",
        ("trainer",),
        "12-broadcast-and-gradient-averaging",
    ),
    Exercise(
        "1.3",
        "all-reduce from send/recv",
        "phase1_data_parallel",
        ("all_reduce",),
        "13-all-reduce-from-send-and-recv",
    ),
    Exercise(
        "1.4",
        "data-parallel trainer",
        "phase1_data_parallel",
        ("trainer",),
        "14-the-data-parallel-trainer",
    ),
    Exercise(
        "2.1",
        "gradient accumulation",
        "phase2_advanced",
        ("gradient_accumulation",),
        "21-gradient-accumulation",
    ),
    Exercise(
        "2.2",
        "mixed precision and loss scaling",
        "phase2_advanced",
        ("mixed_precision",),
        "22-mixed-precision",
    ),
    Exercise(
        "2.3",
        "activation checkpointing",
        "phase2_advanced",
        ("activation_checkpointing",),
        "23-activation-checkpointing",
    ),
    Exercise(
        "2.4",
        "naive model parallelism",
        "phase2_advanced",
        ("model_parallel",),
        "24-naive-model-parallelism",
    ),
    Exercise(
        "2.5",
        "pipeline parallelism",
        "phase2_advanced",
        ("pipeline_schedules", "pipeline_partition", "pipeline_comm", "pipeline_executor"),
        "25-pipeline-parallelism",
    ),
    Exercise(
        "2.6",
        "tensor parallelism",
        "phase2_advanced",
        ("tensor_parallel_ops", "tensor_parallel_layers", "tensor_parallel"),
        "26-tensor-parallelism",
    ),
    Exercise(
        "2.7",
        "context parallelism (ring attention)",
        "phase2_advanced",
        ("context_parallel_layout", "context_parallel"),
        "27-context-parallelism",
    ),
    # Phase 3 opens with the collectives every later piece uses (3.1-3.3; the alpha-beta cost
    # model belongs to 3.2, where the ring/tree trade-off appears); DDP from scratch, ZeRO, 3D
    # parallelism and the parameter server follow as 3.4, 3.5, 3.6, 3.7.
    Exercise(
        "3.1",
        "ring all-reduce",
        "phase3_multi_node",
        ("ring_allreduce",),
        "31-the-ring-all-reduce",
    ),
    Exercise(
        "3.2",
        "halving-doubling, alpha-beta model",
        "phase3_multi_node",
        ("tree_allreduce", "alpha_beta"),
        "32-halving-doubling-and-the-alpha-beta-model",
    ),
    Exercise(
        "3.3",
        "hierarchical all-reduce",
        "phase3_multi_node",
        ("hierarchical_allreduce",),
        "33-hierarchical-all-reduce",
    ),
    Exercise(
        "3.4",
        "DDP from scratch",
        "phase3_multi_node",
        ("ddp_buckets", "ddp"),
        "34-ddp-from-scratch",
    ),
    Exercise(
        "3.5",
        "ZeRO stages 1-3",
        "phase3_multi_node",
        ("zero_partition", "zero_units", "zero", "zero_fsdp_units", "zero_fsdp"),
        "35-zero-stages-1-3",
    ),
    Exercise(
        "3.6",
        "3D parallelism",
        "phase3_multi_node",
        ("parallel_3d", "grad_clipping"),
        "36-3d-parallelism",
    ),
    Exercise(
        "3.7",
        "parameter server",
        "phase3_multi_node",
        ("ps_sharding", "ps_protocol", "parameter_server"),
        "37-parameter-server",
    ),
    Exercise(
        "3.8",
        "expert parallelism (MoE all-to-all)",
        "phase3_multi_node",
        ("moe_routing", "expert_parallel"),
        "38-expert-parallelism",
    ),
    # Phase 4 (production): checkpoints, recovery under torchrun, elastic training, compression
    # hooks, monitoring. The capstone (the ImageNet trainer) is a program, not an exercise.
    Exercise(
        "4.1",
        "atomic, complete checkpoints",
        "phase4_production",
        ("checkpoint",),
        "41-atomic-complete-checkpoints",
    ),
    Exercise(
        "4.2",
        "automatic recovery",
        "phase4_production",
        ("fault_tolerance",),
        "42-automatic-recovery",
    ),
    Exercise(
        "4.3",
        "elastic training",
        "phase4_production",
        ("elastic",),
        "43-elastic-training",
    ),
    Exercise(
        "4.4",
        "gradient compression hooks",
        "phase4_production",
        ("compression", "compression_topk", "compression_powersgd"),
        "44-gradient-compression",
    ),
    Exercise(
        "4.5",
        "monitoring and stragglers",
        "phase4_production",
        ("monitoring",),
        "45-monitoring-and-profiling",
    ),
    # The pieces meet: one language model trained on every axis with the learner's own pieces.
    Exercise(
        "4.7",
        "a language model on every axis",
        "phase4_production",
        ("lm_parallel", "lm_sequence_parallel"),
        "47-the-pieces-meet-a-language-model-on-every-axis",
    ),
]

BY_ID = {exercise.id: exercise for exercise in EXERCISES}
