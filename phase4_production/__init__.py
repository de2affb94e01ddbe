"""Phase 4 exercises: production training. Fill in the TODOs of template_*.py."""
