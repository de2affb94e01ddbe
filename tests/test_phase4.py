"""Phase 4 grader: production training. ``uv run pytest tests/test_phase4.py``

This file is the entry point only: it grades every ``tests/phase4/grade_*.py``, one file per
exercise (4.1 atomic, complete checkpoints; 4.2 automatic recovery; 4.3 elastic training; 4.4
gradient compression hooks; 4.5 monitoring and stragglers), in that order. Resumed runs are compared with uninterrupted ones bitwise (``torch.equal``, CPU);
failures are real (SIGKILL, exceptions, hangs) under real ``torchrun`` agents with restarts and
elastic membership (marked ``torchrun``: deselect with ``-m 'not torchrun'``). One exercise:
``uv run pytest tests/test_phase4.py -m ex4_2``, or its file:
``uv run pytest tests/phase4/grade_4_2_recovery.py``.
"""
