"""The dashboard picture in the docs is the dashboard's own queries over a recorded scrape of a
live fleet (tests/docs/dashboard.py): every query evaluates, and the router and engine panels draw
what the recording holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tests.planner.promql_subset import evaluate_vector

from .dashboard import DASHBOARD, RECORDING, SCREENSHOT, Scrape, concrete, load, panel_series, panels, render

FLEET_ROWS = ("Requests", "Engines")
"""Rows whose panels a fleet of engines behind a router fills (the planner and operator do not run)."""


@pytest.fixture(scope="module")
def scrapes() -> list[Scrape]:
    return load(RECORDING)


def fleet_panels() -> list[dict[str, object]]:
    found, row = [], ""
    for panel in panels(json.loads(DASHBOARD.read_text())):
        if panel.get("type") == "row":
            row = str(panel["title"])
        elif row.startswith(FLEET_ROWS):
            found.append(panel)
    return found


def test_the_recording_is_a_run_of_scrapes(scrapes: list[Scrape]) -> None:
    assert len(scrapes) >= 20
    times = [scrape.at_s for scrape in scrapes]
    assert times == sorted(times)
    names = {name for name, _, _ in scrapes[-1].samples}
    assert "copse_router_requests_total" in names
    assert "trtllm_time_to_first_token_seconds_bucket" in names


def test_every_query_evaluates(scrapes: list[Scrape]) -> None:
    for panel in panels(json.loads(DASHBOARD.read_text())):
        for target in panel.get("targets", []):
            evaluate_vector(concrete(target["expr"]), scrapes[-1].samples, earlier=scrapes[0].samples)


@pytest.mark.parametrize("panel", fleet_panels(), ids=lambda panel: str(panel["title"]))
def test_fleet_panels_have_data(panel: dict[str, object], scrapes: list[Scrape]) -> None:
    series = panel_series(panel, scrapes)
    assert series, f"{panel['title']}: no series"
    for points in series.values():
        assert all(math.isfinite(value) for _, value in points)
    assert max(len(points) for points in series.values()) >= len(scrapes) // 2


def test_request_rate_follows_the_load_it_was_given(scrapes: list[Scrape]) -> None:
    """The recording's load rises and falls: the drawn request rate peaks mid-way."""
    (rate,) = panel_series(next(p for p in fleet_panels() if p["title"] == "Request rate"), scrapes).values()
    values = [value for _, value in rate]
    peak = values.index(max(values))
    assert len(values) // 5 < peak < 4 * len(values) // 5
    assert max(values) > 1.5 * min(values[0], values[-1])


def test_render_draws_every_panel(scrapes: list[Scrape], tmp_path: Path) -> None:
    out = tmp_path / "dashboard.png"
    drawn = render(scrapes, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(drawn[str(panel["title"])] for panel in fleet_panels())
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
