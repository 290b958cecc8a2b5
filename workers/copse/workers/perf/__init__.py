"""The perf model shared by the mocker, the router and the planner (see :mod:`.model`)."""

from copse.workers.perf.interpolated import InterpolatedPerfModel
from copse.workers.perf.model import DecodePoint, PerfModel
from copse.workers.perf.polynomial import PolynomialPerfModel
from copse.workers.perf.profile import ProfileError, load_perf_model, load_profile, save_profile

__all__ = [
    "DecodePoint",
    "InterpolatedPerfModel",
    "PerfModel",
    "PolynomialPerfModel",
    "ProfileError",
    "load_perf_model",
    "load_profile",
    "save_profile",
]
