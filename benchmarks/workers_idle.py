"""1,000 idle mocked engines in one process: memory per engine, start-up time, idle CPU, and that
every engine answers. Measured at 100 and at N engines side by side (fresh process each).

    .venv/bin/python benchmarks/workers_idle.py [--engines 1000] [--nats]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx

from copse.workers.mocker import EngineConfig
from copse.workers.testing import mock_fleet, nats_server


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def measure(engines: int, nats_url: str | None) -> dict[str, float]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * engines + 256)), hard))
    before = rss_mib()
    started = time.perf_counter()
    async with mock_fleet(engines=engines, config=EngineConfig(), nats_url=nats_url) as fleet:
        startup = time.perf_counter() - started
        after = rss_mib()
        cpu = time.process_time()
        await asyncio.sleep(5.0)  # idle on purpose: what do idle engines cost?
        idle_cpu = time.process_time() - cpu
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=30) as http:
            healthy = 0
            for url in fleet.urls:
                healthy += (await http.get(f"{url}/health")).status_code == 200
            reply = await http.post(
                f"{fleet.urls[-1]}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2}
            )
            reply.raise_for_status()
    return {
        "engines": engines,
        "rss_mib": after - before,
        "per_engine_kib": (after - before) * 1024 / engines,
        "startup_s": startup,
        "idle_cpu_s_per_5s": idle_cpu,
        "healthy": healthy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--nats", action="store_true", help="publish KV events to a local nats-server")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(asyncio.run(measure(args.child, args.nats_url))))
        return

    def run(engines: int, nats_url: str | None) -> dict[str, float]:
        command = [sys.executable, __file__, "--child", str(engines)]
        if nats_url:
            command += ["--nats-url", nats_url]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
        return result

    with nats_server() if args.nats else contextlib.nullcontext(None) as nats_url:
        small, large = run(100, nats_url), run(args.engines, nats_url)
    for result in (small, large):
        print(
            f"{result['engines']:>5.0f} engines{' + NATS' if args.nats else ''}: {result['rss_mib']:.0f} MiB"
            f" ({result['per_engine_kib']:.0f} KiB/engine), started in {result['startup_s']:.1f} s,"
            f" idle CPU {result['idle_cpu_s_per_5s']:.3f} s per 5 s, {result['healthy']:.0f} healthy"
        )
    print(
        f"per-engine memory, {large['engines']:.0f} vs 100 engines:"
        f" {large['per_engine_kib'] / small['per_engine_kib']:.2f}x"
    )


if __name__ == "__main__":
    main()
