"""3.1's and 3.2's hang notes name a cause only on evidence (issue 49). 3.2: a folded rank
waiting for its result is evidence that the way back is missing only when its partner went on;
a partner stuck in the core instead is a pairing that is not mutual, shown on two core ranks.
3.1: a ring's hung ranks get a note only when every one waits the same way (all in an
all-gather receive, or all in an all-gather send, that no rank matched) or a message crossed
tags; every hang one factor away from a noted one gets no note of another. No process is
started: the ledgers a hung world leaves are written here by hand."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "phase3"))

from grade_3_1_ring import OWN_CHUNK_NEVER_LEFT, SENDS_MORE, TAGS_CROSSED, ring_hang_words
from grade_3_2_halving_doubling import (
    FOLD_BACK_MISSING,
    PAIRING_NOT_MUTUAL,
    fold_hang_note,
)

from course.p2p_ledger import PendingP2P, crossed_tags


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


# ----------------------------------------------------------------------------- 3.1's ring

RS_TAG, AG_TAG = 0, 1  # the reference's REDUCE_SCATTER_TAG and ALL_GATHER_TAG
RING_NOTES = (TAGS_CROSSED, OWN_CHUNK_NEVER_LEFT, SENDS_MORE)
# a ring hang, one value per factor: what each of 3 hung ranks waits in (the last rank may wait
# otherwise), under which tag, whether its peer ever posted the other end, crossed tags
RING_FACTORS: dict[str, tuple[Any, ...]] = {
    "waits in": ("recv", "send"),
    "last rank waits in": ("the same", "the other kind", "nothing"),
    "tag": ("all-gather", "reduce-scatter"),
    "other end": ("never posted", "posted"),
    "tags": ("one tag per message", "crossed"),
}
RING_HANGS: dict[str, tuple[str, dict[str, Any]]] = {
    "own chunk never left": (OWN_CHUNK_NEVER_LEFT, {"waits in": "recv"}),
    "sends more than received": (SENDS_MORE, {"waits in": "send"}),
    "tags crossed": (TAGS_CROSSED, {"tags": "crossed"}),
}
RING_BASE = {
    "waits in": "recv",
    "last rank waits in": "the same",
    "tag": "all-gather",
    "other end": "never posted",
    "tags": "one tag per message",
}


def _ring_hang(s: Mapping[str, Any]) -> Any:
    """What ring_hang_words reads of a WorldHung of 3 ranks in a ring (each sends to its right
    neighbour, receives from its left) hung as ``s`` says."""
    ops: dict[int, PendingP2P | None] = {}
    for rank in range(3):
        kind = s["waits in"]
        if rank == 2 and s["last rank waits in"] != "the same":
            kind = (
                None if s["last rank waits in"] == "nothing" else {"recv": "send"}.get(kind, "recv")
            )
        tag = AG_TAG if s["tag"] == "all-gather" else RS_TAG
        peer = (rank + 1) % 3 if kind == "send" else (rank - 1) % 3
        ops[rank] = (
            None
            if kind is None
            else PendingP2P(
                rank, kind, peer, tag, "float32", (4,), "ring_allreduce.py", 10, "f", True
            )
        )
    unmatched = [(op, "never matched") for op in ops.values()
                 if op is not None and s["other end"] == "never posted"]  # fmt: skip
    if s["tags"] == "crossed":  # rank 0 sends to 1 under the other tag than 1 receives under
        send = PendingP2P(
            0, "isend", 1, RS_TAG, "float32", (4,), "ring_allreduce.py", 20, "f", False
        )
        recv = PendingP2P(
            1, "irecv", 0, AG_TAG, "float32", (4,), "ring_allreduce.py", 30, "f", True
        )
        unmatched += [(send, "never received"), (recv, "never sent")]
    pending = {rank: [op] if op is not None else [] for rank, op in ops.items()}
    return SimpleNamespace(
        hung={rank: [] for rank in ops},
        pending=pending,
        unmatched=unmatched,
        crossed=crossed_tags(unmatched),
    )


def _ring_neighbours(changed: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every hang one factor away from ``changed`` (on RING_BASE), but the named ones."""
    setting = {**RING_BASE, **changed}
    named = [{**RING_BASE, **c} for _, c in RING_HANGS.values()]
    out = []
    for factor, values in RING_FACTORS.items():
        for value in values:
            other = {**setting, factor: value}
            if other != setting and other not in named:
                out.append((f"{factor}: {value}", other))
    return out


@pytest.mark.parametrize("hang", list(RING_HANGS))
def test_a_ring_hang_gets_its_own_note_and_its_neighbours_borrow_none(hang: str) -> None:
    words, changed = RING_HANGS[hang]
    note = ring_hang_words(_ring_hang({**RING_BASE, **changed}), AG_TAG)
    assert words in note, note
    assert not [w for w in RING_NOTES if w != words and w in note], note
    for label, setting in _ring_neighbours(changed):
        if setting["tags"] == "crossed":
            continue  # crossed tags are noted whatever else the ranks wait in
        note = ring_hang_words(_ring_hang(setting), AG_TAG)
        assert not [w for w in RING_NOTES if w in note], f"{hang}, {label}: {note}"


def test_without_an_all_gather_tag_only_crossed_tags_are_noted() -> None:
    assert ring_hang_words(_ring_hang(RING_BASE), None) == ""
    crossed = ring_hang_words(_ring_hang({**RING_BASE, "tags": "crossed"}), None)
    assert TAGS_CROSSED in crossed, crossed
