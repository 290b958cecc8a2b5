"""The conventions every ``copse`` command follows (docs/reference/conventions.md has the table).

* Exit codes: 0 success; 1 a failed run or invalid input (a file's content, a manifest, a
  configuration); 2 a usage error (an unknown option, a value outside its range, options that do
  not go together, a named file that does not exist).
* ``-o/--output table|json|yaml`` chooses how a command prints its result; ``--out FILE`` (or
  ``--out DIR``) is where a command writes one.
* One spelling per concept. A renamed option keeps its old spelling for one release, hidden from
  ``--help``; using it warns on stderr (:func:`renamed`).

It lives in ``copse.workers``, the package that depends on nothing else of copse, so that every
component's CLI can use it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
import yaml
from click.core import ParameterSource

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

#: What ``-o/--output`` takes: a table for people, JSON or YAML for tools.
OUTPUTS = ("table", "json", "yaml")
#: The release that drops the old spellings :func:`renamed` keeps.
ALIASES_REMOVED_IN = "0.2"

F = TypeVar("F", bound=Callable[..., Any])
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


class Failure(click.ClickException):
    """A failed run or invalid input: ``error: <message>`` on stderr, exit 1."""

    exit_code = EXIT_FAILURE

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def output_option(*, choices: tuple[str, ...] = OUTPUTS) -> Callable[[F], F]:
    """``-o/--output``: how the command prints its result (``table`` unless told)."""
    return click.option(
        "-o",
        "--output",
        "output",
        type=click.Choice(choices),
        default=choices[0],
        show_default=True,
        help="How to print the result: " + ", ".join(choices) + " (json and yaml hold the same fields).",
    )


def render(data: Any, *, output: str, table: Callable[[], str]) -> str:
    """The text ``-o/--output`` asks for: ``table()`` for a table, else ``data`` as JSON or YAML."""
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        return yaml.safe_dump(data, sort_keys=False).rstrip("\n")
    return table()


def renamed(old: str, *, new: str, dest: str, value: Any = None, **option: Any) -> Callable[[F], F]:
    """Keep ``old``, the spelling before ``new``, for one release.

    Hidden from ``--help``, it sets the parameter ``dest`` (``value`` if given: a flag such as
    ``--json`` becomes ``-o json``; else what was typed, converted as ``option`` says) and warns on
    stderr. Giving both spellings is a usage error. Put it below the command's decorator."""
    hidden = f"renamed_{old.lstrip('-').replace('-', '_')}"

    def decorator(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = kwargs.pop(hidden)
            ctx = click.get_current_context()
            if ctx.get_parameter_source(hidden) in _GIVEN:
                if ctx.get_parameter_source(dest) in _GIVEN:
                    raise click.UsageError(f"{old} is the old spelling of {new}: give {new} only")
                click.echo(
                    f"warning: {old} is deprecated and goes in copse {ALIASES_REMOVED_IN}: use {new}",
                    err=True,
                )
                kwargs[dest] = value if value is not None else given
            return function(*args, **kwargs)

        return click.option(old, hidden, hidden=True, **option)(wrapper)  # type: ignore[return-value]

    return decorator


def json_renamed(function: F) -> F:
    """``--json``, the spelling before ``-o json``."""
    return renamed("--json", new="-o json", dest="output", value="json", is_flag=True)(function)
