"""Wire protocol: hashing layout, request validation messages, KV event models, subjects."""

from __future__ import annotations

import gc
import json
import struct

import pytest
import xxhash
from pydantic import TypeAdapter, ValidationError

from copse.workers.protocol import (
    HASH_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    KvDump,
    KvEvent,
    KvEventBatch,
    KvRemoved,
    KvStored,
    RequestError,
    StoredBlock,
    TrtllmKvCacheEvent,
    block_hashes,
    chain_hash,
    kv_dump_subject,
    kv_events_subject,
    parse_request,
    tokens_hashes,
)
from copse.workers.protocol.openai_api import parse_request_object
from copse.workers.protocol.tokenizer import VOCAB_SIZE, encode, render_chat
from copse.workers.protocol.trtllm import TrtllmRemoved, TrtllmStored


def test_hash_byte_layout_is_as_documented() -> None:
    tokens = list(range(10))
    local = tokens_hashes(tokens, block_size=4)
    assert len(local) == 2  # the trailing partial block is not hashed
    first = xxhash.xxh3_64_intdigest(struct.pack("<4I", 0, 1, 2, 3), seed=1337)
    second = xxhash.xxh3_64_intdigest(struct.pack("<4I", 4, 5, 6, 7), seed=1337)
    assert local == [first, second]
    assert HASH_SEED == 1337
    chained = block_hashes(tokens, block_size=4)
    assert chained[0] == first
    assert chained[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", first, second), seed=1337)
    assert chain_hash(None, second) == second


def test_block_hashes_identify_prefixes() -> None:
    a = [7] * 16 + [1, 2, 3, 4]
    b = [7] * 16 + [9, 9, 9, 9]
    ha, hb = block_hashes(a, block_size=4), block_hashes(b, block_size=4)
    assert ha[:4] == hb[:4]
    assert ha[4] != hb[4]
    # same tokens after a different prefix: same tokens hash, different block hash
    assert tokens_hashes(a, block_size=4)[3] == tokens_hashes(a, block_size=4)[2]
    assert ha[3] != ha[2]
    # continuing from a parent gives the hashes of the whole sequence
    assert block_hashes(a[8:], block_size=4, parent=ha[1]) == ha[2:]


def test_hashing_rejects_ids_outside_u32() -> None:
    with pytest.raises(ValueError, match="token ids"):
        tokens_hashes([-1, 2], block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        tokens_hashes([1], block_size=0)


def _error(
    model: type[CompletionRequest] | type[ChatCompletionRequest], body: object | bytes
) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        parse_request(model, raw)
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        ([1, 2], None, "must be a JSON object"),
        ({"model": "m"}, "prompt", "prompt: field required"),
        ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"model": "m", "prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"model": "m", "prompt": [1, 2.5]}, "prompt", "prompt[1] must be an integer token id"),
        ({"model": "m", "prompt": [1, True]}, "prompt", "prompt[1] must be an integer token id"),
        ({"model": "m", "prompt": [1, -3]}, "prompt", "prompt[1] must lie in"),
        ({"model": "m", "prompt": 5}, "prompt", "must be a list of integer token ids"),
        ({"model": "m", "prompt": ""}, "prompt", "must not be empty"),
        ({"model": "m", "prompt": []}, "prompt", "must not be empty"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"model": "m", "prompt": "hi", "frobnicate": 1}, "frobnicate", "unknown field"),
        ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
        ({"model": "m", "prompt": "hi", "stream_options": {}}, "stream_options", "only allowed when stream"),
        ({"model": "m", "prompt": "hi", "n": 2}, "n", "less than or equal to 1"),
        ({"model": "m", "prompt": "hi", "stop": [1]}, "stop", "string or a list of strings"),
        ({"model": "m", "prompt": "hi", "logprobs": 2}, "logprobs", "not supported"),
        ({"prompt": "hi"}, "model", "model: field required"),
    ],
)
def test_completion_errors_name_the_field(body: object | bytes, param: str | None, fragment: str) -> None:
    error = _error(CompletionRequest, body)
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"model": "m"}, "messages", "messages: field required"),
        ({"model": "m", "messages": []}, "messages", "at least 1"),
        (
            {"model": "m", "messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
            "content must be",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "parts of type 'image_url' are not supported",
        ),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role", "field required"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            None,
            "",
        ),
    ],
)
def test_chat_errors_name_the_field(body: object, param: str | None, fragment: str) -> None:
    error = _error(ChatCompletionRequest, body)
    assert error.param == (param or "max_completion_tokens")
    assert fragment in error.message


def test_a_parsed_prompt_is_kept_out_of_the_cycle_collector() -> None:
    # Thousands of long prompts in flight as lists made every full collection walk each id: the
    # router's loop stalled for most of a second. The body and the model share one tuple of ints,
    # which the collector stops tracking.
    ids = list(range(300, 20_300))
    raw = json.dumps({"model": "m", "prompt": ids, "stream": True}).encode()
    request, body = parse_request_object(CompletionRequest, raw)
    assert request.prompt == tuple(ids)
    assert body["prompt"] is request.prompt
    messages = [{"role": "user", "content": "x"}]
    chat_raw = json.dumps({"model": "m", "messages": messages, "prompt_token_ids": ids}).encode()
    chat, chat_body = parse_request_object(ChatCompletionRequest, chat_raw)
    assert chat_body["prompt_token_ids"] is chat.prompt_token_ids
    gc.collect()
    assert not gc.is_tracked(request.prompt)
    assert not gc.is_tracked(chat.prompt_token_ids)


def test_valid_requests_parse() -> None:
    completion = parse_request(
        CompletionRequest,
        json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}).encode(),
    )
    assert completion.prompt == (1, 2, 3)
    assert completion.requested_tokens() == 4
    chat = parse_request(
        ChatCompletionRequest,
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief", "name": "ignored-extra-key-is-fine"},
                    {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                ],
                "max_completion_tokens": 7,
                "disaggregated_params": {"request_type": "context_only"},
            }
        ).encode(),
    )
    assert [m.text() for m in chat.messages] == ["be brief", "hello"]
    assert chat.requested_tokens() == 7
    assert chat.disaggregated_params is not None
    assert chat.disaggregated_params.request_type == "context_only"
    assert parse_request(CompletionRequest, b'{"model": "m", "prompt": "x"}').requested_tokens() == 32


def test_kv_event_batch_round_trips_through_json() -> None:
    batch = KvEventBatch(
        worker_id="mock-0",
        epoch=12,
        events=(
            KvEvent(
                event_id=1,
                data=KvStored(parent_hash=None, blocks=(StoredBlock(block_hash=2**64 - 1, tokens_hash=5),)),
            ),
            KvEvent(event_id=2, data=KvRemoved(block_hashes=(2**64 - 1,))),
            KvEvent.model_validate({"event_id": 3, "data": {"type": "cleared"}}),
        ),
    )
    again = KvEventBatch.model_validate_json(batch.model_dump_json())
    assert again == batch
    assert [e.data.type for e in again.events] == ["stored", "removed", "cleared"]
    assert json.loads(batch.model_dump_json())["events"][0]["data"]["blocks"] == [[2**64 - 1, 5]]
    with pytest.raises(ValidationError):
        KvStored.model_validate({"parent_hash": None, "blocks": [[2**64, 0]]})
    with pytest.raises(ValidationError):
        KvEvent.model_validate({"event_id": 0, "data": {"type": "cleared"}})
    dump = KvDump(worker_id="w", epoch=1, block_size=16, last_event_id=0, blocks=())
    assert KvDump.model_validate_json(dump.model_dump_json()) == dump


def test_trtllm_drain_format_parses() -> None:
    body = [
        {
            "event_id": 1,
            "window_size": 4096,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": 99,
                        "tokens": [{"type": "unique_token", "token_id": 5, "token_extra_id": 0}],
                        "cache_level": 0,
                        "priority": 35,
                        "lora_id": None,
                    }
                ],
            },
        },
        {"event_id": 2, "window_size": 4096, "data": {"type": "removed", "block_hashes": [99]}},
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}},
        {
            "event_id": 3,
            "data": {
                "type": "updated",
                "block_hash": 99,
                "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                "priority": None,
            },
        },
    ]
    events = TypeAdapter(list[TrtllmKvCacheEvent]).validate_python(body)
    assert isinstance(events[0].data, TrtllmStored)
    assert events[0].data.blocks[0].tokens[0].token_id == 5
    assert isinstance(events[1].data, TrtllmRemoved)
    assert [e.data.type for e in events] == ["stored", "removed", "created", "updated"]


def test_subjects() -> None:
    assert kv_events_subject(namespace="prod", deployment="llama.v2") == "copse.kv.events.prod.llama~v2"
    assert (
        kv_dump_subject(namespace="prod", deployment="d", worker_id="d-0-abc")
        == "copse.kv.dump.prod.d.d-0-abc"
    )
    for bad in ("a b", "a*", "a>", "", "a~b"):
        with pytest.raises(ValueError, match="NATS subject token"):
            kv_events_subject(namespace=bad, deployment="d")


def test_mock_tokenizer_is_deterministic_and_in_vocabulary() -> None:
    text = render_chat([("system", "Be brief."), ("user", "Hello, world!")])
    assert text == "<|system|>\nBe brief.\n<|user|>\nHello, world!\n<|assistant|>\n"
    ids = encode(text)
    assert ids == encode(text)
    assert all(256 <= i < VOCAB_SIZE for i in ids)
    assert encode("Hello, world!") == encode("Hello ,world !")
    assert len(encode("Hello, world!")) == 4
