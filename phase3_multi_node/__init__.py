"""Phase 3 exercises: multi-node collectives and training. Fill in the TODOs of template_*.py."""
