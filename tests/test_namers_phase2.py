"""Phase 2's namers beyond their mistake tables (tests/phase2/mistakes_ex2_*.py, issue 49).

The tables check each namer against planted mistakes and their neighbours; these tests check
what the tables take on trust: that 2.2's simulated right scaler is GradScaler itself, that
2.6's placement namer names a placement exactly when no other placement measures alike, and
that a shard of the wrong shape is reported at the learner's function with both shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "phase2"))

from mistake_tables import load_table_module, same_measurement
from tp_learner_calls import raised_at_learner, shard_shape_problem
from tp_namers import BLOCK, COLUMN_LAYER, ROW_LAYER, counts_of, output_right, placement_verdict


def test_the_simulated_right_scaler_is_grad_scalers_own_stream() -> None:
    table = load_table_module("2.2")
    assert table is not None
    assert same_measurement(table.streams("right"), table.grad_scaler_streams(), tol=0.0)


@pytest.mark.parametrize("shape", [BLOCK, ROW_LAYER, COLUMN_LAYER], ids=["block", "row", "column"])
def test_a_placement_is_named_only_when_no_other_measures_alike(shape: tuple) -> None:
    entries, exits, right = shape
    measured = {
        (e, x): (counts_of(e, x), output_right(e, x, right[1])) for e in entries for x in exits
    }
    for placement, (counts, is_right) in measured.items():
        said = placement_verdict(counts, is_right, shape)
        if placement == right:
            assert said is None
            continue
        assert said is not None
        alike = [p for p, m in measured.items() if m == (counts, is_right) and p != right]
        if counts == counts_of(*right):
            assert "this is" not in said, said
        else:
            assert ("this is" in said) == (len(alike) == 1), (placement, said)


def _column_cut_along_the_input(
    weight: torch.Tensor, rank: int, n: int, fused_parts: int = 1
) -> torch.Tensor:
    width = weight.shape[1] // n
    return weight[:, rank * width : (rank + 1) * width]


def test_a_shard_of_the_wrong_shape_is_reported_with_both_shapes_at_the_learners_function() -> None:
    layers = SimpleNamespace(column_shard=_column_cut_along_the_input)
    said = shard_shape_problem(layers, "column", torch.zeros(12, 8), 0, 2)
    assert said is not None
    assert "returned shape [12, 4]; expected [6, 8]" in said
    assert "test_namers_phase2.py:" in said and "_column_cut_along_the_input" in said
    right = SimpleNamespace(column_shard=lambda w, r, n, fused_parts=1: w[r * 6 : (r + 1) * 6])
    assert shard_shape_problem(right, "column", torch.zeros(12, 8), 0, 2) is None


def test_an_error_with_no_learners_frame_is_raised_as_it_was() -> None:
    def given() -> None:
        torch.zeros(2, 3).copy_(torch.zeros(3, 2))

    with pytest.raises(RuntimeError):
        raised_at_learner(given, "given code")


def test_the_checkpointing_tables_cut_the_segments_where_the_grader_does() -> None:
    """2.3's gradient table places each Linear in a segment by torch's cut, written anew; the
    grader's namer reads segment_bounds: both must agree on every graded segment count."""
    from grade_2_3_checkpointing import GRADIENT_SEGMENTS, segment_bounds

    table = load_table_module("2.3")
    assert table is not None
    for segments in GRADIENT_SEGMENTS:
        bounds = segment_bounds(table.LAYERS, segments)
        size = table.LAYERS // segments
        for layer in range(table.LAYERS):
            held = next(i for i, (a, b) in enumerate(bounds) if a <= layer <= b)
            assert held == min(layer // size, segments - 1), (segments, layer)


def test_an_untouched_expanded_gradient_is_not_called_written_into() -> None:
    """2.6's in-place verdict compares values only: a stride-0 grad_output (what
    loss.sum().backward() hands f) left alone says nothing; the sum written into it is named."""
    from grade_2_6_tensor_parallel import grad_output_verdict

    expanded = torch.ones((), dtype=torch.float64).expand(3, 4)
    assert grad_output_verdict(expanded, expanded.clone(), 2 * expanded) is None
    said = grad_output_verdict(2 * expanded, expanded.clone(), 2 * expanded)
    assert said is not None and "an all-reduce wrote into grad_output itself" in said
