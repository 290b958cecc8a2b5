"""The first requests the README and the docs show (curl and the ``openai`` client against
``http://127.0.0.1:8080/v1``) run against a real ``copse router run`` in front of a real
``copse worker mock`` process, serving the model the snippet names, on free ports."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from .fleet import local_fleet
from .snippets import SHELL_LANGUAGES, Block, all_blocks, commands

SHOWN_URL = "http://127.0.0.1:8080"
REQUESTS = [
    b for b in all_blocks() if f"{SHOWN_URL}/v1" in b.text and b.language in {*SHELL_LANGUAGES, "python"}
]


def model_of(block: Block) -> str:
    found: list[tuple[str, str]] = re.findall(r'"model":\s*"([^"]+)"|model="([^"]+)"', block.text)
    models = {name for pair in found for name in pair if name}
    assert len(models) == 1, f"{block.where}: one model per request block, got {models}"
    return models.pop()


@pytest.fixture(scope="module")
def routers() -> Iterator[dict[str, str]]:
    """Model name -> base URL of a router serving it over one mocked engine."""
    with ExitStack() as stack:
        yield {
            model: stack.enter_context(local_fleet(model=model)).router_url
            for model in sorted({model_of(block) for block in REQUESTS})
        }


def test_the_documents_show_curl_and_openai_requests() -> None:
    languages = {block.language for block in REQUESTS}
    assert "python" in languages
    assert languages & SHELL_LANGUAGES
    assert any(block.path.name == "README.md" for block in REQUESTS)


@pytest.mark.parametrize("block", REQUESTS, ids=lambda block: block.where)
def test_request_runs(block: Block, routers: dict[str, str]) -> None:
    url = routers[model_of(block)]
    if block.language == "python":
        result = subprocess.run(
            [sys.executable, "-c", block.text.replace(SHOWN_URL, url)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{block.where}:\n{result.stderr[-3000:]}"
        assert result.stdout.strip(), f"{block.where}: printed nothing"
        return
    curls = [command for command in commands(block.text) if command[0] == "curl"]
    assert curls, block.where
    for command in curls:
        result = subprocess.run(
            shlex.split(shlex.join(command).replace(SHOWN_URL, url)),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{block.where}: {result.stderr}"
        answer = json.loads(result.stdout)
        assert answer["choices"][0]["message"]["content"], f"{block.where}: {answer}"
