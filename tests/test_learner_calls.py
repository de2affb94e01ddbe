"""A rank's error raised in given code is reported at the learner's call (issue 49, item 6):
tests/learner_calls.py (applied to every exercise's worlds by tests/conftest.py), on the frames a
rank reports (no process is started)."""

from __future__ import annotations

from pathlib import Path

from learner_calls import learner_call_note

from course.world import Frame, RankFailed

DDP = "solutions/phase3_multi_node/ddp.py"
SUPPORT = "phase3_multi_node/ddp_support.py"


def _line(path: str, text: str) -> int:
    lines = (Path(__file__).parents[1] / path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_an_index_error_in_the_given_slot_points_at_the_learners_call() -> None:
    frames = [
        Frame(SUPPORT, _line(SUPPORT, "self._mark_ready(index)"), "_on_grad_ready"),
        Frame(DDP, _line(DDP, "slot = bucket.slot(position)"), "_mark_ready"),
        Frame(SUPPORT, _line(SUPPORT, "start = self.offsets[position]"), "slot"),
    ]
    note = learner_call_note(RankFailed(0, "IndexError", "list index out of range", frames), "3.4")
    assert note.startswith("3.4: rank 0 raised IndexError in the given code (")
    assert f"called from your code at {DDP}:{frames[1].lineno} in _mark_ready" in note


def test_an_error_raised_in_the_learners_own_code_is_left_as_it_is() -> None:
    frames = [
        Frame(SUPPORT, _line(SUPPORT, "self._mark_ready(index)"), "_on_grad_ready"),
        Frame(DDP, _line(DDP, "slot = bucket.slot(position)"), "_mark_ready"),
    ]
    assert learner_call_note(RankFailed(1, "RuntimeError", "shape", frames), "3.4") == ""


def test_no_learner_frame_no_note() -> None:
    frames = [Frame(SUPPORT, _line(SUPPORT, "start = self.offsets[position]"), "slot")]
    assert learner_call_note(RankFailed(0, "IndexError", "x", frames), "3.4") == ""
