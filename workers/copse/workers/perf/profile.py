"""Reading and writing perf profiles (NPZ or JSON).

A profile holds the arrays NVIDIA Dynamo's profiler converter writes:

==========================  ==========  ===========================================================
key                         shape       meaning
==========================  ==========  ===========================================================
``prefill_isl``             ``[N]``     prompt lengths profiled, strictly increasing
``prefill_ttft_ms``         ``[N]``     TTFT of a lone request at each length, ms
``decode_active_kv_tokens`` ``[R]``     total KV tokens of the decode batch, strictly increasing
``decode_context_length``   ``[C]``     mean context length of the batch, strictly increasing
``decode_itl``              ``[R, C]``  ITL, ms
==========================  ==========  ===========================================================

and two optional scalars copse adds: ``max_kv_tokens`` (KV cache size in tokens; default: the
largest ``decode_active_kv_tokens``) and ``gpus_per_engine`` (tensor parallelism; default 1).
JSON files carry the same keys, arrays as (nested) lists.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from copse.workers.perf.interpolated import InterpolatedPerfModel
from copse.workers.perf.model import PerfModel
from copse.workers.perf.polynomial import PolynomialPerfModel

ARRAY_KEYS: tuple[str, ...] = (
    "prefill_isl",
    "prefill_ttft_ms",
    "decode_active_kv_tokens",
    "decode_context_length",
    "decode_itl",
)
_NDIM = {"decode_itl": 2}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


def _read_raw(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ProfileError(f"{path}: expected a JSON object with keys {', '.join(ARRAY_KEYS)}")
        return raw
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ProfileError(f"{path}: not a readable NPZ file ({exc}); use .json for JSON profiles") from exc


def _array(path: Path, raw: dict[str, Any], key: str) -> np.ndarray:
    if key not in raw:
        raise ProfileError(f"{path}: missing array {key!r}")
    try:
        array = np.asarray(raw[key], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: {key} is not numeric ({exc})") from exc
    ndim = _NDIM.get(key, 1)
    if array.ndim != ndim:
        raise ProfileError(f"{path}: {key} must have {ndim} dimension(s), has shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ProfileError(f"{path}: {key} holds non-finite values")
    return array


def _scalar(path: Path, raw: dict[str, Any], key: str) -> int | None:
    if key not in raw:
        return None
    value = np.asarray(raw[key])
    if value.size != 1 or not np.isfinite(value.astype(np.float64)).all() or float(value) < 1:
        raise ProfileError(f"{path}: {key} must be a single number >= 1, got {raw[key]!r}")
    return int(value)


def load_profile(
    path: str | Path, *, gpus_per_engine: int | None = None, kv_capacity_tokens: int | None = None
) -> InterpolatedPerfModel:
    """Load a profile (``.json``, anything else read as NPZ) into an :class:`InterpolatedPerfModel`.

    ``gpus_per_engine`` and ``kv_capacity_tokens`` override the values stored in the file.
    Raises :class:`ProfileError` naming the file and field for any unusable content.
    """
    path = Path(path)
    raw = _read_raw(path)
    arrays = {key: _array(path, raw, key) for key in ARRAY_KEYS}
    capacity = kv_capacity_tokens or _scalar(path, raw, "max_kv_tokens")
    if capacity is None:
        capacity = int(arrays["decode_active_kv_tokens"].max())
    gpus = gpus_per_engine or _scalar(path, raw, "gpus_per_engine") or 1
    try:
        return InterpolatedPerfModel(
            prefill_isl=tuple(arrays["prefill_isl"].tolist()),
            prefill_ttft_ms=tuple(arrays["prefill_ttft_ms"].tolist()),
            decode_active_kv_tokens=tuple(arrays["decode_active_kv_tokens"].tolist()),
            decode_context_length=tuple(arrays["decode_context_length"].tolist()),
            decode_itl=tuple(tuple(row) for row in arrays["decode_itl"].tolist()),
            kv_capacity_tokens=capacity,
            gpus_per_engine=gpus,
        )
    except ValueError as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def _grid(low: float, high: float, points: int) -> np.ndarray:
    return np.unique(np.linspace(low, high, points).round())


def save_profile(
    model: PerfModel,
    path: str | Path,
    *,
    max_context_length: int = 131072,
    points: int = 100,
) -> None:
    """Sample ``model`` on a ``points``-point prefill grid and a ``points`` x ``points`` decode grid
    and write it as a profile (``.json`` by suffix, NPZ otherwise) that :func:`load_profile` reads.

    Prompt and context lengths span up to ``max_context_length`` (capped by the KV capacity);
    active KV tokens span the whole cache.
    """
    if points < 2:
        raise ValueError(f"points={points} must be at least 2")
    longest = min(max_context_length, model.kv_capacity_tokens)
    isl = _grid(1, longest, points)
    active = _grid(1, model.kv_capacity_tokens, points)
    context = _grid(1, longest, points)
    data: dict[str, Any] = {
        "prefill_isl": isl,
        "prefill_ttft_ms": np.array([model.prefill_curve_ms(float(x)) for x in isl]),
        "decode_active_kv_tokens": active,
        "decode_context_length": context,
        "decode_itl": np.array(
            [
                [model.decode_itl_ms(active_kv_tokens=float(a), context_length=float(c)) for c in context]
                for a in active
            ]
        ),
        "max_kv_tokens": np.int64(model.kv_capacity_tokens),
        "gpus_per_engine": np.int64(model.gpus_per_engine),
    }
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps({key: np.asarray(value).tolist() for key, value in data.items()}))
    else:
        with path.open("wb") as handle:
            np.savez(handle, **data)


def load_perf_model(
    profile: str | Path | None, *, gpus_per_engine: int | None = None, kv_capacity_tokens: int | None = None
) -> PerfModel:
    """The default :class:`PolynomialPerfModel` when ``profile`` is ``None``, else :func:`load_profile`;
    ``gpus_per_engine`` and ``kv_capacity_tokens`` override the model's own values when given."""
    if profile is not None:
        return load_profile(profile, gpus_per_engine=gpus_per_engine, kv_capacity_tokens=kv_capacity_tokens)
    overrides: dict[str, int] = {}
    if gpus_per_engine is not None:
        overrides["gpus_per_engine"] = gpus_per_engine
    if kv_capacity_tokens is not None:
        overrides["kv_capacity_tokens"] = kv_capacity_tokens
    return PolynomialPerfModel(**overrides)
