"""Phase 1 grader: data parallelism on one node. ``uv run pytest tests/test_phase1.py``

This file is the entry point only: it grades every ``tests/phase1/grade_*.py``, one file per
exercise (1.1 sampler, 1.2 averaging, 1.3 all-reduce, 1.4 trainer), in that order. Every exercise
is checked against what PyTorch ships (DistributedSampler, dist.all_reduce,
DistributedDataParallel) or against one process doing the same work, in real worlds of 2-4
processes, and also inside two subgroups of a world of 4. One exercise:
``uv run pytest tests/test_phase1.py -m ex1_2``, or its file:
``uv run pytest tests/phase1/grade_1_2_averaging.py``.
"""
