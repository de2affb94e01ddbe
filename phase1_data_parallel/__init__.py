"""Phase 1 exercises: data parallelism on one node. Fill in the TODOs of template_*.py."""
