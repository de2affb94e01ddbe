"""Measured results: a benchmark writes them to a JSON file, the guides quote them, a test compares.

Every number in a guide or the README that claims a measurement comes from a results file that a
benchmark wrote with its ``--record PATH`` flag (``phaseN_*/results/*.json``, committed beside the
guide). The guide does not retype the number: it holds a marked block that this module renders
from the file, so the page and the run cannot disagree::

    <!-- results phase3_multi_node/results/ring_goal.json table=goal -->
    | world | size | ring / dist.all_reduce |
    ...
    *Recorded 2026-11-24 on ... by `uv run python -m ... --record ...`.*
    <!-- end results -->

and, inside a sentence, one value::

    the ring reached <!-- value phase3_multi_node/results/ring_goal.json w2_16mib -->1.19x
    <!-- end value --> (written on one line in a page)

A results file (version 1) holds what was run, where, and the formatted figures::

    {"version": 1, "command": "...", "recorded": "2026-11-24", "machine": "...",
     "tables": {"goal": {"columns": [...], "rows": [[...]], "note": "..."}},
     "values": {"w2_16mib": "1.19x"}}

Cells and values are strings, formatted by the benchmark once, so a page shows exactly what the
run printed.

    uv run python -m course.results --check   # exit 1 when a page and its results file disagree
    uv run python -m course.results --write   # re-render every block from the results files
    uv run python -m course.results --rerun 'phase3*/results/*.json'   # re-run the recorded
                                              # commands one after another, then re-render

``tests/test_claims.py`` runs the check, so CI fails when a page drifts from its data.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VERSION = 1
BLOCK = re.compile(
    r"<!-- results (?P<path>\S+) table=(?P<table>[\w.-]+) -->\n(?P<body>.*?)<!-- end results -->",
    re.DOTALL,
)
VALUE = re.compile(
    r"<!-- value (?P<path>\S+) (?P<key>[\w.-]+) -->(?P<body>.*?)<!-- end value -->", re.DOTALL
)


@dataclass
class Table:
    """A measured table: column titles and rows of already formatted cells."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(
                f"row {cells!r} has {len(cells)} cells for {len(self.columns)} columns"
            )
        self.rows.append([str(cell) for cell in cells])

    def as_dict(self) -> dict[str, Any]:
        return {"columns": self.columns, "rows": self.rows, "note": self.note}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Table:
        rows = [list(map(str, row)) for row in data["rows"]]
        return cls(list(data["columns"]), rows, data.get("note", ""))

    def to_markdown(self) -> str:
        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(cells) + " |"

        numeric = [
            all(_looks_numeric(row[i]) for row in self.rows) if self.rows else False
            for i in range(len(self.columns))
        ]
        rule = ["---:" if is_num else "---" for is_num in numeric]
        return "\n".join([line(self.columns), line(rule), *(line(row) for row in self.rows)])


def _looks_numeric(cell: str) -> bool:
    return bool(re.fullmatch(r"[-+~<>=≈ ]*[\d.]+[\w%/ .·×x-]*", cell.strip()))


def machine_description() -> str:
    """Where a run happened, in one line: CPU count and kind, GPU if any, torch version."""
    import torch

    gpu = "no GPU"
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        gpu = f"{count}x {torch.cuda.get_device_name(0)}"
    cpus = os.cpu_count() or 0
    return f"{platform.machine()}, {cpus} cores, {gpu}; torch {torch.__version__}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that is running, as a reader would type it.

    ``uv run python -m <module> <flags>`` for a program that starts its own worlds; under
    torchrun (``TORCHELASTIC_RUN_ID`` set), ``uv run torchrun --standalone
    --nproc_per_node=<LOCAL_WORLD_SIZE> -m <module> <flags>``, so a re-run is a world of the
    same size, not a world of one.
    """
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        target = ["-m", spec.name.removesuffix(".__main__")]
    else:
        target = [argv[0]] if argv else []
    flags = list(map(shlex.quote, argv[1:]))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
        launcher = ["uv run torchrun --standalone", f"--nproc_per_node={per_node}"]
        nodes = os.environ.get("GROUP_WORLD_SIZE", "1")
        if nodes != "1":
            launcher = [f"uv run torchrun --nnodes={nodes}", f"--nproc_per_node={per_node}"]
        return " ".join([*launcher, *target, *flags])
    return " ".join(["uv run python", *target, *flags])


def write_results(
    path: str | Path,
    *,
    tables: Mapping[str, Table] | None = None,
    values: Mapping[str, str] | None = None,
    command: str | None = None,
) -> Path:
    """Write a results file (see the module docstring) and return its path."""
    target = Path(path)
    if not target.is_absolute():
        target = Path.cwd() / target
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "version": VERSION,
        "command": command or command_line(),
        "recorded": _dt.date.today().isoformat(),
        "machine": machine_description(),
        "tables": {name: table.as_dict() for name, table in (tables or {}).items()},
        "values": {key: str(value) for key, value in (values or {}).items()},
    }
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(target)
    return target


def load_results(path: str | Path) -> dict[str, Any]:
    """A results file, checked for the keys a page reads."""
    data = json.loads(Path(path).read_text())
    missing = [key for key in ("version", "command", "recorded", "machine") if key not in data]
    if missing:
        raise ValueError(f"{path}: not a results file (missing {', '.join(missing)})")
    return data


def render_table(data: Mapping[str, Any], table: str, rel: str) -> str:
    """The markdown of one table of a results file, with where and how it was recorded."""
    if table not in data.get("tables", {}):
        raise KeyError(f"{rel} has no table {table!r} (tables: {sorted(data.get('tables', {}))})")
    parsed = Table.from_dict(data["tables"][table])
    caption = f"*Recorded {data['recorded']} on {data['machine']}: `{data['command']}`.*"
    parts = [parsed.to_markdown(), ""]
    if parsed.note:
        parts += [parsed.note, ""]
    parts.append(caption)
    return "\n".join(parts) + "\n"


def render_page(text: str, root: Path = PROJECT_ROOT) -> tuple[str, list[str]]:
    """``text`` with every results block and value re-rendered; and the problems found."""
    problems: list[str] = []
    cache: dict[str, dict[str, Any] | None] = {}

    def data_of(rel: str) -> dict[str, Any] | None:
        if rel not in cache:
            try:
                cache[rel] = load_results(root / rel)
            except (OSError, ValueError) as err:
                problems.append(f"{rel}: {err}")
                cache[rel] = None
        return cache[rel]

    def table(match: re.Match[str]) -> str:
        data = data_of(match["path"])
        if data is None:
            return match.group(0)
        try:
            body = render_table(data, match["table"], match["path"])
        except KeyError as err:
            problems.append(str(err.args[0]))
            return match.group(0)
        head = f"<!-- results {match['path']} table={match['table']} -->"
        return f"{head}\n{body}<!-- end results -->"

    def value(match: re.Match[str]) -> str:
        data = data_of(match["path"])
        if data is None:
            return match.group(0)
        values = data.get("values", {})
        if match["key"] not in values:
            problems.append(f"{match['path']} has no value {match['key']!r}")
            return match.group(0)
        head = f"<!-- value {match['path']} {match['key']} -->"
        return f"{head}{values[match['key']]}<!-- end value -->"

    return VALUE.sub(value, BLOCK.sub(table, text)), problems


def pages(root: Path = PROJECT_ROOT) -> list[Path]:
    """The pages that may quote results: README.md, every guide, and the programs' own pages
    (``solutions/<phase>/<program>/README.md``, e.g. the language-model framework's)."""
    return [
        root / "README.md",
        *sorted(root.glob("phase*_*/guidelines.md")),
        *sorted(root.glob("solutions/phase*_*/*/README.md")),
    ]


def check(root: Path = PROJECT_ROOT, *, write: bool = False) -> list[str]:
    """Problems (missing files or keys, pages that differ from their data); fix them if asked."""
    problems: list[str] = []
    for page in pages(root):
        if not page.exists():
            continue
        text = page.read_text()
        rendered, found = render_page(text, root)
        rel = page.relative_to(root)
        problems += [f"{rel}: {problem}" for problem in found]
        if rendered != text:
            if write:
                page.write_text(rendered)
            else:
                problems.append(
                    f"{rel}: a quoted result differs from its results file "
                    "(uv run python -m course.results --write re-renders it)"
                )
    return problems


def quoted_files(root: Path = PROJECT_ROOT) -> set[str]:
    """Every results file some page quotes."""
    found: set[str] = set()
    for page in pages(root):
        if page.exists():
            text = page.read_text()
            found |= {m["path"] for m in BLOCK.finditer(text)}
            found |= {m["path"] for m in VALUE.finditer(text)}
    return found


def rerun(pattern: str, root: Path = PROJECT_ROOT) -> int:
    """Run the recorded command of every results file matching ``pattern``, one at a time (a
    quiet machine measures best), from the project root; return how many failed."""
    import subprocess
    import time

    failed = 0
    files = sorted(root.glob(pattern))
    for number, path in enumerate(files, 1):
        command = load_results(path)["command"]
        print(f"[{number}/{len(files)}] {command}", flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, shell=True, cwd=root, check=False)
        print(f"  exit {done.returncode} after {time.perf_counter() - started:.0f} s", flush=True)
        failed += done.returncode != 0
    return failed


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check or re-render the guides' measured results.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a page differs")
    mode.add_argument("--write", action="store_true", help="re-render every block from its file")
    mode.add_argument(
        "--rerun",
        metavar="GLOB",
        help="re-run the recorded command of each results file matching GLOB (relative to the "
        "project root), then re-render the pages",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.rerun:
        failed = rerun(args.rerun)
        problems = check(write=True)
        for problem in problems:
            print(problem)
        return 1 if failed or check() else 0
    problems = check(write=args.write)
    for problem in problems:
        print(problem)
    if args.write:
        left = check()
        return 1 if left else 0
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
