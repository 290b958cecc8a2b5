"""The perf model shared by the mocker, the router and the planner (see :mod:`.model`)."""

from copse.workers.perf.interpolated import InterpolatedPerfModel
from copse.workers.perf.model import DecodePoint, PerfModel
from copse.workers.perf.polynomial import PolynomialPerfModel
from copse.workers.perf.profile import ProfileError, load_perf_model, load_profile, save_profile
from copse.workers.perf.tiers import DISK, GPU, HOST, TIER_NAMES, KvOffload

__all__ = [
    "DISK",
    "GPU",
    "HOST",
    "TIER_NAMES",
    "DecodePoint",
    "InterpolatedPerfModel",
    "KvOffload",
    "PerfModel",
    "PolynomialPerfModel",
    "ProfileError",
    "load_perf_model",
    "load_profile",
    "save_profile",
]
