"""Exercise 4.7's programs (reference checks): the real-text trainer and its two-layout record.

* ``lm.trainer``'s settings are refused before any process starts, each by name (a layout for
  another world size says which ``--nproc_per_node`` it needs);
* the same tiny run on real text at two layouts (tp2 with sequence parallelism, and pp2 1F1B)
  gives the same loss at every step and the same held-out bits per byte, to float32 precision
  (the sums run in other orders: not bitwise), and a model assembled from the ranks' pieces
  samples text;
* the trainer's defaults and the recorded run's layouts are accepted as they are.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from grading import exercise, world

TINY = {
    "width": 16, "heads": 4, "layers": 2, "ffn": 32, "seq_len": 16, "batch": 4, "epochs": 1,
    "steps_per_epoch": 3, "eval_batches": 1, "sample_bytes": 8, "microbatches": 2,
}  # fmt: skip


def trainer() -> object:
    from solutions.phase4_production.lm import trainer as lm_trainer

    return lm_trainer


@pytest.mark.reference
@exercise("4.7")
@pytest.mark.parametrize(
    ("flags", "world_size", "message"),
    [
        ({"dp": 2, "tp": 2}, 1, "dp2 x tp2 = 4 ranks, but the world has 1: run torchrun with --nproc_per_node=4"),
        ({"tp": 3}, 3, "tp=3 does not divide heads=4"),
        ({"cp": 2}, 2, "seq_len=130 does not cut into 2 x cp = 4 equal chunks"),
        ({"dp": 2, "ep": 2}, 2, "ep=2 with no MoE layer"),
        ({"moe_layers": "one"}, 1, "--moe-layers 'one': layer numbers separated by commas"),
        ({"tp": 3, "dp": -1}, 4, "cp x tp x pp = 3 does not divide the world of 4 ranks"),
    ],
)  # fmt: skip
def test_the_trainer_refuses_bad_settings_before_launch(
    flags: dict[str, object], world_size: int, message: str
) -> None:
    lm_trainer = trainer()
    config = replace(lm_trainer.TrainConfig(seq_len=130 if "cp" in flags else 128), **flags)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=message):
        lm_trainer.validate(config, world_size)  # type: ignore[attr-defined]


@pytest.mark.reference
@exercise("4.7")
def test_the_defaults_and_the_recorded_layouts_are_accepted() -> None:
    from solutions.phase4_production.lm import record as lm_record

    lm_trainer = trainer()
    lm_trainer.validate(lm_trainer.TrainConfig(dp=2, tp=2, pp=2), 8)  # type: ignore[attr-defined]
    config = lm_record.RecordConfig()
    lm_record.check(config)


def _train(config: object) -> object:
    import torch.distributed as dist

    from course.topology import Topology

    lm_trainer = trainer()
    settings = config.settings(dist.get_world_size())  # type: ignore[attr-defined]
    topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp)
    return lm_trainer.train(config, topology)  # type: ignore[attr-defined]


@pytest.mark.reference
@exercise("4.7")
def test_two_layouts_give_the_same_curve_on_real_text_to_float32_precision() -> None:
    lm_trainer = trainer()
    base = lm_trainer.TrainConfig(**TINY)  # type: ignore[attr-defined]
    histories = [
        world(_train, 2, replace(base, tp=2, sequence_parallel=True, dp=1))[0],
        world(_train, 2, replace(base, pp=2, dp=1))[0],
    ]
    a, b = histories
    assert len(a.step_losses) == len(b.step_losses) == TINY["steps_per_epoch"]
    for step, (x, y) in enumerate(zip(a.step_losses, b.step_losses, strict=True)):
        assert math.isfinite(x) and abs(x - y) <= 1e-5 * abs(y), (
            f"step {step}: tp2+sp's loss {x} and pp2's {y} differ by more than float32's "
            "precision: the two layouts do not compute the same function"
        )
    bpb_a, bpb_b = a.epochs[0]["bits_per_byte"], b.epochs[0]["bits_per_byte"]
    assert 0 < bpb_a < 16 and abs(bpb_a - bpb_b) <= 1e-5 * bpb_b, (bpb_a, bpb_b)
    assert len(a.sample.encode("utf-8", errors="replace")) >= TINY["sample_bytes"]
