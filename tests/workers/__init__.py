"""Importable workers and case files for tests of the harness (not collected on their own)."""
