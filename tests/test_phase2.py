"""Phase 2 grader: training within memory, and model, pipeline and tensor parallelism.

This file is the entry point: ``uv run pytest tests/test_phase2.py`` grades every exercise of the
phase, whose tests live one file per exercise in ``tests/phase2/grade_*.py`` (see
tests/phase_collection.py). Each exercise is checked against what PyTorch ships (GradScaler,
torch.utils.checkpoint, DistributedDataParallel with no_sync, torch.distributed.pipelining,
torch.distributed.tensor.parallel) or against one process on the whole batch.

Run one exercise with ``uv run pytest tests/test_phase2.py -m ex2_1``, or its file alone:
``uv run pytest tests/phase2/grade_2_1_accumulation.py``.
"""
