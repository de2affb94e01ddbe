"""Every key of the framework's config, its default and what it accepts, read off the schema.

The framework's page (``lm/README.md``) lists every key a config may hold; written by hand, such a
list drifts from the pydantic models of ``lm/config.py`` the first time a key is added or a bound
moves. This module walks the models instead (``model_fields``: each field's default and its
``annotated_types`` bounds, a ``Literal``'s choices) and writes the table the page holds;
tests/test_lm_framework_page.py fails when the two differ.

    uv run python -m solutions.phase4_production.lm.config_keys    # print the table
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from solutions.phase4_production.lm.config import FrameworkConfig

_BOUNDS = (
    (annotated_types.Ge, ">="),
    (annotated_types.Gt, ">"),
    (annotated_types.Le, "<="),
    (annotated_types.Lt, "<"),
)


def _accepts(annotation: Any, field: FieldInfo) -> str:
    """What a key accepts: a Literal's choices, a type and its bounds."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " or ".join(_accepts(kind, field) for kind in kinds)
        return f"{text}, or null"
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"a list of {item.__name__}s"
    name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )
    bounds = [
        f"{sign} {getattr(item, kind.__name__.lower())}"
        for item in field.metadata
        for kind, sign in _BOUNDS
        if isinstance(item, kind)
    ]
    return name + (f" {', '.join(bounds)}" if bounds else "")


def _default(field: FieldInfo) -> str:
    factory = field.default_factory
    value = factory() if factory is not None else field.default  # type: ignore[call-arg]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def _checked(model: type[BaseModel], name: str) -> list[str]:
    """The first docstring lines of the model's field validators that check ``name``."""
    notes = []
    for decorator in model.__pydantic_decorators__.field_validators.values():
        if name in decorator.info.fields and decorator.func.__doc__:
            notes.append(decorator.func.__doc__.strip().splitlines()[0])
    return notes


def key_rows(model: type[BaseModel] = FrameworkConfig, prefix: str = "") -> list[list[str]]:
    """``[key, default, accepts]`` for every leaf key, dotted by section, in schema order."""
    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += key_rows(annotation, f"{prefix}{name}.")
        else:
            accepts = ", ".join([_accepts(annotation, field), *_checked(model, name)])
            rows.append([f"`{prefix}{name}`", _default(field), accepts])
    return rows


def key_table() -> str:
    """The page's table of keys, as Markdown."""
    lines = ["| key | default | accepts |", "| --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in key_rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(key_table())
