"""The GPU-free engine mocker: block manager, scheduler, engine core, discrete-event simulator,
and (in :mod:`.server`) the HTTP surface of ``trtllm-serve`` for many engines in one process."""

from copse.workers.mocker.blocks import BlockHolder, BlockManager
from copse.workers.mocker.config import ROLES, EngineConfig, Role
from copse.workers.mocker.engine import (
    Engine,
    EngineOverloaded,
    Request,
    RequestOutcome,
    RequestRejected,
    StepOutput,
)
from copse.workers.mocker.simulation import Simulator

__all__ = [
    "ROLES",
    "BlockHolder",
    "BlockManager",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "Request",
    "RequestOutcome",
    "RequestRejected",
    "Role",
    "Simulator",
    "StepOutput",
]
