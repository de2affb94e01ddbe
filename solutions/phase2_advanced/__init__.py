"""Phase 2 reference solutions: advanced single node (memory, model, pipeline, tensor parallel)."""
