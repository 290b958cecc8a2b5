"""What the router's HTTP proxy costs a client: the same streamed completions sent straight to the
mocked engines and through ``copse router run``, alternately, in one run.

Engines: ``copse worker mock`` (one process, ``--engines`` engines on loopback, decode slowed by
``--decode-speedup`` so that a stream's tokens come at the pace of a loaded GPU engine). Router:
``copse router run`` as its own process in front of them (static workers, ``round_robin``, no NATS),
so what the direct client does (round-robin over the engines) and what the router does pick the
same spread of load and only the proxy hop differs. Client: this process, ``--concurrency`` streams
in a closed loop (each sends its next request when the last one ended), every prompt distinct
(``--prompt-tokens`` random token ids), ``--max-tokens`` each; it reads the SSE lines and parses
nothing but the first one's arrival.

Per concurrency and path: TTFT and end-to-end latency (p50, p99) as the client sees them; the
router's added TTFT p50 (ms) and its end-to-end p50 as a ratio of the direct one; the router
process's CPU seconds and the streamed tokens/s per router core (tokens relayed / router CPU s).
Rounds alternate direct, router, direct, router... so both see the same machine load.

``--profile FILE`` also samples the router with ``py-spy`` (when installed) during one routed round
at the highest concurrency and prints where its time goes.

Usage: ``.venv/bin/python benchmarks/router_proxy.py [--concurrency 64,256] [--rounds 2]
[--requests-per-stream 4] [--engines 4] [--prompt-tokens 1024] [--max-tokens 128]
[--decode-speedup 0.25] [--profile /tmp/router.prof]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import yaml

MODEL = "proxy-bench"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(http: aiohttp.ClientSession, url: str, *, path: str, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}{path}") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} did not answer 200 within {deadline_s} s")


@contextlib.asynccontextmanager
async def _processes(args: argparse.Namespace) -> AsyncIterator[tuple[list[str], str, int]]:
    """The engines and the router; yields (engine URLs, router URL, router pid)."""
    base = _free_port()
    engines = subprocess.Popen(
        [
            sys.executable, "-m", "copse.cli", "worker", "mock",
            "--engines", str(args.engines), "--port-base", str(base), "--model", MODEL,
            "--decode-speedup-ratio", str(args.decode_speedup), "--max-num-seqs", "512",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.engines)]
    port = _free_port()
    config = {
        "model": MODEL,
        "engine": "mock",
        "port": port,
        "policy": "round_robin",
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "seed": 0,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        yaml.safe_dump(config, file)
    router = subprocess.Popen(
        [sys.executable, "-m", "copse.cli", "router", "run", "--config", file.name, "--log-level", "WARNING"]
    )
    try:
        async with aiohttp.ClientSession() as http:
            for url in urls:
                await _wait_ready(http, url, path="/health")
            await _wait_ready(http, f"http://127.0.0.1:{port}", path="/health")
        yield urls, f"http://127.0.0.1:{port}", router.pid
    finally:
        for process in (router, engines):
            process.send_signal(signal.SIGTERM)
        for process in (router, engines):
            process.wait(timeout=30)
        os.unlink(file.name)


async def _one(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, SSE data lines) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first = 0.0
    lines = 0
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if line.startswith(b"data:"):
                lines += 1
                if lines == 1:
                    first = time.perf_counter()
    return first - started, time.perf_counter() - started, lines


async def _round(
    targets: list[str],
    *,
    concurrency: int,
    per_stream: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    ramp_s: float = 2.0,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``concurrency`` closed-loop streams spread over ``targets`` in turn, started over ``ramp_s``;
    (TTFTs, e2es, lines, wall)."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    e2es: list[float] = []
    lines = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def stream(index: int) -> None:
            nonlocal lines
            await asyncio.sleep(ramp_s * index / concurrency)  # a ramp, not one burst of prefills
            for k in range(per_stream):
                prompt = [rng.randrange(1000, 100000) for _ in range(prompt_tokens)]
                target = targets[(index * per_stream + k) % len(targets)]
                ttft, e2e, count = await _one(http, target, prompt, max_tokens)
                ttfts.append(ttft)
                e2es.append(e2e)
                lines += count

        started = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
    return np.array(ttfts), np.array(e2es), lines, wall


def _py_spy() -> str:
    """``py-spy`` next to this interpreter (``pip install py-spy``), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    return found


def _profile_report(path: Path) -> None:
    """Share of the router's samples per function (self and inclusive), from py-spy's raw output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"\nrouter profile ({total} samples): self time")
    for frame, n in own.most_common(15):
        print(f"  {n / total:6.1%}  {frame}")
    print("inclusive, copse's frames")
    ours = [(frame, n) for frame, n in inclusive.most_common() if "router/" in frame or "protocol/" in frame]
    for frame, n in ours[:25]:
        print(f"  {n / total:6.1%}  {frame}")


async def main(args: argparse.Namespace) -> None:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    async with _processes(args) as (engines, router, router_pid):
        print(
            f"{args.engines} engines, prompts {args.prompt_tokens} tokens, {args.max_tokens} tokens out, "
            f"{args.requests_per_stream} requests per stream; load average {os.getloadavg()[0]:.1f}"
        )
        # warm both paths (connections, imports, JIT-free but first-call costs)
        await _round(engines, concurrency=8, per_stream=1, prompt_tokens=64, max_tokens=4, seed=1)
        await _round([router], concurrency=8, per_stream=1, prompt_tokens=64, max_tokens=4, seed=1)
        header = (
            f"{'streams':>7} {'path':<7} {'TTFT p50':>9} {'p99':>8} {'e2e p50':>9} {'p99':>8}"
            f" {'tokens/s':>9} {'router CPU s':>12} {'tok/s per router core':>22}"
        )
        print(header)
        summary = []
        for concurrency in concurrencies:
            results: dict[str, list[tuple[np.ndarray, np.ndarray, int, float, float]]] = {
                "direct": [],
                "router": [],
            }
            for round_ in range(args.rounds):
                for path, targets in (("direct", engines), ("router", [router])):
                    profiling = (
                        args.profile is not None
                        and path == "router"
                        and concurrency == concurrencies[-1]
                        and round_ == args.rounds - 1
                    )
                    spy = None
                    if profiling:
                        spy = subprocess.Popen(
                            [_py_spy(), "record", "-p", str(router_pid), "-r", "200",
                             "--format", "raw", "-o", str(args.profile), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        )  # fmt: skip
                    cpu = _cpu_s(router_pid)
                    ttft, e2e, lines, wall = await _round(
                        targets,
                        concurrency=concurrency,
                        per_stream=args.requests_per_stream,
                        prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens,
                        seed=round_,
                    )
                    used = _cpu_s(router_pid) - cpu
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(timeout=60)
                    results[path].append((ttft, e2e, lines, wall, used))
                    per_core = f"{lines / used:>22,.0f}" if path == "router" and used > 0 else f"{'':>22}"
                    print(
                        f"{concurrency:>7} {path:<7} {np.percentile(ttft, 50) * 1e3:>9.1f}"
                        f" {np.percentile(ttft, 99) * 1e3:>8.1f} {np.percentile(e2e, 50) * 1e3:>9.1f}"
                        f" {np.percentile(e2e, 99) * 1e3:>8.1f} {lines / wall:>9,.0f}"
                        f" {used if path == 'router' else float('nan'):>12.2f}{per_core}",
                        flush=True,
                    )
            pooled = {
                path: (
                    np.concatenate([r[0] for r in rows]),
                    np.concatenate([r[1] for r in rows]),
                    sum(r[2] for r in rows),
                    sum(r[4] for r in rows),
                )
                for path, rows in results.items()
            }
            d_ttft, d_e2e = (np.percentile(a, 50) * 1e3 for a in pooled["direct"][:2])
            r_ttft, r_e2e = (np.percentile(a, 50) * 1e3 for a in pooled["router"][:2])
            tokens, cpu = pooled["router"][2], pooled["router"][3]
            summary.append(
                f"{concurrency} streams: router adds {r_ttft - d_ttft:+.1f} ms to TTFT p50 "
                f"({r_ttft:.1f} vs {d_ttft:.1f} ms), end-to-end p50 x{r_e2e / d_e2e:.3f} "
                f"({r_e2e:.0f} vs {d_e2e:.0f} ms); {tokens / cpu:,.0f} streamed tokens per router CPU-second"
            )
        print("\n" + "\n".join(summary))
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.profile is not None and args.profile.exists():
        _profile_report(args.profile)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--concurrency", default="64,256", help="Comma-separated numbers of concurrent streams."
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="Rounds per path and concurrency (alternating)."
    )
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--decode-speedup",
        type=float,
        default=0.25,
        help="Engines' decode_speedup_ratio (<1: slower decode).",
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw profile of the router here.")
    asyncio.run(main(parser.parse_args()))
