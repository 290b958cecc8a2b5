"""The repository runs with nothing beside it: every input ``make demo``, the tests, the e2e suite
and the examples read ships in it (``.ci/run`` runs ``make test`` in a fresh clone in a scratch
directory to prove the same end to end). Only the benchmarks of whole public traces look next to
the repository (a sibling ``shared`` checkout), and they say where to get what is missing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from copse.cli import demo

REPO = Path(__file__).resolve().parents[2]
#: A path that leaves the repository towards a sibling ``shared`` checkout.
OUTSIDE = re.compile(r"""parent\s*/\s*["']shared|parents\[\d\]\s*/\s*["']shared|\.\./shared""")
#: Where naming the sibling checkout is allowed: the benchmarks' optional whole traces and their notes.
ALLOWED = (
    ".ci/run",
    "benchmarks/",
    "examples/traces/README.md",
    "examples/planner/README.md",
    "README.md",
    "docs/",
)


def _tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return listed.stdout.splitlines()


def test_only_the_benchmarks_look_outside_the_repository() -> None:
    offenders = []
    for name in _tracked():
        path = REPO / name
        if name.startswith(ALLOWED) or path.suffix not in {".py", ".md", ".yaml", ".toml", ".sh", ""}:
            continue
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert offenders == []


def test_the_demo_reads_only_files_the_repository_ships() -> None:
    assert demo._missing_inputs() == []
    tracked = set(_tracked())
    for path in (demo.TRACE, demo.SEED, demo.DISAGGREGATED):
        assert path.relative_to(REPO).as_posix() in tracked


def test_shipped_data_keeps_its_licence_notes() -> None:
    shipped = REPO / "examples" / "traces"
    notice = (shipped / "NOTICE").read_text()
    data = [p.name for p in shipped.iterdir() if p.name.endswith((".gz", ".csv"))]
    assert data
    for name in data:
        assert name in notice, f"{name} has no attribution in examples/traces/NOTICE"
        assert (shipped / name).stat().st_size < 2_000_000, f"{name}: keep shipped inputs small"
    assert "Apache License" in (shipped / "LICENSE-Apache-2.0").read_text()
