"""The routing decision's inner loops, chosen once at import: the compiled extension
(``_native.c``) when it is built, else the same loops in Python and numpy (``_pyloops.py``):
the same decisions, slower.

``COPSE_ROUTER_NATIVE`` overrides the choice: ``0`` takes the Python loops, ``1`` requires the
extension (an import error when it is not built), and the path of a built extension file loads
that build (``make asan`` runs the tests against an AddressSanitizer build this way).
:data:`IMPLEMENTATION` says which one runs.

A build older than its source (``_native.c`` edited since, e.g. by a ``git pull``, without ``make
venv``) would take other arguments than the Python side passes: the build carries the SHA-256 of
the source it was compiled from, and when ``_native.c`` sits next to this module (a source
checkout; an installed wheel ships the build only) the two must match. By default an out-of-date
build is not used: the Python loops run, with a warning saying to run ``make venv``; with
``COPSE_ROUTER_NATIVE=1`` or a path it is an import error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from copse.router import _pyloops

log = logging.getLogger(__name__)

ENV = "COPSE_ROUTER_NATIVE"


def _stale(native: ModuleType) -> str | None:
    """Why ``native`` was not built from the ``_native.c`` next to this module, or ``None``."""
    source = Path(__file__).with_name("_native.c")
    if not source.is_file():  # an installed wheel: the build is all it has
        return None
    expected = hashlib.sha256(source.read_bytes()).hexdigest()
    built = getattr(native, "SOURCE_SHA256", None)
    if built == expected:
        return None
    origin = f"built from {built[:12]}" if built else "built before builds named their source"
    return (
        f"the compiled router loops are out of date ({origin}, _native.c is {expected[:12]}): run `make venv`"
    )


def _checked(native: ModuleType) -> ModuleType:
    """``native``, once its load rows are the Python loops' (the two sources must agree)."""
    if native.LOAD_ROWS != _pyloops.LOAD_ROWS:
        raise ImportError(
            f"_native.c has load rows {native.LOAD_ROWS}, _pyloops.py {_pyloops.LOAD_ROWS}: they must agree"
        )
    return native


def _load(choice: str) -> tuple[ModuleType, str]:
    if choice == "0":
        return _pyloops, "python"
    if choice in ("", "1"):
        try:
            native = importlib.import_module("copse.router._native")
        except ImportError as exc:
            if choice == "1":
                raise ImportError(f"{ENV}=1 but the compiled router loops are not built: {exc}") from exc
            log.warning("the compiled router loops are not built (%s); using the Python ones (slower)", exc)
            return _pyloops, "python"
        stale = _stale(native)
        if stale is not None:
            if choice == "1":
                raise ImportError(f"{ENV}=1 but {stale}")
            log.warning("%s; using the Python ones (slower) until then", stale)
            return _pyloops, "python"
        return _checked(native), "native"
    path = Path(choice)
    spec = importlib.util.spec_from_file_location("copse.router._native", path) if path.is_file() else None
    if spec is None or spec.loader is None:
        raise ImportError(f"{ENV}={choice!r}: expected 0, 1 or the path of a built _native extension file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stale = _stale(module)
    if stale is not None:
        raise ImportError(f"{ENV}={choice!r}: {stale}")
    return _checked(module), f"native ({path})"


MODULE, IMPLEMENTATION = _load(os.environ.get(ENV, ""))
"""The module that runs the loops, and which it is: ``native``, ``python``, or ``native (<path>)``
for an extension loaded from ``COPSE_ROUTER_NATIVE``."""

if TYPE_CHECKING:
    from copse.router._native import LOAD_ROWS, BlockIndex, Curve, Grid, LoadTable, lowest
else:
    LOAD_ROWS = MODULE.LOAD_ROWS
    BlockIndex = MODULE.BlockIndex
    Curve = MODULE.Curve
    Grid = MODULE.Grid
    LoadTable = MODULE.LoadTable
    lowest = MODULE.lowest

__all__ = [
    "ENV",
    "IMPLEMENTATION",
    "LOAD_ROWS",
    "MODULE",
    "BlockIndex",
    "Curve",
    "Grid",
    "LoadTable",
    "lowest",
]
