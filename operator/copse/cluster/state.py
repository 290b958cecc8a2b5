"""The state file of a running cluster and the process checks built on it.

A PID alone can be reused by an unrelated process after ours died, so each record also
keeps the process start time (``/proc/<pid>/stat`` field 22); ``cluster down`` only signals
a PID whose start time still matches.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class ProcessRecord(BaseModel):
    """One component process the cluster started."""

    model_config = ConfigDict(frozen=True)

    pid: int
    """Process id, as returned by Popen."""
    start_ticks: int
    """Start time in clock ticks since boot; tells our process from a later one with the same PID."""


class ClusterState(BaseModel):
    """Everything ``cluster status``/``down`` and a reusing test session need to know."""

    model_config = ConfigDict(frozen=True)

    versions_key: str
    """Which binaries the cluster runs (the cache directory name)."""
    bin_dir: Path
    """Where kubectl and helm of the same release are."""
    kubeconfig: Path
    """Admin kubeconfig of this cluster."""
    apiserver_url: str
    """https://127.0.0.1:<port>."""
    ports: dict[str, list[int]]
    """Ports each component listens on, for ``status`` and for port clash messages."""
    processes: dict[str, ProcessRecord]
    """Started components, in start order."""

    def dumps(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    @classmethod
    def loads(cls, text: str) -> ClusterState:
        return cls.model_validate_json(text)


def parse_start_ticks(stat: str) -> int:
    """Field 22 (starttime) of a ``/proc/<pid>/stat`` line; the command name may contain spaces."""
    after_name = stat.rsplit(")", 1)[1].split()
    # after_name[0] is field 3 (state), so field 22 is at index 19.
    return int(after_name[19])


def process_start_ticks(pid: int) -> int | None:
    """The start time of a live process, or ``None`` if there is no such process (or it is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return None
    return parse_start_ticks(stat)


def record_for(pid: int) -> ProcessRecord:
    ticks = process_start_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"process {pid} is not running")
    return ProcessRecord(pid=pid, start_ticks=ticks)


def is_alive(record: ProcessRecord) -> bool:
    """True if the recorded process (not merely its PID) still runs."""
    return process_start_ticks(record.pid) == record.start_ticks


def read_state(path: Path) -> ClusterState | None:
    if not path.is_file():
        return None
    return ClusterState.loads(path.read_text())


def write_state(path: Path, state: ClusterState) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(state.dumps())
    partial.replace(path)
