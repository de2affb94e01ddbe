"""Phase 2 exercises: advanced single node. Fill in the TODOs of template_*.py."""
