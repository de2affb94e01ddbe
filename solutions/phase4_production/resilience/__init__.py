"""The phase 4 trainer that survives: checkpoints every N steps, resumes by itself under torchrun,
elastic membership.

* ``trainer``: The phase 4 trainer: checkpoints every N steps, resumes by itself under torchrun,
  and is elastic.
"""
