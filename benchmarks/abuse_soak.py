"""Abuse soak of the serving path: a normal streaming load with malformed, huge, slow and abandoned
requests mixed in, against real processes on loopback (``copse worker mock``, ``copse router run``
and ``copse worker kv-relay`` with a throwaway NATS), :mod:`copse.sim.abuse`.

Two rounds in one run, on the same machine: the good clients alone (``--abusers 0``), then with the
abusers; it prints per round the requests tried by kind, the good requests that failed (the target
is 0), the abusive requests answered with a 5xx or a dropped connection (target 0), the good
streams completed per second, and every process's peak RSS; then the ratios of the abused round to
the clean one (good streams per second, peak RSS).

Usage: ``.venv/bin/python benchmarks/abuse_soak.py [--duration 60] [--good-clients 8]
[--abusers 8] [--max-requests 20000] [--seed 0] [--kinds malformed,huge,slow,abandoned]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from copse.sim.abuse import ABUSES, SoakReport, serving, soak
from copse.workers.testing import nats_server

MIB = 1024 * 1024


def _round(
    args: argparse.Namespace, *, abusers: int, nats_url: str
) -> tuple[SoakReport, dict[str, int], float]:
    workdir = Path(tempfile.mkdtemp(prefix="abuse-soak-"))
    print(f"   (logs of the processes: {workdir})")
    with serving(workdir=workdir, engine_args=("--speedup", "20"), nats_url=nats_url) as served:
        started = time.monotonic()
        report = asyncio.run(
            soak(
                served,
                duration_s=args.duration,
                good_clients=args.good_clients,
                abusers=abusers,
                max_requests=args.max_requests,
                seed=args.seed,
                kinds=tuple(args.kinds.split(",")),
            )
        )
        return report, dict(served.peak_rss), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--good-clients", type=int, default=8)
    parser.add_argument("--abusers", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", default=",".join(ABUSES), help="abusive requests drawn from (comma-separated)"
    )
    args = parser.parse_args()
    rounds = {}
    with nats_server() as nats_url:
        for name, abusers in (("clean", 0), ("abused", args.abusers)):
            report, peaks, elapsed = _round(args, abusers=abusers, nats_url=nats_url)
            good = report.tried["good"] - len(report.good_failed)
            rounds[name] = (good / elapsed, peaks)
            print(f"== {name}: {args.good_clients} good clients, {abusers} abusers, {elapsed:.1f} s")
            print(f"   tried {report.total}: {dict(sorted(report.tried.items()))}")
            print(f"   abusive answers: {dict(sorted(report.statuses.items()))}")
            print(f"   good requests failed: {len(report.good_failed)} {report.good_failed[:3]}")
            errors = report.server_errors
            kinds = sorted(set(errors))[:5]
            print(f"   abusive requests with a 5xx or a dropped connection: {len(errors)} {kinds}")
            print(f"   good streams/s: {good / elapsed:.1f}")
            print("   peak RSS: " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in sorted(peaks.items())))
    (clean_rate, clean_rss), (abused_rate, abused_rss) = rounds["clean"], rounds["abused"]
    print(f"abused/clean good streams per second: {abused_rate / clean_rate:.2f}")
    for name in sorted(clean_rss):
        print(f"abused/clean peak RSS of {name}: {abused_rss[name] / clean_rss[name]:.2f}")


if __name__ == "__main__":
    main()
