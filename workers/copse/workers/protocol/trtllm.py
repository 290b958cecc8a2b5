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
Unknown keys are ignored so that a newer engine does not break the relay.
"""

from __future__ import annotations

from typing import Annotated, Literal

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
