"""Phase 3 reference solutions: collectives and training across nodes."""
