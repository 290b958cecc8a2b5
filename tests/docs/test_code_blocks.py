"""Every command the README and the docs show is executed or, where it needs what a test cannot
have (a GPU cluster, Docker, the whole public traces the benchmarks read, a server that runs until
stopped), checked: shell syntax, every ``copse`` command's options as click parses them (a ``copse router
run`` also builds its configuration), every manifest as ``copse api validate`` checks it."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import uvloop
import yaml
from click.core import ParameterSource

from copse.api.manifest import ManifestError, parse_deployment
from copse.cli import main
from copse.operator.children import routing_issues

from .snippets import ROOT, SHELL_LANGUAGES, Block, all_blocks, commands, copse_args

BLOCKS = all_blocks()
SHELL = [b for b in BLOCKS if b.language in SHELL_LANGUAGES]
RUN = [b for b in SHELL if b.not_run is None]
VENV_BIN = Path(sys.executable).parent
COPSE = str(VENV_BIN / "copse")
COPIED = ("examples", "charts", "crds", "benchmarks")
"""Repository folders the commands read, copied into each block's working directory (a command
that writes next to its inputs must not change the checkout)."""


def _ids(block: Block) -> str:
    return block.where


def workdir(tmp_path: Path, block: Block) -> Path:
    """A working directory with the repository's inputs and the files the page defined before it."""
    for name in COPIED:
        shutil.copytree(ROOT / name, tmp_path / name)
    for earlier in BLOCKS:
        if earlier.path == block.path and earlier.line < block.line and earlier.file_name:
            (tmp_path / earlier.file_name).write_text(earlier.text)
    return tmp_path


def resolve(args: list[str]) -> click.Context:
    """Parse a ``copse`` command line down to its leaf command, as click would run it."""
    ctx = main.make_context("copse", list(args))
    command: click.Command = main
    while isinstance(command, click.Group):
        # What click's Group.invoke hands on (protected_args is deprecated for this in click 8.2).
        rest = [*ctx._protected_args, *ctx.args]
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None
        assert name is not None
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return ctx


def hidden(param: click.Parameter) -> bool:
    """An option hidden from ``--help``: an old spelling ``copse.workers.conventions.renamed`` keeps
    for one release, which the docs must not show."""
    return isinstance(param, click.Option) and param.hidden


def given(ctx: click.Context, param: click.Parameter) -> bool:
    return param.name is not None and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE


def test_the_documents_have_blocks() -> None:
    assert len(SHELL) > 20
    assert RUN
    paths = {b.path.name for b in BLOCKS}
    assert {"README.md", "getting-started.md", "install.md"} <= paths


@pytest.mark.parametrize("block", SHELL, ids=_ids)
def test_shell_blocks_are_valid_bash(block: Block) -> None:
    result = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{block.where}: {result.stderr}"


@pytest.mark.parametrize(
    "block", [b for b in SHELL if any(copse_args(c) is not None for c in commands(b.text))], ids=_ids
)
def test_copse_commands_parse(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option of every ``copse`` command shown exists and takes the value shown."""
    monkeypatch.chdir(workdir(tmp_path, block))
    for command in commands(block.text):
        args = copse_args(command)
        if args is None:
            continue
        try:
            ctx = resolve(args)
        except click.ClickException as exc:
            pytest.fail(f"{block.where}: copse {' '.join(args)}: {exc.format_message()}")
        old = [opt for p in ctx.command.params if hidden(p) and given(ctx, p) for opt in p.opts]
        assert not old, f"{block.where}: copse {' '.join(args)}: {old} is a deprecated spelling"
        if ctx.command_path == "copse router run" and not {"--help", "--config"} & set(args):
            check_router_config(ctx, block, monkeypatch)
        if ctx.command_path == "copse api validate":  # offline: runs even where the block cannot
            result = subprocess.run([COPSE, *args], capture_output=True, text=True, timeout=120, check=False)
            assert result.returncode == 0, f"{block.where}: copse {' '.join(args)}:\n{result.stderr}"


def check_router_config(ctx: click.Context, block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    """``copse router run`` builds and validates its configuration from the options (what fails
    at start-up, e.g. a missing ``engine``), then would serve: serving is replaced by a no-op."""
    import copse.router.server  # noqa: PLC0415

    built: list[Any] = []

    async def idle() -> None:
        return None

    def serve(config: Any) -> Any:
        built.append(config)
        return idle()

    def run(coroutine: Any) -> None:
        coroutine.close()
        built.append("served")

    monkeypatch.setattr(copse.router.server, "serve", serve)
    monkeypatch.setattr(uvloop, "run", run)
    try:
        ctx.command.invoke(ctx)
    except SystemExit as exc:
        pytest.fail(f"{block.where}: copse router run refuses its options: exit {exc.code}")
    assert built[-1:] == ["served"], block.where


@pytest.mark.parametrize("block", RUN, ids=_ids)
def test_runnable_blocks_run(block: Block, tmp_path: Path) -> None:
    """Blocks without a not-run mark run as shown, in a directory holding the repository's inputs."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "MPLBACKEND": "Agg"}
    # A session of its own: a block that starts a server and never ends is killed whole at the timeout.
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=workdir(tmp_path, block),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{block.where} still ran after 300 s: mark it <!-- not-run: REASON -->")
    result = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    assert result.returncode == 0, f"{block.where} exited {result.returncode}:\n{result.stderr[-3000:]}"


def _manifests(block: Block) -> list[dict[str, Any]]:
    return [
        d
        for d in yaml.safe_load_all(block.text)
        if isinstance(d, dict) and d.get("kind") == "InferenceDeployment"
    ]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "yaml" and _manifests(b)], ids=_ids)
def test_manifests_are_valid_and_routable(block: Block) -> None:
    """Every InferenceDeployment shown passes what the API server and the operator check, and its
    router starts: the operator would report no KVRouting issue (a missing tokenizer or KV capacity
    makes a TensorRT-LLM router exit at start-up)."""
    for document in _manifests(block):
        try:
            deployment = parse_deployment(document, source=block.where)
        except ManifestError as exc:
            pytest.fail(str(exc))
        assert routing_issues(deployment) == [], block.where


BASE_MANIFEST = {
    "apiVersion": "copse.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "fragment"},
    "spec": {"model": {"name": "m", "tensorParallelism": 8}, "replicas": 1, "engine": {"backend": "mock"}},
}
"""What a ``spec:`` fragment shown on its own is merged into before it is validated."""


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merged(base[key], value) if both else value
    return merged


FRAGMENTS = [
    b
    for b in BLOCKS
    if b.language == "yaml" and b.excerpt_of is None and list(yaml.safe_load(b.text) or {}) == ["spec"]
]


@pytest.mark.parametrize("block", FRAGMENTS, ids=_ids)
def test_spec_fragments_are_valid_in_a_manifest(block: Block) -> None:
    try:
        parse_deployment(_merged(BASE_MANIFEST, yaml.safe_load(block.text)), source=block.where)
    except ManifestError as exc:
        pytest.fail(str(exc))


EXCERPTS = [b for b in BLOCKS if b.excerpt_of is not None]


@pytest.mark.parametrize("block", EXCERPTS, ids=_ids)
def test_excerpts_are_what_the_file_holds(block: Block) -> None:
    """A part of an example shown on a page is the example's own (the example itself is validated
    and reconciled by the example tests)."""
    assert block.excerpt_of is not None
    documents = [d for d in yaml.safe_load_all((ROOT / block.excerpt_of).read_text()) if isinstance(d, dict)]
    shown = yaml.safe_load(block.text)
    assert any(_holds(document, shown) for document in documents), f"{block.where}: not in {block.excerpt_of}"


def _holds(actual: Any, shown: Any) -> bool:
    try:
        _contained(shown, actual, "")
    except AssertionError:
        return False
    return True


FOREIGN_CRDS = {
    "InferencePool": "charts/copse/files/inferencepool-crd.yaml",
    "HTTPRoute": "e2e/fixtures/httproute-crd.yaml",
}
"""Kinds of other projects the docs show, and the CRD (copied from their release) that defines each."""
FOREIGN = [
    (b, kind)
    for b in BLOCKS
    for kind in FOREIGN_CRDS
    if b.language == "yaml" and re.search(rf"^kind: {kind}$", b.text, re.MULTILINE)
]


@pytest.mark.parametrize(("block", "kind"), FOREIGN, ids=[f"{b.where}:{kind}" for b, kind in FOREIGN])
def test_other_projects_objects_match_their_crds(block: Block, kind: str) -> None:
    """An InferencePool shown is valid under the Gateway API Inference Extension's own CRD schema,
    an HTTPRoute under the Gateway API's."""
    crd = yaml.safe_load((ROOT / FOREIGN_CRDS[kind]).read_text())
    for document in yaml.safe_load_all(block.text):
        if not isinstance(document, dict) or document.get("kind") != kind:
            continue  # an empty document (a stray ---) is None
        version = document["apiVersion"].split("/")[1]
        (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        jsonschema.validate(document, served["schema"]["openAPIV3Schema"])


OUTPUTS = [b for b in BLOCKS if b.output_of is not None]


def _contained(shown: Any, actual: Any, where: str) -> None:
    """Everything the docs show is in the actual output, equal (lists may elide their tail)."""
    if isinstance(shown, dict):
        assert isinstance(actual, dict), where
        for key, value in shown.items():
            assert key in actual, f"{where}: {key} is not in the output"
            _contained(value, actual[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(actual, list), where
        assert len(shown) <= len(actual), where
        for index, item in enumerate(shown):
            _contained(item, actual[index], f"{where}[{index}]")
    else:
        assert shown == actual, f"{where}: the docs show {shown!r}, the command prints {actual!r}"


@pytest.mark.parametrize("block", OUTPUTS, ids=_ids)
def test_shown_output_is_what_the_command_prints(block: Block, tmp_path: Path) -> None:
    assert block.output_of is not None
    args = shlex.split(block.output_of)
    assert copse_args(args) is not None, f"{block.where}: output-of must be a copse command"
    result = subprocess.run(
        [COPSE, *args[1:]],
        cwd=workdir(tmp_path, block),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{block.where}: {result.stderr[-3000:]}"
    shown = json.loads(re.sub(r",\s*\.\.\.", "", block.text))
    _contained(shown, json.loads(result.stdout), block.where)


def test_every_yaml_block_parses() -> None:
    for block in (b for b in BLOCKS if b.language == "yaml"):
        try:
            list(yaml.safe_load_all(block.text))
        except yaml.YAMLError as exc:
            pytest.fail(f"{block.where}: {exc}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=_ids)
def test_python_blocks_compile(block: Block) -> None:
    ast.parse(block.text, filename=block.where)
