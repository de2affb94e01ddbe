"""Phase 4 reference solutions: checkpoints that survive crashes, recovery, elastic training."""
