"""The LoRA adapters a mocked engine holds: an LRU cache of at most ``max_loras`` adapters (what
TensorRT-LLM's ``lora_config.max_loras`` bounds on the GPU), filled by loads that take
``load_ms`` each, one after the other.

An engine serves a request through its adapter only once the adapter is loaded. TensorRT-LLM
loads an adapter it has not seen when a request naming it arrives, before the request is queued,
so a load delays that request and every request queued behind it (the mocked engine admits its
waiting requests in order); a loaded adapter costs nothing more. When the cache is full, the least
recently used adapter is evicted; one that is still needed is loaded again later (an *adapter
load*, what adapter-aware routing saves).

Pure and clock-free: the engine says what time it is.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterSettings:
    """How many adapters a mocked engine holds and how long loading one takes."""

    max_loras: int = 4
    """Adapters held at once (TensorRT-LLM's ``lora_config.max_loras``); a further one evicts the
    least recently used."""
    load_ms: float = 200.0
    """Time to load one adapter that is not held (reading its weights and moving them to the GPU;
    a mock figure, not a measurement)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be at least 1")
        if self.load_ms < 0:
            raise ValueError(f"load_ms={self.load_ms} must not be negative")


class AdapterCache:
    """The adapters an engine holds, least recently used first, and when each is ready."""

    def __init__(self, settings: AdapterSettings) -> None:
        self.settings = settings
        self._ready: OrderedDict[str, float] = OrderedDict()
        """Adapter name -> when its load completes (ms), least recently used first."""
        self._loader_free_ms = 0.0
        """When the loader finishes the load in progress (loads run one at a time)."""
        self.loads_total = 0
        """Adapters loaded so far (first loads and reloads after an eviction)."""

    def acquire(self, name: str, *, now_ms: float) -> float:
        """A request through adapter ``name`` arrived at ``now_ms``: mark the adapter most recently
        used, start loading it when it is not held (evicting the least recently used one when the
        cache is full) and return when it is ready (``now_ms`` or earlier when it is)."""
        ready = self._ready.get(name)
        if ready is not None:
            self._ready.move_to_end(name)
            return ready
        if len(self._ready) >= self.settings.max_loras:
            self._ready.popitem(last=False)
        ready = max(now_ms, self._loader_free_ms) + self.settings.load_ms
        self._loader_free_ms = ready
        self._ready[name] = ready
        self.loads_total += 1
        return ready

    def held(self) -> list[str]:
        """Names of the adapters held (loaded or loading), least recently used first."""
        return list(self._ready)
