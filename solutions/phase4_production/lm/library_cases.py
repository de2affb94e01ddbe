"""The layouts the library comparison runs (``lm.library_compare``), apart from the comparison.

A case is settings and a model's head and MLP; naming one needs neither torch's DTensor nor
its pipelining, which ``lm.library`` imports (about a second): the 4.7 grader names its cases
when pytest collects it, and collection stays fast (issue 51).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course.language_model import LMConfig
from phase4_production.lm_layout import ParallelSettings


@dataclass(frozen=True)
class Case:
    """One layout of the comparison: its settings and the model's head and MLP."""

    settings: ParallelSettings
    tied: bool = False
    moe: bool = False

    def config(self, base: LMConfig) -> LMConfig:
        moe_layers = (1, 2) if self.moe else ()
        return replace(base, tied=self.tied, moe_layers=moe_layers)

    @property
    def model(self) -> str:
        return ("tied" if self.tied else "untied") + (", MoE layers 1-2" if self.moe else "")

    @property
    def label(self) -> str:
        clip = f", clip {self.settings.max_norm:g}" if self.settings.max_norm else ""
        return self.settings.label() + clip
