"""The routing decision's inner loops in Python and numpy: what ``_native.c`` computes, for a
machine where the extension cannot be built (or ``COPSE_ROUTER_NATIVE=0``, see
:mod:`copse.router.loops`).

Same decisions, slower: the block table is a dict of slot bitmasks, the load table a dict of
reference counts keyed as the compiled one keys them, and the arithmetic is the numpy formulation
the compiled loops replaced, operation for operation (so every float is the same to the bit).
Arguments are checked as the compiled module checks them, with the same errors.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import SupportsIndex, cast

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]

LOAD_ROWS = (
    "requests",
    "prefilling",
    "prefill_tokens",
    "prefill_ms",
    "active_blocks",
    "kv_extra",
    "kv",
    "head_start",
    "head_ms",
    "step_ms",
    "free",
)
(
    _REQUESTS,
    _PREFILLING,
    _PREFILL_TOKENS,
    _PREFILL_MS,
    _ACTIVE_BLOCKS,
    _KV_EXTRA,
    _KV,
    _HEAD_START,
    _HEAD_MS,
    _STEP_MS,
    _FREE,
) = range(len(LOAD_ROWS))

_MAX_SLOTS = 1 << 16
_LOWER_TIERS = 2
"""Cache tiers below the GPU (1: host memory, 2: disk), as the compiled index numbers them."""
_U64 = 1 << 64
_BATCH = 32
"""Hashes converted ahead of the prefix walk (a bad hash within a batch is refused even if the
walk stops before it, as in the compiled walk)."""


def _key(item: object) -> int:
    value = item if type(item) is int else operator.index(cast(SupportsIndex, item))
    if not 0 <= value < _U64:
        raise ValueError(f"block hash {item!r} is not an unsigned 64-bit integer")
    return value


def _keys(hashes: Iterable[int]) -> tuple[object, ...]:
    """The hashes as the sequence they were when the call began (an ``__index__`` run while
    reading them cannot change what is read)."""
    try:
        return tuple(hashes)
    except TypeError as exc:
        raise TypeError("block hashes must be iterable") from exc


def _slot(arg: object) -> int:
    slot = operator.index(cast(SupportsIndex, arg))
    if not 0 <= slot < _MAX_SLOTS:
        raise ValueError(f"worker slot {slot} is outside 0 .. {_MAX_SLOTS - 1}")
    return slot


def _double(value: object) -> float:
    if isinstance(value, str | bytes | bytearray):
        raise TypeError(f"must be real number, not {type(value).__name__}")
    return float(value)  # type: ignore[arg-type]


def _vector(obj: object, name: str, *, writable: bool) -> Floats:
    """A C-contiguous 1-d float64 buffer as an array sharing its memory."""
    view = memoryview(obj)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise BufferError(f"{name} is not C-contiguous")
    if view.ndim != 1 or view.itemsize != 8 or view.format != "d" or (writable and view.readonly):
        raise TypeError(f"{name} must be a contiguous 1-d float64 array")
    return np.frombuffer(view, dtype=np.float64)


def _rows(obj: object, rows: int, size: int | None) -> Floats:
    """A writable C-contiguous float64 array of ``rows`` rows (of ``size`` columns when given)."""
    view = memoryview(obj)  # type: ignore[arg-type]
    if (
        view.readonly
        or not view.c_contiguous
        or view.ndim != 2
        or view.shape is None
        or view.shape[0] != rows
        or (size is not None and view.shape[1] != size)
        or view.itemsize != 8
        or view.format != "d"
    ):
        shape = f"of shape ({rows}, {size})" if size is not None else f"of {rows} rows"
        raise TypeError(f"out must be a writable C-contiguous float64 array {shape}")
    return np.frombuffer(view, dtype=np.float64).reshape(view.shape)


def bilinear(
    active: Floats, context: Floats, values: Floats, active_kv_tokens: Floats, sequences: Floats
) -> Floats:
    """Decode step time by (active KV tokens, mean context length = active / sequences):
    bilinear over the grid ``values[active, context]``, clamped to it."""
    context_length = active_kv_tokens / np.maximum(sequences, 1.0)
    a = np.minimum(np.maximum(active_kv_tokens, active[0]), active[-1])
    c = np.minimum(np.maximum(context_length, context[0]), context[-1])
    i = np.minimum(active.searchsorted(a, side="right"), len(active) - 1)
    j = np.minimum(context.searchsorted(c, side="right"), len(context) - 1)
    a0 = active[i - 1]
    c0 = context[j - 1]
    s = (a - a0) / (active[i] - a0)
    t = (c - c0) / (context[j] - c0)
    g00 = values[i - 1, j - 1]
    g01 = values[i - 1, j]
    low = g00 + t * (g01 - g00)
    g10 = values[i, j - 1]
    high = g10 + t * (values[i, j] - g10)
    out: Floats = low + s * (high - low)
    return out


def _tier(arg: object) -> int:
    tier = operator.index(cast(SupportsIndex, arg))
    if not 0 <= tier <= _LOWER_TIERS:
        raise ValueError(f"cache tier {tier} is outside 0 .. {_LOWER_TIERS}")
    return tier


class BlockIndex:
    """Block hash -> bitmask of the worker slots holding it (on any tier), and for the blocks some
    slot keeps below the GPU, block hash -> those slots' bitmask per lower tier."""

    __slots__ = ("_blocks", "_held", "_lower", "_words")

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}
        self._lower: dict[int, list[int]] = {}
        """Block hash -> [slots keeping it on the host, slots keeping it on disk] (no empty entry)."""
        self._held: dict[int, int] = {}
        self._words = 1
        """64-slot words of the masks (grows with the highest slot stored), as ``slot_limit`` says."""

    @property
    def slot_limit(self) -> int:
        return self._words * 64

    def store(self, slot: int, hashes: Iterable[int], /) -> int:
        slot = _slot(slot)
        keys = [_key(item) for item in _keys(hashes)]
        if keys:
            self._words = max(self._words, slot // 64 + 1)
        bit = 1 << slot
        blocks = self._blocks
        fresh = 0
        for key in keys:
            mask = blocks.get(key, 0)
            if not mask & bit:
                blocks[key] = mask | bit
                fresh += 1
            else:  # stored again: on the GPU now, whichever tier it was on
                self._set_lower(slot, key, 0)
        self._held[slot] = self._held.get(slot, 0) + fresh
        return fresh

    def _set_lower(self, slot: int, key: int, tier: int) -> None:
        """The slot keeps ``key`` (which it holds) on ``tier`` now (0: the GPU)."""
        bit = 1 << slot
        planes = self._lower.get(key)
        if planes is None:
            if not tier:
                return
            planes = self._lower[key] = [0] * _LOWER_TIERS
        for k in range(_LOWER_TIERS):
            planes[k] &= ~bit
        if tier:
            planes[tier - 1] |= bit
        elif not any(planes):
            del self._lower[key]

    def _lower_tier(self, slot: int, key: int) -> int:
        planes = self._lower.get(key)
        if planes is None:
            return 0
        return next((k + 1 for k in range(_LOWER_TIERS) if planes[k] >> slot & 1), 0)

    def set_tier(self, slot: int, hashes: Iterable[int], tier: int, /) -> int:
        slot = _slot(slot)
        tier = _tier(tier)
        keys = [_key(item) for item in _keys(hashes)]
        moved = 0
        for key in keys:
            if self._blocks.get(key, 0) >> slot & 1 and self._lower_tier(slot, key) != tier:
                self._set_lower(slot, key, tier)
                moved += 1
        return moved

    def tier(self, slot: int, block: int, /) -> int:
        slot = _slot(slot)
        key = _key(block)
        if not self._blocks.get(key, 0) >> slot & 1:
            return -1
        return self._lower_tier(slot, key)

    def remove(self, slot: int, hashes: Iterable[int], /) -> int:
        slot = _slot(slot)
        keys = [_key(item) for item in _keys(hashes)]
        if slot >= self.slot_limit:
            return 0
        bit = 1 << slot
        blocks = self._blocks
        gone = 0
        for key in keys:
            mask = blocks.get(key, 0)
            if mask & bit:
                mask &= ~bit
                if mask:
                    blocks[key] = mask
                else:
                    del blocks[key]
                self._set_lower(slot, key, 0)
                gone += 1
        if gone:
            self._held[slot] -= gone
        return gone

    def clear(self, slot: int, /) -> None:
        slot = _slot(slot)
        if not self._held.get(slot):
            return
        bit = 1 << slot
        self._blocks = {key: mask & ~bit for key, mask in self._blocks.items() if mask & ~bit}
        lower = {key: [plane & ~bit for plane in planes] for key, planes in self._lower.items()}
        self._lower = {key: planes for key, planes in lower.items() if any(planes)}
        self._held[slot] = 0

    def holds(self, slot: int, block: int, /) -> bool:
        slot = _slot(slot)
        return bool(self._blocks.get(_key(block), 0) >> slot & 1)

    def blocks_held(self, slot: int, /) -> int:
        return self._held.get(_slot(slot), 0)

    def leading_blocks(self, hashes: Sequence[int], out: Floats, /) -> None:
        self._walk(_keys(hashes), _vector(out, "out", writable=True), None)

    def leading_tiers(self, hashes: Sequence[int], out: Floats, /) -> None:
        rows = _rows(out, 1 + _LOWER_TIERS, None)
        self._walk(_keys(hashes), rows[0], rows[1:])

    def _walk(self, hashes: tuple[object, ...], depth: Floats, lower: Floats | None) -> None:
        """depth[slot] = leading blocks of ``hashes`` the slot holds, for every slot of ``depth``;
        with ``lower``, lower[k, slot] = how many of them it keeps on tier k + 1."""
        size = len(depth)
        depth[:] = 0.0
        if lower is not None:
            lower[:] = 0.0
        tiers = self._lower if lower is not None else {}
        active = (1 << min(size, self.slot_limit)) - 1
        blocks = self._blocks
        n = len(hashes)
        d = 0
        while d < n and active:
            keys = [_key(item) for item in hashes[d : d + _BATCH]]
            for key in keys:
                kept = active & blocks.get(key, 0)
                dropped = active & ~kept
                while dropped:
                    low = dropped & -dropped
                    depth[low.bit_length() - 1] = d
                    dropped ^= low
                planes = tiers.get(key) if kept else None
                if planes is not None and lower is not None:
                    for k, plane in enumerate(planes):
                        on = kept & plane
                        while on:
                            low = on & -on
                            lower[k, low.bit_length() - 1] += 1.0
                            on ^= low
                active = kept
                if not active:
                    break
                d += 1
        while active:
            low = active & -active
            depth[low.bit_length() - 1] = n
            active ^= low

    def __len__(self) -> int:
        return len(self._blocks)


class Curve:
    """The piecewise-linear function through (xs, ys), constant beyond the ends (numpy's interp)."""

    __slots__ = ("xs", "ys")

    def __init__(self, xs: Floats, ys: Floats) -> None:
        x = _vector(xs, "xs", writable=False).copy()
        y = _vector(ys, "ys", writable=False).copy()
        if len(x) < 1 or len(y) != len(x):
            raise ValueError(f"a curve needs as many ys as xs (at least one), got {len(x)} and {len(y)}")
        for i in range(1, len(x)):
            if not x[i] > x[i - 1]:
                raise ValueError(f"curve xs must increase, but xs[{i}] <= xs[{i - 1}]")
        self.xs = x
        self.ys = y

    def __call__(self, x: float) -> float:
        return float(np.interp(_double(x), self.xs, self.ys))

    def at(self, x: Floats) -> Floats:
        """The curve at every point of ``x``."""
        out: Floats = np.interp(x, self.xs, self.ys)
        return out


class Grid:
    """Decode step time by (active KV tokens, mean context length), bilinear and clamped."""

    __slots__ = ("active", "context", "values")

    def __init__(self, active: Floats, context: Floats, values: Floats) -> None:
        a = _vector(active, "active", writable=False).copy()
        c = _vector(context, "context", writable=False).copy()
        view = memoryview(values)  # type: ignore[arg-type]
        if (
            len(a) < 2
            or len(c) < 2
            or view.ndim != 2
            or view.shape != (len(a), len(c))
            or view.itemsize != 8
            or view.format != "d"
        ):
            raise ValueError(
                "a grid needs >= 2 points per axis and float64 values of shape (len(active), len(context))"
            )
        self.active = a
        self.context = c
        self.values = np.array(view, dtype=np.float64)

    def __call__(self, active_kv: float, sequences: float) -> float:
        return float(self.at(np.array([_double(active_kv)]), np.array([_double(sequences)]))[0])

    def at(self, active_kv: Floats, sequences: Floats) -> Floats:
        """The grid at every (active KV, sequences) pair."""
        return bilinear(self.active, self.context, self.values, active_kv, sequences)

    def fill(self, active_kv: Floats, sequences: Floats, out: Floats, /) -> None:
        """:meth:`at`, written to ``out``."""
        a = _vector(active_kv, "active_kv", writable=False)
        s = _vector(sequences, "sequences", writable=False)
        o = _vector(out, "out", writable=True)
        if not len(a) == len(s) == len(o):
            raise ValueError("active_kv, sequences and out must have the same length")
        o[:] = self.at(a, s)


def _slot_key(slot: int, block: int) -> int:
    """(slot, block) as one key, mixed as the compiled table mixes it (a bijection per slot)."""
    return block ^ ((slot + 1) * 0x9E3779B97F4A7C15 % _U64)


class LoadTable:
    """Per-worker in-flight figures (rows of bound columns) and the blocks in use per worker."""

    __slots__ = ("_block_size", "_columns", "_refs")

    def __init__(self, block_size: float) -> None:
        self._block_size = _double(block_size)
        self._refs: dict[int, int] = {}
        self._columns: Floats | None = None

    def bind(self, columns: Floats, /) -> None:
        view = memoryview(columns)  # type: ignore[arg-type]
        if (
            view.readonly
            or not view.c_contiguous
            or view.ndim != 2
            or view.shape is None
            or view.shape[0] != len(LOAD_ROWS)
            or view.itemsize != 8
            or view.format != "d"
        ):
            raise TypeError(f"columns must be a writable C-contiguous float64 array of {len(LOAD_ROWS)} rows")
        self._columns = np.frombuffer(view, dtype=np.float64).reshape(view.shape)

    def _rows(self) -> Floats:
        if self._columns is None:
            raise ValueError("no columns are bound to the load table")
        return self._columns

    def _bound_slot(self, arg: object) -> tuple[Floats, int]:
        rows = self._rows()
        slot = _slot(arg)
        if slot >= rows.shape[1]:
            raise IndexError(f"worker slot {slot} is beyond the {rows.shape[1]} bound columns")
        return rows, slot

    def _update_kv(self, rows: Floats, slot: int) -> None:
        rows[_KV, slot] = rows[_ACTIVE_BLOCKS, slot] * self._block_size + rows[_KV_EXTRA, slot]

    def add(
        self, slot: int, hashes: Iterable[int], prefill_tokens: float, prefill_ms: float, kv_tokens: float, /
    ) -> None:
        rows, slot = self._bound_slot(slot)
        tokens, ms, kv = _double(prefill_tokens), _double(prefill_ms), _double(kv_tokens)
        refs = self._refs
        fresh = 0
        for block in [_key(item) for item in _keys(hashes)]:
            key = _slot_key(slot, block)
            count = refs.get(key, 0)
            refs[key] = count + 1
            fresh += count == 0
        rows[_ACTIVE_BLOCKS, slot] += float(fresh)
        rows[_KV_EXTRA, slot] += kv
        rows[_REQUESTS, slot] += 1.0
        rows[_PREFILLING, slot] += 1.0
        rows[_PREFILL_TOKENS, slot] += tokens
        rows[_PREFILL_MS, slot] += ms
        self._update_kv(rows, slot)

    def end_prefill(self, slot: int, prefill_tokens: float, prefill_ms: float, /) -> None:
        rows, slot = self._bound_slot(slot)
        tokens, ms = _double(prefill_tokens), _double(prefill_ms)
        rows[_PREFILLING, slot] -= 1.0
        rows[_PREFILL_TOKENS, slot] -= tokens
        rows[_PREFILL_MS, slot] -= ms

    def free(self, slot: int, hashes: Iterable[int], kv_tokens: float, /) -> None:
        rows, slot = self._bound_slot(slot)
        kv = _double(kv_tokens)
        refs = self._refs
        gone = 0
        for block in [_key(item) for item in _keys(hashes)]:
            key = _slot_key(slot, block)
            count = refs.get(key)
            if count is None:
                continue
            if count > 1:
                refs[key] = count - 1
            else:
                del refs[key]
                gone += 1
        rows[_ACTIVE_BLOCKS, slot] -= float(gone)
        rows[_KV_EXTRA, slot] -= kv
        rows[_REQUESTS, slot] -= 1.0
        if rows[_REQUESTS, slot] == 0.0:
            # Exact zero, not an accumulated float residue.
            rows[_KV_EXTRA, slot] = 0.0
            rows[_PREFILL_MS, slot] = 0.0
        self._update_kv(rows, slot)

    def leading_blocks(self, hashes: Sequence[int], out: Floats, /) -> None:
        depth = _vector(out, "out", writable=True)
        keys = [_key(item) for item in _keys(hashes)]
        refs = self._refs
        for slot in range(len(depth)):
            d = 0
            while d < len(keys) and _slot_key(slot, keys[d]) in refs:
                d += 1
            depth[slot] = d

    def refresh(
        self,
        slots: Iterable[int],
        itl: Curve | Grid,
        f0: float,
        busy_prefill_tokens: float,
        busy_kv_tokens: float,
        /,
    ) -> int:
        if not isinstance(itl, Curve | Grid):
            raise TypeError("itl must be a Curve or a Grid")
        step0, busy_prefill, busy_kv = _double(f0), _double(busy_prefill_tokens), _double(busy_kv_tokens)
        rows = self._rows()
        chosen = np.array(list(dict.fromkeys(self._bound_slot(slot)[1] for slot in slots)), dtype=np.intp)
        active_kv, sequences = rows[_KV, chosen], rows[_REQUESTS, chosen]
        step = np.full(len(chosen), step0)
        # The decode step joins every prefill step while some sequence decodes.
        decoding = sequences > rows[_PREFILLING, chosen]
        if decoding.any():
            kv, seqs = active_kv[decoding], sequences[decoding]
            step[decoding] = step0 + (itl.at(kv) if isinstance(itl, Curve) else itl.at(kv, seqs))
        rows[_STEP_MS, chosen] = step
        busy = (rows[_PREFILL_TOKENS, chosen] > busy_prefill) | (active_kv > busy_kv)
        now_free = (~busy).astype(np.float64)
        flips = int(np.count_nonzero(now_free != rows[_FREE, chosen]))
        rows[_FREE, chosen] = now_free
        return flips

    def ttft(  # noqa: PLR0917 (positional-only, as the compiled method)
        self,
        index: BlockIndex,
        hashes: Sequence[int],
        out: Floats,
        prefill_curve: Curve,
        prompt_tokens: float,
        block_size: float,
        step_budget: float,
        now: float,
        full_ms: float,
        host_block_ms: float,
        disk_block_ms: float,
        /,
    ) -> None:
        if not isinstance(index, BlockIndex) or not isinstance(prefill_curve, Curve):
            raise TypeError("ttft() takes a BlockIndex and a Curve")
        isl, bs, budget = _double(prompt_tokens), _double(block_size), _double(step_budget)
        moment, full = _double(now), _double(full_ms)
        host_ms, disk_ms = _double(host_block_ms), _double(disk_block_ms)
        rows = self._rows()
        size = rows.shape[1]
        table = _rows(out, 3 + _LOWER_TIERS, size)
        depth, host, disk, ttft, uncached = table
        index._walk(_keys(hashes), depth, table[1 : 1 + _LOWER_TIERS])
        limit = max(isl - 1.0, 0.0)  # at least one token is always computed
        cached = np.minimum(depth * bs, limit)
        own = full - prefill_curve.at(cached)
        uncached[:] = isl - cached
        steps = np.add(rows[_PREFILL_TOKENS], uncached)
        steps /= budget
        np.ceil(steps, out=steps)
        steps *= rows[_STEP_MS]
        progress = np.subtract(moment, rows[_HEAD_START])
        progress *= 1000.0
        np.maximum(progress, 0.0, out=progress)
        np.minimum(progress, rows[_HEAD_MS], out=progress)
        backlog = np.maximum(np.subtract(rows[_PREFILL_MS], progress), 0.0)
        backlog += own
        backlog += steps
        onboard = host * host_ms
        onboard += disk * disk_ms
        backlog += onboard
        ttft[:] = backlog

    def __len__(self) -> int:
        return len(self._refs)


def lowest(costs: Floats, exclusion: Floats | None, /) -> int | list[int]:
    """The slot of lowest cost + exclusion (the first minimum, a NaN counting as the minimum), or
    the list of slots within 1e-9 relative of it when several are."""
    cost = _vector(costs, "costs", writable=False)
    excl = None if exclusion is None else _vector(exclusion, "exclusion", writable=False)
    if len(cost) == 0 or (excl is not None and len(excl) != len(cost)):
        raise ValueError("lowest(): empty costs, or an exclusion of another length")
    masked = cost if excl is None else cost + excl
    best = int(masked.argmin())
    low = float(masked[best])
    ties = np.flatnonzero(masked <= low + 1e-9 * max(1.0, math.fabs(low)))
    return best if len(ties) <= 1 else [int(slot) for slot in ties]
