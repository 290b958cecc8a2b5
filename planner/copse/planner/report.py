"""Dry-run results for people: a table, a summary and a PNG plot."""

from __future__ import annotations

from pathlib import Path

from copse.api import Role
from copse.planner.dryrun import METHOD, DryRunResult, IntervalResult

#: Above this many intervals the table shows only scaling events and misses.
FULL_TABLE_ROWS = 48


def _clock(seconds: float) -> str:
    """Offset from the start of the replay as ``[Nd ]HH:MM``."""
    minutes = int(seconds // 60)
    days, minutes = divmod(minutes, 24 * 60)
    text = f"{minutes // 60:02d}:{minutes % 60:02d}"
    return f"{days}d {text}" if days else text


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def format_table(result: DryRunResult) -> str:
    """One line per interval (or per scaling event and miss, for long replays)."""
    rows = result.intervals
    shown: list[IntervalResult] = rows
    note = ""
    if len(rows) > FULL_TABLE_ROWS:
        shown = [row for row in rows if row.decision.changed or not row.slo_ok]
        note = (
            f"({len(rows)} intervals; showing the {len(shown)} with a scaling event or a miss; "
            "-o json for all)\n"
        )
    roles = result.limits.roles
    header = [
        "time",
        "requests",
        "predicted",
        *(role.value for role in roles),
        "GPUs",
        "est TTFT ms",
        "est ITL ms",
        "SLO",
    ]
    start = rows[0].timestamp
    lines = []
    for row in shown:
        lines.append(
            [
                _clock(row.timestamp - start),
                f"{row.num_requests:,.0f}",
                f"{row.predicted_num_requests:,.0f}",
                *(str(row.replicas[role]) for role in roles),
                str(row.gpus),
                _ms(row.est_ttft_ms),
                _ms(row.est_itl_ms),
                "ok" if row.slo_ok else "MISS",
            ]
        )
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
    text = [
        "  ".join(
            cell.rjust(width) if i else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in [header, *lines]
    ]
    return note + "\n".join(text)


def format_summary(result: DryRunResult) -> str:
    summary, limits = result.summary, result.limits
    static = ", ".join(f"{count} {role.value}" for role, count in summary.static_peak_replicas.items())
    ratio = summary.gpu_hours / summary.static_peak_gpu_hours if summary.static_peak_gpu_hours else 0.0
    return "\n".join(
        [
            f"{METHOD}: the capacity model's per-request shares and p99 per interval, no request "
            "simulated (copse bench planner simulates them)",
            f"SLO per request: TTFT <= {limits.ttft_ms:g} ms, mean inter-token gap <= {limits.itl_ms:g} ms",
            f"estimated SLO attainment: {summary.slo_attainment:.1%} of requests "
            f"(static peak deployment: {summary.static_slo_attainment:.1%}); "
            f"intervals with p99s within target: {summary.interval_attainment:.1%}",
            f"GPU-hours: {summary.gpu_hours:,.1f} planned vs {summary.static_peak_gpu_hours:,.1f} "
            f"static peak ({static}): {ratio:.2f}x",
            f"scaling events: {summary.scaling_events}",
        ]
    )


def plot(result: DryRunResult, path: Path) -> None:
    """Write a PNG: load actual vs predicted, replicas per pool, estimated TTFT and ITL vs targets."""
    import matplotlib  # noqa: PLC0415  (slow import: only when a plot is asked for)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows, limits = result.intervals, result.limits
    start = rows[0].timestamp
    hours = [(row.timestamp - start) / 3600 for row in rows]
    figure, axes = plt.subplots(4, 1, sharex=True, figsize=(11, 10), constrained_layout=True)
    load, pools, ttft, itl = axes
    load.plot(hours, [row.num_requests for row in rows], label="actual", color="black", linewidth=1)
    load.plot(
        hours,
        [row.predicted_num_requests for row in rows],
        label="predicted",
        color="tab:orange",
        linewidth=1,
    )
    load.set_ylabel("requests / interval")
    load.legend(loc="upper left")
    load.set_title(
        f"{METHOD}: SLO attainment {result.summary.slo_attainment:.1%} of requests, "
        f"GPU-hours {result.summary.gpu_hours:,.1f} "
        f"vs {result.summary.static_peak_gpu_hours:,.1f} static peak"
    )
    colours = {Role.PREFILL: "tab:blue", Role.DECODE: "tab:green", Role.WORKER: "tab:purple"}
    for role in limits.roles:
        pools.step(
            hours, [row.replicas[role] for row in rows], where="post", label=role.value, color=colours[role]
        )
    pools.set_ylabel("replicas serving")
    pools.legend(loc="upper left")
    misses = [hour for hour, row in zip(hours, rows, strict=True) if not row.slo_ok]
    for axis, values, target, name in (
        (ttft, [row.est_ttft_ms for row in rows], limits.ttft_ms, "TTFT"),
        (itl, [row.est_itl_ms for row in rows], limits.itl_ms, "ITL"),
    ):
        axis.plot(
            hours,
            [max(value, 1e-3) for value in values],
            color="tab:blue",
            linewidth=1,
            label=f"est {name} p99",
        )
        axis.axhline(target, color="tab:red", linestyle="--", linewidth=1, label="target")
        axis.set_yscale("log")
        axis.set_ylabel(f"{name} ms")
        for hour in misses:
            axis.axvline(hour, color="tab:red", alpha=0.08, linewidth=2)
        axis.legend(loc="upper left")
    itl.set_xlabel("hours since start")
    figure.savefig(path, dpi=100)
    plt.close(figure)
