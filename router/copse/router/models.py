"""The models one router fronts, and the LoRA adapters of each: what a request's ``model`` names.

A request names a base model (``llama-8b``) or one of its LoRA adapters (``llama-8b-sql``). The
catalog resolves the name to the base model (whose workers may serve it) and, for an adapter, the
adapter (which the block hashes include and the engine must load). A name it does not know is an
OpenAI ``404`` naming it, as OpenAI answers ``model_not_found`` (``trtllm-serve`` itself does not
check ``model``: it serves its one model whatever the field says).

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from copse.workers.protocol.hashing import lora_int_id


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter of a base model."""

    name: str
    """What requests name as ``model``."""
    base: str
    """The base model it adapts (its workers serve it)."""
    path: str = ""
    """Where the engines read its weights (``lora_request.lora_path``; a path inside the worker pod,
    where the operator mounts the adapter)."""

    @property
    def lora_int_id(self) -> int:
        """Its integer id: the key of the engines' adapter caches and the seed of its block hashes."""
        return lora_int_id(self.name)

    def lora_request(self) -> dict[str, Any]:
        """The ``lora_request`` body field that makes ``trtllm-serve`` serve a request through it."""
        return {"lora_name": self.name, "lora_int_id": self.lora_int_id, "lora_path": self.path}


@dataclasses.dataclass(frozen=True, slots=True)
class Resolved:
    """What a request's ``model`` names."""

    model: str
    """The base model whose workers serve the request."""
    adapter: Adapter | None
    """The LoRA adapter it is served through (``None``: the base model)."""


class UnknownModel(LookupError):
    """A request named a model (or adapter) that no worker behind this router serves."""

    def __init__(self, name: str, *, served: Iterable[str]) -> None:
        listed = ", ".join(repr(s) for s in served)
        super().__init__(f"model {name!r} is not served here (GET /v1/models lists {listed})")
        self.name = name


class ModelCatalog:
    """Base models and their adapters, by the names requests use."""

    def __init__(self, adapters: Mapping[str, Iterable[Adapter]]) -> None:
        """``adapters``: base model name -> its adapters (names unique across all of them)."""
        self.models = tuple(adapters)
        """Base model names, in configuration order (the first is the router's own ``model``)."""
        self._adapters: dict[str, Adapter] = {}
        for base, listed in adapters.items():
            for adapter in listed:
                if adapter.name in self._adapters or adapter.name in adapters:
                    raise ValueError(f"model name {adapter.name!r} is used twice")
                if adapter.base != base:
                    raise ValueError(
                        f"adapter {adapter.name!r} is listed under {base!r}, not {adapter.base!r}"
                    )
                self._adapters[adapter.name] = adapter

    def resolve(self, name: str) -> Resolved:
        """What ``name`` names; raises :class:`UnknownModel`."""
        adapter = self._adapters.get(name)
        if adapter is not None:
            return Resolved(model=adapter.base, adapter=adapter)
        if name in self.models:
            return Resolved(model=name, adapter=None)
        raise UnknownModel(name, served=(*self.models, *self._adapters))

    def listing(self, *, owned_by: str = "copse") -> dict[str, Any]:
        """The ``GET /v1/models`` body: every base model, then every adapter with its ``parent``
        (the base model, as vLLM lists adapters)."""
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": 0, "owned_by": owned_by} for name in self.models
        ]
        data.extend(
            {"id": a.name, "object": "model", "created": 0, "owned_by": owned_by, "parent": a.base}
            for a in self._adapters.values()
        )
        return {"object": "list", "data": data}
