"""What only a GPU shows: each test here needs CUDA and is skipped on a machine without it.

They were written for failures that the CPU never showed and the first GPU run found (issue 28);
``bash .ci/gpu-batch`` runs them, with the rest of the suite, on a machine with one GPU. The
graders' own CUDA checks sit with their exercise (2.2's scaler on CUDA, in
tests/phase2/grade_2_2_mixed_precision.py).
"""

from __future__ import annotations

import pytest
import torch

from course.language_model import LMConfig, build_language_model, uneven_batch
from course.world import run_world

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA check: needs a GPU (bash .ci/gpu-batch)"
)
SMALL = LMConfig(width=32, heads=4, layers=2, ffn=64, seq_len=16)


@needs_cuda
def test_the_language_model_computes_on_cuda_as_on_the_cpu() -> None:
    """The rotary tables were once built from CPU frequencies and the GPU's positions."""
    model = build_language_model(SMALL, 0, torch.float64)
    tokens, targets = uneven_batch(0, SMALL, 4)
    want = model.loss(tokens, targets)[0]
    got = model.cuda().loss(tokens.cuda(), targets.cuda())[0]
    assert torch.allclose(got.cpu(), want, rtol=1e-10, atol=0), (float(got), float(want))


def one_rank_composition(steps: int) -> list[float]:
    from course.topology import Topology
    from phase4_production.lm_layout import ParallelSettings
    from solutions.phase4_production import lm_parallel

    model = lm_parallel.ParallelLanguageModel(
        build_language_model(SMALL, 0, torch.float64), Topology.build(1, 1, 1),
        ParallelSettings(max_norm=1.0, lr=1e-2),
    )  # fmt: skip
    assert model.device.type == "cuda", f"a one-rank world on a GPU machine computed on {model.device}"
    return [model.train_step(*uneven_batch(step, SMALL, 4)).loss for step in range(steps)]


@needs_cuda
def test_the_composition_at_one_rank_on_cuda_equals_one_process() -> None:
    got = run_world(one_rank_composition, 1, args=(3,))[0]
    model = build_language_model(SMALL, 0, torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)  # fmt: skip
    want = []
    for step in range(3):
        loss = model.loss(*uneven_batch(step, SMALL, 4))[0]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        want.append(float(loss))
    assert got == pytest.approx(want, rel=1e-9), (got, want)


def rng_round_trip() -> tuple[int, bool]:
    from phase4_production import rng_state

    torch.cuda.manual_seed(3)
    saved = rng_state.cuda_states()
    first = torch.rand(4, device="cuda")
    rng_state.set_cuda_states(saved)
    return len(saved), bool(torch.equal(first, torch.rand(4, device="cuda")))


@needs_cuda
def test_a_cuda_rank_keeps_its_cuda_random_state_in_checkpoints() -> None:
    """4.1's RNG state takes the GPUs' generators where the rank uses CUDA (and only there: a
    CPU rank forked from a parent that used CUDA must not touch it)."""
    count, replayed = run_world(rng_round_trip, 1)[0]
    assert count == torch.cuda.device_count() and replayed, (count, replayed)
