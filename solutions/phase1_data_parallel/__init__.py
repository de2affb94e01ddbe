"""Phase 1 reference solutions: data parallelism on one node."""
