"""The JSON that ``trtllm-serve``'s ``POST /kv_cache_events`` returns.

The endpoint drains the engine's event buffer (each event is returned once) and answers a JSON
list of events serialised by TensorRT-LLM's ``KVCacheEventSerializer``::

    {"event_id": 7, "window_size": 4096, "attention_dp_rank": 0,      # rank only with attention DP
     "data": {"type": "stored", "parent_hash": 123 | null,
              "blocks": [{"type": "stored_block", "block_hash": 456, "cache_level": 0, "priority": 35,
                          "tokens": [{"type": "unique_token", "token_id": 9, "token_extra_id": 0}, ...]}]}}
    {"event_id": 8, "window_size": 4096, "data": {"type": "removed", "block_hashes": [456]}}
    {"event_id": 0, "window_size": 4096, "data": {"type": "created", "num_blocks_per_cache_level": [1024, 0]}}
    {"event_id": 9, "window_size": 4096, "data": {"type": "updated", "block_hash": 456,
              "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}, "priority": null}}

TensorRT-LLM's block hashes are opaque engine ids (not copse's hashes); the KV relay maps them.
Unknown keys are ignored so that a newer engine does not break the relay, and an event is read
in two steps (:class:`TrtllmEventEnvelope`, then its ``data`` by type, :data:`TRTLLM_EVENT_DATA`)
so that one of a type the relay does not know is skipped alone.

Numbering (``cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp``): every event takes the
next ``event_id`` of its engine (per attention-DP rank), from 0 for the ``created`` event the
engine emits at start (one per attention window size); when the buffer of
``kv_cache_config.event_buffer_max_size`` events is full the oldest are dropped, which leaves a
gap in the ids. Removal: recent engines emit one ``removed`` event for a block whose descendants
they free with it (``freeChildren``), older ones one per descendant first; a removal therefore
takes the block's descendants with it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TrtllmToken(_Lenient):
    type: Literal["unique_token"] = "unique_token"
    token_id: int
    token_extra_id: int = 0
    """Non-zero only for multimodal placeholder tokens."""


class TrtllmStoredBlock(_Lenient):
    type: Literal["stored_block"] = "stored_block"
    block_hash: int
    tokens: list[TrtllmToken]
    cache_level: int = 0
    """0 = GPU memory, 1 = host (offloaded) memory."""
    priority: int = 35
    """Retention priority (TensorRT-LLM's default is 35)."""
    lora_id: int | None = None
    """The LoRA adapter the block was computed through (the request's ``lora_request.lora_int_id``;
    ``None``: the base model). Its KV is not the base model's: the relay hashes it with the
    adapter's seed (:func:`copse.workers.protocol.hashing.adapter_seed`)."""


class TrtllmStored(_Lenient):
    type: Literal["stored"] = "stored"
    parent_hash: int | None = None
    blocks: list[TrtllmStoredBlock]


class TrtllmRemoved(_Lenient):
    type: Literal["removed"] = "removed"
    block_hashes: list[int]


class TrtllmCreated(_Lenient):
    type: Literal["created"] = "created"
    num_blocks_per_cache_level: list[int]


class TrtllmEventDiff(_Lenient):
    type: Literal["event_diff"] = "event_diff"
    new_value: int
    old_value: int


class TrtllmUpdated(_Lenient):
    type: Literal["updated"] = "updated"
    block_hash: int
    cache_level: TrtllmEventDiff | None = None
    priority: TrtllmEventDiff | None = None


TrtllmEventData = Annotated[
    TrtllmStored | TrtllmRemoved | TrtllmCreated | TrtllmUpdated, Field(discriminator="type")
]


class TrtllmKvCacheEvent(_Lenient):
    """One element of the list ``POST /kv_cache_events`` returns."""

    event_id: int
    data: TrtllmEventData
    window_size: int | None = None
    attention_dp_rank: int | None = None


class TrtllmEventEnvelope(_Lenient):
    """An event with its ``data`` not yet read (read it by type with :data:`TRTLLM_EVENT_DATA`)."""

    event_id: int
    data: dict[str, Any]
    window_size: int | None = None
    attention_dp_rank: int | None = None


TRTLLM_EVENT_DATA: dict[str, type[TrtllmStored | TrtllmRemoved | TrtllmCreated | TrtllmUpdated]] = {
    "stored": TrtllmStored,
    "removed": TrtllmRemoved,
    "created": TrtllmCreated,
    "updated": TrtllmUpdated,
}
"""The event types KVCacheEventSerializer writes, by their ``data.type``."""
