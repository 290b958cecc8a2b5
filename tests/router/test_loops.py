"""Which routing loops run (the compiled ones when built, else the Python ones, with a warning,
as ``COPSE_ROUTER_NATIVE`` asks), and that both route alike: a replay through the whole router
reports the same figures to the bit (the loops themselves: tests/router/test_native.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from copse.router import loops

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO / "examples/traces/mooncake-conversation-first-20min.jsonl.gz"

_UNBUILT = "import sys; sys.modules['copse.router._native'] = None  # as if the extension were not built\n"


def _python(code: str, *, native: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != loops.ENV}
    if native is not None:
        env[loops.ENV] = native
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)


def test_the_compiled_loops_run_when_built() -> None:
    run = _python("from copse.router import loops; print(loops.IMPLEMENTATION)", native=None)
    assert run.stdout.strip() == "native", run.stderr


def test_without_the_extension_the_python_loops_run_and_say_so() -> None:
    code = _UNBUILT + "from copse.router import loops, indexer; print(loops.IMPLEMENTATION)"
    run = _python(code, native=None)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "python"
    assert "the compiled router loops are not built" in run.stderr
    forced = _python("from copse.router import loops; print(loops.IMPLEMENTATION)", native="0")
    assert forced.stdout == "python\n"


def test_without_a_c_compiler_the_package_still_builds(tmp_path: Path) -> None:
    build = ["build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    run = subprocess.run(
        [sys.executable, "setup.py", "--quiet", *build],
        cwd=REPO,
        env={**os.environ, "CC": "/bin/false"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert 'building extension "copse.router._native" failed' in run.stderr
    assert not list(tmp_path.rglob("_native*.so"))


def test_requiring_an_extension_that_is_not_built_fails_by_name() -> None:
    run = _python(_UNBUILT + "from copse.router import loops", native="1")
    assert run.returncode != 0
    assert "COPSE_ROUTER_NATIVE=1 but the compiled router loops are not built" in run.stderr
    run = _python("from copse.router import loops", native="/nowhere/_native.so")
    assert "COPSE_ROUTER_NATIVE='/nowhere/_native.so': expected 0, 1 or the path of a built" in run.stderr


_STALE = (
    "import sys, types\n"
    "stale = types.ModuleType('copse.router._native')\n"
    "stale.SOURCE_SHA256 = '0' * 64  # built from another _native.c\n"
    "sys.modules['copse.router._native'] = stale\n"
)


def test_an_out_of_date_build_is_not_used_and_says_to_rebuild() -> None:
    """A build of an older ``_native.c`` would take other arguments than the Python side passes
    (a TypeError deep in a decision): the Python loops run instead, and the warning says why."""
    run = _python(_STALE + "from copse.router import loops; print(loops.IMPLEMENTATION)", native=None)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "python\n"
    assert "the compiled router loops are out of date (built from 000000000000" in run.stderr
    assert "run `make venv`" in run.stderr
    required = _python(_STALE + "from copse.router import loops", native="1")
    assert required.returncode != 0
    assert "COPSE_ROUTER_NATIVE=1 but the compiled router loops are out of date" in required.stderr


def test_the_build_names_the_source_it_was_compiled_from() -> None:
    native = pytest.importorskip("copse.router._native", reason="no C compiler: nothing was built")
    source = Path(loops.__file__).with_name("_native.c").read_bytes()
    assert hashlib.sha256(source).hexdigest() == native.SOURCE_SHA256, "stale build: run make venv"


@pytest.mark.parametrize(
    "options",
    [["--policy", "kv"], ["--policy", "kv", "--temperature", "0.5"], ["--policy", "dynamo"]],
    ids=["kv", "kv-softmax", "dynamo"],
)
def test_the_python_loops_route_as_the_compiled_ones(options: list[str]) -> None:
    """The router's loops in Python (``COPSE_ROUTER_NATIVE=0``) take the same decisions as the
    compiled ones: a replay through the whole router reports the same figures to the bit."""
    args = ["bench", "replay", "--trace", str(MOONCAKE), "--workers", "8", "--limit", "300", "-o", "json"]
    args += options
    reports = {}
    for native in ("1", "0"):
        run = subprocess.run(
            [sys.executable, "-c", "from copse.cli import main; main()", *args],
            env={**os.environ, loops.ENV: native},
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        reports[native] = json.loads(run.stdout)
    assert reports["0"] == reports["1"]
    assert reports["1"]["requests"] == 300
    assert reports["1"]["cache_hit_rate"] > 0.0
