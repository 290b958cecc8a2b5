"""The wire protocol: OpenAI HTTP models, KV events (copse's and TensorRT-LLM's), NATS subjects,
block hashing and the mocked engines' tokenizer. Everything a router needs to talk to engines."""

from copse.workers.protocol.hashing import (
    HASH_SEED,
    block_hashes,
    chain_hash,
    chain_hashes,
    hash_blocks,
    tokens_hashes,
)
from copse.workers.protocol.kv_events import (
    DumpBlock,
    KvCleared,
    KvDump,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    KvEventData,
    KvExact,
    KvRemoved,
    KvReset,
    KvStored,
    KvUpdated,
    StoredBlock,
)
from copse.workers.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DisaggregatedParams,
    ErrorResponse,
    RequestError,
    parse_request,
)
from copse.workers.protocol.subjects import kv_dump_subject, kv_events_subject, subject_token
from copse.workers.protocol.trtllm import TrtllmKvCacheEvent

__all__ = [
    "HASH_SEED",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DisaggregatedParams",
    "DumpBlock",
    "ErrorResponse",
    "KvCleared",
    "KvDump",
    "KvDumpRequest",
    "KvEvent",
    "KvEventBatch",
    "KvEventData",
    "KvExact",
    "KvRemoved",
    "KvReset",
    "KvStored",
    "KvUpdated",
    "RequestError",
    "StoredBlock",
    "TrtllmKvCacheEvent",
    "block_hashes",
    "chain_hash",
    "chain_hashes",
    "hash_blocks",
    "kv_dump_subject",
    "kv_events_subject",
    "parse_request",
    "subject_token",
    "tokens_hashes",
]
