"""YAML configuration files with ``key=value`` overrides, validated by pydantic before launch.

The capstone (``imagenet/config.py``) and the language-model framework (``lm/config.py``)
describe a run by one YAML file plus command-line overrides, and refuse a bad one before any
process group exists: a typo in a key, a value outside the allowed set, a number out of range is
one message naming the key, the bad value and what is allowed. What is the same for both lives
here once: finding a config by name, reading it (a file with no settings and a key given twice
are refused, where YAML would run on the defaults or keep the last value unseen), applying
``section.key=value`` overrides (values read as YAML, so types follow the file's rules), and
turning pydantic's errors into one line per problem. Each program defines its own sections as
pydantic models deriving from :class:`Section` (``extra="forbid"``: unknown keys are refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from course.cli import Refusal


class ConfigError(Refusal):
    """A configuration a program refuses; the message names the key, the value, the fix (a
    :class:`~course.cli.Refusal`: raised inside a process group too, ``run_main`` prints it as one
    line on every rank)."""


class Section(BaseModel):
    # allow_inf_nan=False: optim.base_lr=.inf (YAML's infinity) is refused like any bad number
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def config_path(name_or_path: str, config_dir: Path) -> Path:
    """``resnet50-8gpu`` -> ``config_dir/resnet50-8gpu.yaml``; any other value is a path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        return candidate
    return config_dir / f"{name_or_path}.yaml"


def available_configs(config_dir: Path, pattern: str = "*.yaml") -> list[str]:
    return sorted(p.stem for p in config_dir.glob(pattern))


def read_yaml(path: Path, shipped: Sequence[str]) -> dict[str, Any]:
    """The mapping a config file holds (``shipped``: the names to suggest when it is missing)."""
    if not path.exists():
        raise ConfigError(
            f"--config {path}: no such file; the shipped configs are "
            f"{', '.join(shipped)} (or give a path to a .yaml file)"
        )
    text = path.read_text()
    try:
        duplicates = duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML: {err}") from err
    if duplicates:
        raise ConfigError(
            f"--config {path}: {'; '.join(duplicates)}: YAML would keep the last one silently "
            "(fix: keep one)"
        )
    if data is None:
        raise ConfigError(
            f"--config {path}: the file holds no settings (empty, or only comments): a run "
            f"would take every default unseen (fix: write its sections, e.g. copy one of "
            f"{', '.join(shipped)})"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(data)}")
    return data


def duplicate_keys(node: yaml.Node | None, where: str = "") -> list[str]:
    """``train.lr is given twice (lines 3 and 9)`` for each key a mapping repeats, found in the
    composed YAML tree: PyYAML's loaders keep the last value of a repeated key without a word
    (the YAML 1.2 spec requires keys to be unique, section 3.2.1.1), so it is checked here."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            is_scalar = isinstance(key_node, yaml.ScalarNode)
            name = str(key_node.value) if is_scalar else "?"
            dotted = f"{where}.{name}" if where else name
            if is_scalar and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                key = (key_node.tag, name)
                if key in first_line:
                    problems.append(f"{dotted} is given twice (lines {first_line[key]} and {line})")
                first_line.setdefault(key, line)
            problems += duplicate_keys(value_node, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            problems += duplicate_keys(item, f"{where}[{index}]")
    return problems


def apply_override(data: dict[str, Any], assignment: str, example: str) -> None:
    """Apply ``section.key=value`` to the raw dict; the value is read as YAML (``0.2``, ``true``,
    ``null``, ``[1, 2]``), so types follow the file's rules. ``example`` shows a good one."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {assignment!r}: expected KEY=VALUE with a dotted key, e.g. {example}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {assignment!r}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _section_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the key at ``loc`` (for listing its allowed keys)."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def describe(err: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: the dotted key, the bad value, what is allowed."""
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key = ".".join(str(p) for p in loc) or "(config)"
        message = str(problem["msg"]).removeprefix("Value error, ")
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            section = _section_at(root, loc)
            allowed = ", ".join(section.model_fields) if section else "?"
            lines.append(f"{key}: unknown key (allowed here: {allowed})")
        elif problem["type"].startswith("value_error") or not loc:
            lines.append(f"{key}: {message}" if loc else message)
        else:
            lines.append(f"{key}={value!r}: {message}")
    return "\n  ".join(lines)
