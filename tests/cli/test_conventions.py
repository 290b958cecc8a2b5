"""One convention across every ``copse`` command (docs/reference/conventions.md): an Examples
section whose commands parse, one spelling per concept (old ones hidden, warning), ``-o/--output``
for printed output, ``-n`` for namespaces, exit codes 0/1/2, and ``--version``."""

from __future__ import annotations

import glob
import json
import re
import shlex
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from copse.cli import main
from copse.sim import faults
from copse.workers.conventions import OUTPUTS

REPO = Path(__file__).resolve().parents[2]
SLICE = REPO / "examples" / "traces" / "mooncake-conversation-first-20min.jsonl.gz"
#: Spellings that were renamed: none may be visible in any command's --help.
OLD_SPELLINGS = {
    "--nats-url",
    "--speedup-ratio",
    "--decode-speedup-ratio",
    "--json",
    "--profile",
    "--format",
    "--dry-run",
}


def _commands() -> Iterator[tuple[str, click.Command]]:
    """Every command and group under ``copse``, by its full name."""

    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
        yield path, command
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=path)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                yield from walk(sub, f"{path} {name}")

    yield from walk(main, "copse")


COMMANDS = dict(_commands())
LEAVES = {name: command for name, command in COMMANDS.items() if not isinstance(command, click.Group)}


def _help(name: str) -> str:
    result = CliRunner().invoke(main, [*name.split()[1:], "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def _examples(text: str) -> list[str]:
    """The example command lines of a --help text (continuation lines joined)."""
    _, found, section = text.partition("Examples:\n")
    assert found, "no Examples section"
    lines: list[str] = []
    for raw in section.splitlines():
        if not raw.startswith("    "):
            break
        line = raw.strip()
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line
        else:
            lines.append(line)
    return lines


def _copse_invocations(line: str) -> list[list[str]]:
    """The ``copse`` commands in one example line (shell around them, e.g. ``eval "$(...)"``, left out)."""
    invocations = []
    for segment in re.findall(r"copse(?: [^\"$()&|>]*)?", line):
        words = []
        for word in shlex.split(segment)[1:]:
            words += sorted(glob.glob(word, root_dir=REPO)) if "*" in word else [word]
        invocations.append(words)
    return invocations


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_examples_that_parse(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the examples name files under examples/
    examples = _examples(_help(name))
    assert examples, f"{name}: an empty Examples section"
    for line in examples:
        invocations = _copse_invocations(line)
        assert invocations, f"{name}: example {line!r} runs no copse command"
        for words in invocations:
            command: click.Command = main
            parent, ctx, word = None, click.Context(main, info_name="copse"), "copse"
            while isinstance(command, click.Group) and words and not words[0].startswith("-"):
                word = words.pop(0)
                sub = command.get_command(ctx, word)
                assert sub is not None, f"{name}: example {line!r}: no command {word!r}"
                parent, command = ctx, sub
                ctx = click.Context(sub, info_name=word, parent=parent)
            # Parses and converts every option (types, ranges, required ones) without running.
            with command.make_context(word, words, parent=parent):
                pass


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_one_spelling_per_concept(name: str) -> None:
    for param in LEAVES[name].params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        spellings = set(param.opts) | set(param.secondary_opts)
        assert not spellings & OLD_SPELLINGS, f"{name}: {param.opts} is an old spelling"
        if "--namespace" in spellings:
            assert "-n" in spellings, f"{name}: --namespace without -n"
        if "--output" in spellings:
            assert "-o" in spellings, f"{name}: --output without -o"
            assert isinstance(param.type, click.Choice), f"{name}: --output names a format, not a file"
            assert set(param.type.choices) <= set(OUTPUTS)


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"copse {version('copse')}\n"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--json"], ["-o", "json"]),
        (["--format", "mooncake"], ["--trace-format", "mooncake"]),
    ],
)
def test_an_old_spelling_still_works_warns_and_hides(old: list[str], new: list[str]) -> None:
    replay = ["bench", "replay", "--trace", str(SLICE), "--workers", "2", "--limit", "10", "-o", "json"]
    reference = CliRunner().invoke(main, [*replay, *new])
    before = CliRunner().invoke(main, [*replay[:-2], *old] if old == ["--json"] else [*replay, *old])
    assert before.exit_code == reference.exit_code == 0, before.output
    assert json.loads(before.stdout) == json.loads(reference.stdout)
    assert f"warning: {old[0]} is deprecated and goes in copse 0.2: use {new[0]}" in before.stderr
    assert old[0] + " " not in _help("copse bench replay")


def test_both_spellings_at_once_are_a_usage_error() -> None:
    result = CliRunner().invoke(
        main, ["synth", "--trace", str(SLICE), "--speedup", "2", "--speedup-ratio", "3"]
    )
    assert result.exit_code == 2
    assert "--speedup-ratio is the old spelling of --speedup: give --speedup only" in result.output


def test_renamed_values_reach_the_command(tmp_path: Path) -> None:
    out = tmp_path / "synthetic.jsonl"
    result = CliRunner().invoke(
        main,
        ["synth", "--trace", str(SLICE), "--num-requests", "5", "--speedup-ratio", "2", "--output", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 5
    assert "warning: --output is deprecated" in result.stderr


@pytest.mark.parametrize("output", OUTPUTS)
def test_output_formats_hold_the_same_fields(output: str) -> None:
    args = ["placement", "plan", "--nodes", str(REPO / "examples" / "nodes-2-racks.yaml")]
    args += ["--deployment", str(REPO / "examples" / "seed-inferencedeployment.yaml"), "-o", output]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    if output == "table":
        assert "2 of 2 groups placed" in result.stdout
        return
    data = json.loads(result.stdout) if output == "json" else yaml.safe_load(result.stdout)
    assert data["feasible"] is True


def test_an_invalid_manifest_exits_1_and_a_usage_error_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: copse.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: x}\nspec: {}\n"
    )
    invalid = CliRunner().invoke(main, ["api", "validate", str(bad)])
    assert invalid.exit_code == 1, invalid.output
    assert str(bad) in invalid.stderr
    usage = CliRunner().invoke(main, ["api", "validate", "--no-such-option", str(bad)])
    assert usage.exit_code == 2


def test_bench_faults_exits_1_when_a_stream_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from copse.sim import fault_suite  # noqa: PLC0415

    def result(scenario: str, failed: int) -> faults.ScenarioResult:
        return faults.ScenarioResult(
            scenario=scenario,
            streams=4,
            completed=4 - failed,
            token_exact=4 - failed,
            failed=failed,
            broken=0,
            migrations={},
            max_gap_s=0.1,
            wall_s=1.0,
        )

    outcomes = {"engine-kill": 0}

    async def run_suite(settings: object, chosen: tuple[str, ...], *, progress: object) -> list[object]:
        return [result("none", 0), *(result(name, outcomes[name]) for name in chosen)]

    monkeypatch.setattr(fault_suite, "run_suite", run_suite)
    passed = CliRunner().invoke(main, ["bench", "faults", "--scenario", "engine-kill"])
    assert passed.exit_code == 0, passed.output
    outcomes["engine-kill"] = 2
    failed = CliRunner().invoke(main, ["bench", "faults", "--scenario", "engine-kill", "-o", "json"])
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)[1]["failed"] == 2, "the report is printed before the exit"
    assert "error: streams failed: 2 in engine-kill" in failed.stderr


def test_bench_help_says_what_the_group_holds() -> None:
    text = _help("copse bench")
    for command in ("replay", "planner", "faults", "moe-workload"):
        assert command in text
    assert "Benchmarks of routing policies" not in text
