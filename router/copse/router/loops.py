"""The routing decision's inner loops, chosen once at import: the compiled extension
(``_native.c``) when it is built, else the same loops in Python and numpy (``_pyloops.py``):
the same decisions, slower.

``COPSE_ROUTER_NATIVE`` overrides the choice: ``0`` takes the Python loops, ``1`` requires the
extension (an import error when it is not built), and the path of a built extension file loads
that build (``make asan`` runs the tests against an AddressSanitizer build this way).
:data:`IMPLEMENTATION` says which one runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from copse.router import _pyloops

log = logging.getLogger(__name__)

ENV = "COPSE_ROUTER_NATIVE"


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
        return native, "native"
    path = Path(choice)
    spec = importlib.util.spec_from_file_location("copse.router._native", path) if path.is_file() else None
    if spec is None or spec.loader is None:
        raise ImportError(f"{ENV}={choice!r}: expected 0, 1 or the path of a built _native extension file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, f"native ({path})"


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
