"""Files the command lines name: a YAML (or JSON) mapping of settings read with one wording of
its errors, and an output path checked before the work that fills it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
import yaml


def read_yaml_mapping(path: Path, *, what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The mapping in a YAML (or JSON) file of ``what`` (e.g. "router settings"); an empty file is
    an empty mapping. Raises ``error`` naming the file: cannot read, not valid YAML, not a mapping."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({exc})") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a mapping of {what}, got a {type(raw).__name__}")
    return raw


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written (a directory, a missing or read-only directory), or ``None``."""
    if path.is_dir():
        return "it is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"no directory {parent}"
    if not os.access(path if path.exists() else parent, os.W_OK):
        return "permission denied"
    return None


class OutputPath(click.Path):
    """A file option the command writes: checked when the command line is read, so that a long
    run does not end on a traceback for a directory that does not exist. The error names the option
    and the path."""

    name = "file"

    def __init__(self) -> None:
        super().__init__(dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = Path(os.fsdecode(super().convert(value, param, ctx)))
        why = unwritable(path)
        if why is not None:
            self.fail(f"cannot write {path}: {why}", param, ctx)
        return path
