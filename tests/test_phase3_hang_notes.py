"""3.2's hang notes name a cause only on evidence (issue 49): a folded rank waiting for its
result is evidence that the way back is missing only when its partner went on; a partner stuck
in the core instead is a pairing that is not mutual, shown on two core ranks. No process is
started: the ledgers a hung world leaves are written here by hand."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent / "phase3"))

from grade_3_2_halving_doubling import (
    FOLD_BACK_MISSING,
    PAIRING_NOT_MUTUAL,
    fold_hang_note,
)

from course.p2p_ledger import PendingP2P


def _waits(rank: int, op: str, peer: int) -> PendingP2P:
    return PendingP2P(rank, op, peer, 0, "float32", (4,), "tree_allreduce.py", 1, "f", True)


def _hung(waits: Mapping[int, PendingP2P | None]) -> Any:
    """What fold_hang_note reads of a WorldHung: the hung ranks and their pending messages."""
    pending = {rank: [op] if op is not None else [] for rank, op in waits.items()}
    return SimpleNamespace(hung={rank: [] for rank in waits}, pending=pending)


def test_a_partner_that_went_on_is_the_missing_way_back() -> None:
    # 3 ranks: rank 0 folded into 1, which returned and waits in the grader's all-reduce
    note = fold_hang_note(_hung({0: _waits(0, "recv", 1), 1: None, 2: None}), 3)
    assert note.startswith(FOLD_BACK_MISSING), note


def test_a_partner_stuck_in_the_core_is_a_pairing_not_the_way_back() -> None:
    # 5 ranks, partners r + d: rank 0 waits for its result from 1, stuck in the core on 2,
    # which waits on 3
    waits = {
        0: _waits(0, "recv", 1),
        1: _waits(1, "irecv", 2),
        2: _waits(2, "irecv", 3),
        3: _waits(3, "irecv", 4),
        4: _waits(4, "irecv", 1),
    }
    note = fold_hang_note(_hung(waits), 5)
    assert FOLD_BACK_MISSING not in note, note
    assert note.startswith(f"{PAIRING_NOT_MUTUAL}: rank 1 waits on its partner 2"), note


def test_partners_waiting_on_each_other_name_nothing() -> None:
    waits = {1: _waits(1, "irecv", 2), 2: _waits(2, "irecv", 1)}
    assert fold_hang_note(_hung(waits), 4) == ""
