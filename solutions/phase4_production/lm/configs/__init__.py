"""The framework's named configs: each ``<name>.yaml`` here is a config ``--config <name>`` loads.

Kept apart from ``lm/config.py`` (the schema, which imports torch through the model) so that the
framework's ``--help`` can list them before torch loads.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = "lm-cpu-smoke"

