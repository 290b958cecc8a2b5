"""The Grafana dashboard's panels, rendered without Grafana: its queries evaluated over a recorded
scrape of a live fleet, drawn with matplotlib in the dashboard's own grid.

Recording (``python -m tests.docs.dashboard record``, about two minutes): ``copse worker mock``
engines and ``copse router run`` on free ports of 127.0.0.1, requests sent at a rate that rises
and falls, the router's ``/metrics`` and every engine's ``/prometheus/metrics`` scraped at a fixed
interval, each target's samples labelled as the chart's PodMonitor labels them. Rendering
(``python -m tests.docs.dashboard render``) writes ``docs/screenshots/dashboard.png`` from the
recording in ``tests/fixtures/``. ``make docs-screenshot`` does both.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from matplotlib.figure import Figure
from prometheus_client.parser import text_string_to_metric_families
from tests.docs.fleet import local_fleet
from tests.planner.promql_subset import Sample, evaluate_vector

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "copse" / "dashboards" / "copse.json"
RECORDING = ROOT / "tests" / "fixtures" / "dashboard-scrapes.json.gz"
SCREENSHOT = ROOT / "docs" / "screenshots" / "dashboard.png"
NAMESPACE, DEPLOYMENT, MODEL = "serving", "llama-8b", "meta-llama/Llama-3.1-8B-Instruct"
RATE_WINDOW_S = 15.0
"""What ``$__rate_interval`` stands for: rates are taken over this much of the recording."""


@dataclass(frozen=True)
class Scrape:
    at_s: float
    """Seconds since the recording started."""
    samples: list[Sample]


def parse_exposition(text: str, target: Mapping[str, str]) -> list[Sample]:
    """A scrape's samples with the target labels the chart's PodMonitor adds."""
    return [
        (sample.name, {**sample.labels, **target}, float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _targets(router_url: str, engine_urls: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    common = {"namespace": NAMESPACE, "deployment": DEPLOYMENT}
    found = [(f"{router_url}/metrics", {**common, "component": "router", "pod": f"{DEPLOYMENT}-router-0"})]
    for index, url in enumerate(engine_urls):
        labels = {**common, "component": "worker", "role": "worker", "pod": f"{DEPLOYMENT}-worker-{index}-0"}
        found.append((f"{url}/prometheus/metrics", labels))
    return found


def _prompt(rng: random.Random, documents: Sequence[str]) -> list[dict[str, str]]:
    """A chat sharing one of a few long system prompts (so prefixes repeat), and a short question."""
    question = " ".join(rng.choice(("how", "why", "when", "where", "which", "what")) for _ in range(12))
    return [{"role": "system", "content": rng.choice(documents)}, {"role": "user", "content": question}]


async def _stream(client: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> None:
    """One streamed request, read to its end (the router times the first token and every gap)."""
    async with client.stream("POST", url, json=body) as response:
        async for _ in response.aiter_lines():
            pass


async def _traffic(url: str, *, duration_s: float, peak_rps: float, seed: int) -> None:
    """Requests at a rate rising from a quarter of ``peak_rps`` to the peak and back (Poisson)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(500)]
    documents = [" ".join(rng.choice(words) for _ in range(600)) for _ in range(6)]
    started = time.monotonic()
    pending: set[asyncio.Task[Any]] = set()
    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=None)) as client:
        while (elapsed := time.monotonic() - started) < duration_s:
            rate = peak_rps * (0.25 + 0.75 * math.sin(math.pi * elapsed / duration_s) ** 2)
            body = {
                "model": MODEL,
                "messages": _prompt(rng, documents),
                "max_tokens": rng.randint(16, 128),
                "stream": True,
            }
            task = asyncio.create_task(_stream(client, f"{url}/v1/chat/completions", body))
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*pending, return_exceptions=True)


async def _scrape_loop(
    targets: Sequence[tuple[str, dict[str, str]]], *, duration_s: float, interval_s: float
) -> list[Scrape]:
    scrapes: list[Scrape] = []
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10.0) as client:
        while (elapsed := time.monotonic() - started) <= duration_s:
            samples: list[Sample] = []
            for url, labels in targets:
                response = await client.get(url)
                response.raise_for_status()
                samples += parse_exposition(response.text, labels)
            scrapes.append(Scrape(at_s=round(elapsed, 3), samples=samples))
            await asyncio.sleep(max(0.0, interval_s * len(scrapes) - (time.monotonic() - started)))
    return scrapes


def record(
    *, duration_s: float = 120.0, interval_s: float = 3.0, engines: int = 4, peak_rps: float = 6.0
) -> list[Scrape]:
    """Run a fleet on loopback under load and scrape it (see the module's docstring)."""
    with local_fleet(model=MODEL, engines=engines) as fleet:

        async def run() -> list[Scrape]:
            traffic = asyncio.create_task(
                _traffic(fleet.router_url, duration_s=duration_s, peak_rps=peak_rps, seed=0)
            )
            scrapes = await _scrape_loop(
                _targets(fleet.router_url, fleet.engine_urls), duration_s=duration_s, interval_s=interval_s
            )
            await traffic
            return scrapes

        return asyncio.run(run())


def save(scrapes: Sequence[Scrape], path: Path = RECORDING) -> None:
    rows = [
        {"at_s": s.at_s, "samples": [[n, dict(labels), v] for n, labels, v in s.samples]} for s in scrapes
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(rows, separators=(",", ":")).encode(), mtime=0))


def load(path: Path = RECORDING) -> list[Scrape]:
    rows = json.loads(gzip.decompress(path.read_bytes()))
    return [
        Scrape(at_s=row["at_s"], samples=[(n, labels, v) for n, labels, v in row["samples"]]) for row in rows
    ]


# Rendering ---------------------------------------------------------------------------------------


def panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included, in the dashboard's order."""
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def concrete(expr: str) -> str:
    """The query with the dashboard's variables set: every namespace and deployment, the rate window."""
    return (
        expr.replace("$namespace", ".*")
        .replace("$deployment", ".*")
        .replace("$__rate_interval", f"{int(RATE_WINDOW_S)}s")
    )


def legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def panel_series(panel: Mapping[str, Any], scrapes: Sequence[Scrape]) -> dict[str, list[tuple[float, float]]]:
    """Legend -> (seconds, value) points of each of the panel's queries over the recording."""
    step = scrapes[1].at_s - scrapes[0].at_s if len(scrapes) > 1 else RATE_WINDOW_S
    back = max(1, round(RATE_WINDOW_S / step))
    series: dict[str, list[tuple[float, float]]] = {}
    for target in panel.get("targets", []):
        query = concrete(target["expr"])
        for index in range(back, len(scrapes)):
            vector = evaluate_vector(query, scrapes[index].samples, earlier=scrapes[index - back].samples)
            for labels, value in vector:
                if math.isfinite(value):
                    name = legend(target.get("legendFormat", ""), labels) or query
                    series.setdefault(name, []).append((scrapes[index].at_s, value))
    return series


_BACKGROUND, _PANEL, _TEXT, _GRID = "#111217", "#181b1f", "#ccccdc", "#2c3036"


def render(scrapes: Sequence[Scrape], out: Path, dashboard_path: Path = DASHBOARD) -> dict[str, int]:
    """Draw every panel in its grid position; returns panel title -> series drawn."""
    dashboard = json.loads(dashboard_path.read_text())
    laid_out = panels(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in laid_out)
    header = 2.0
    height = rows + header
    figure = Figure(figsize=(24, height * 0.55), facecolor=_BACKGROUND)
    figure.text(
        0.01,
        1 - 0.9 / height,
        f"{dashboard.get('title', 'copse')}: rendered by tests/docs/dashboard.py from a recorded scrape of "
        "mocked engines behind copse's router (not a Grafana screenshot)",
        color=_TEXT,
        fontsize=13,
        va="center",
    )
    drawn: dict[str, int] = {}
    for panel in laid_out:
        grid = panel["gridPos"]
        left, width = grid["x"] / 24, grid["w"] / 24
        top = 1 - (grid["y"] + header) / height
        if panel.get("type") == "row":
            figure.text(
                left + 0.005, top - 0.5 / height, panel["title"], color=_TEXT, fontsize=12, weight="bold"
            )
            continue
        axes = figure.add_axes(
            (
                left + 0.025,
                top - grid["h"] / height + 0.9 / height,
                width - 0.035,
                grid["h"] / height - 1.5 / height,
            )
        )
        axes.set_facecolor(_PANEL)
        axes.set_title(panel["title"], color=_TEXT, fontsize=10, loc="left")
        axes.tick_params(colors=_TEXT, labelsize=7)
        axes.set_xlabel("seconds into the recording", color=_TEXT, fontsize=7)
        for spine in axes.spines.values():
            spine.set_color(_GRID)
        axes.grid(color=_GRID, linewidth=0.5)
        series = panel_series(panel, scrapes)
        drawn[panel["title"]] = len(series)
        for name, points in sorted(series.items())[:12]:
            axes.plot([t for t, _ in points], [v for _, v in points], linewidth=1.2, label=name)
        if series:
            axes.legend(fontsize=6, loc="upper left", facecolor=_PANEL, edgecolor=_GRID, labelcolor=_TEXT)
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            if unit:
                axes.set_ylabel(unit, color=_TEXT, fontsize=7)
        else:
            axes.text(0.5, 0.5, "No data", color=_TEXT, ha="center", va="center", transform=axes.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=60, facecolor=_BACKGROUND)
    return drawn


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["record"]:
        save(record())
    elif argv[:1] == ["render"]:
        drawn = render(load(), SCREENSHOT)
        with_data = sum(1 for count in drawn.values() if count)
        print(f"wrote {SCREENSHOT.relative_to(ROOT)}: {with_data} of {len(drawn)} panels with data")
    else:
        raise SystemExit("usage: python -m tests.docs.dashboard record|render")


if __name__ == "__main__":
    main(sys.argv[1:])
