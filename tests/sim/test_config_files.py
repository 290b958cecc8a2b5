"""The router's, the planner's and the replay's config files are read by one reader: the same
errors, in the same words, naming the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from copse.planner.config import ConfigError as PlannerConfigError
from copse.planner.config import load_config as load_planner_config
from copse.router.config import ConfigError as RouterConfigError
from copse.router.config import load_config as load_router_config
from copse.sim.replay import EngineConfigError, load_engine_setup

Loader = tuple[Callable[[Path], object], type[Exception], str]
LOADERS: list[Loader] = [
    (load_router_config, RouterConfigError, "router settings"),
    (load_planner_config, PlannerConfigError, "planner settings"),
    (load_engine_setup, EngineConfigError, "engine settings"),
]


@pytest.mark.parametrize("loader", LOADERS, ids=["router", "planner", "engines"])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "{path}: cannot read (No such file or directory)"),
        ("a: [1,\n", "{path}: not valid YAML ("),
        ("- 1\n- 2\n", "{path}: expected a mapping of {what}, got a list"),
    ],
)
def test_a_bad_config_file_is_named_with_one_wording(
    tmp_path: Path, loader: Loader, content: str | None, message: str
) -> None:
    load, error, what = loader
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(error) as raised:
        load(path)
    assert str(raised.value).startswith(message.format(path=path, what=what))
