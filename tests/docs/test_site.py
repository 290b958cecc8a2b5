"""The docs site builds with --strict (what `make docs` runs): every link and anchor resolves, every
nav entry exists, the generated reference pages render, links to repository files are carried in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .snippets import ROOT


def test_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    for page in ("reference/api", "reference/cli", "reference/helm-values", "reference/metrics",
                 "reference/router-config", "troubleshooting", "guides/install"):  # fmt: skip
        assert (site / page / "index.html").is_file(), page
    assert "copse planner record" in (site / "reference/cli/index.html").read_text()
    assert (site / "repo/benchmarks/RESULTS/index.html").is_file()
    assert (site / "screenshots/dashboard.png").is_file()
