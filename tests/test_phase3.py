"""Phase 3 grader: multi-node collectives. ``uv run pytest tests/test_phase3.py``

This file is the entry point only: it grades every ``tests/phase3/grade_*.py`` (one or two files per
exercise), in order: 3.1 ring all-reduce, 3.2 halving-doubling and the alpha-beta model, 3.3
hierarchical all-reduce (on simulated nodes, and once on two real torchrun agents on loopback),
then the later exercises of the phase (3.4 DDP, 3.5 ZeRO, ...).
Every all-reduce is compared with ``dist.all_reduce`` (and its halves with
``dist.reduce_scatter_tensor`` / ``dist.all_gather_into_tensor``), and the bytes each rank sends
are counted against the formulas. One exercise: ``uv run pytest tests/test_phase3.py -m ex3_1``,
or its file: ``uv run pytest tests/phase3/grade_3_1_ring.py``.
"""
