"""Request limits and validation parity (:mod:`copse.workers.protocol.limits`, ``openai_api``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from copse.workers.protocol.errors import as_openai_error, error_body
from copse.workers.protocol.limits import RequestLimits, check_context, json_shape
from copse.workers.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    parse_request,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error(
    model: type[CompletionRequest] | type[ChatCompletionRequest], body: Any, **limits: int
) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_request(model, json.dumps(body).encode(), limits=RequestLimits(**limits))
    return caught.value


def test_a_body_nested_5000_deep_is_a_400_naming_the_limit() -> None:
    with pytest.raises(RequestError, match=r"nested more than 64 levels deep .max_json_depth"):
        parse_request(ChatCompletionRequest, b"[" * 5000 + b"]" * 5000)
    inside = {**CHAT, "chat_template_kwargs": {"x": json.loads("[" * 100 + "]" * 100)}}
    assert "max_json_depth" in _error(ChatCompletionRequest, inside).message


@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(max_size=3), inner),
    )
)
def test_json_shape_counts_what_the_parser_builds(value: Any) -> None:
    def shape(node: Any) -> tuple[int, int]:
        if isinstance(node, list | dict):
            children = [shape(child) for child in (node.values() if isinstance(node, dict) else node)]
            return 1 + max((d for d, _ in children), default=0), 1 + sum(c for _, c in children)
        return 0, 0

    assert json_shape(json.dumps(value).encode()) == shape(value)


@pytest.mark.parametrize(
    ("body", "limits", "param", "setting"),
    [
        (
            {**CHAT, "messages": [{"role": "user", "content": "x"}] * 5},
            {"max_messages": 4},
            "messages",
            "max_messages",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 5}]},
            {"max_content_parts": 4},
            "messages[0].content",
            "max_content_parts",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]},
            {"max_string_chars": 1024},
            "messages[0].content",
            "max_string_chars",
        ),
        ({**CHAT, "stop": ["a"] * 5}, {"max_stop": 4}, "stop", "max_stop"),
        ({**CHAT, "stop": "a" * 20}, {"max_stop_chars": 10}, "stop[0]", "max_stop_chars"),
        ({**CHAT, "stop_token_ids": [1] * 5}, {"max_stop": 4}, "stop_token_ids", "max_stop"),
        (
            {**CHAT, "logit_bias": {str(i): 1.0 for i in range(5)}},
            {"max_logit_bias": 4},
            "logit_bias",
            "max_logit_bias",
        ),
        (
            {**CHAT, "chat_template_kwargs": {"x": [[]] * 20}},
            {"max_json_containers": 16},
            None,
            "max_json_containers",
        ),
    ],
)
def test_each_limit_is_a_400_naming_it(
    body: Any, limits: dict[str, int], param: str | None, setting: str
) -> None:
    error = _error(ChatCompletionRequest, body, **limits)
    assert error.param == param
    assert setting in error.message


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"messages": [{"role": "alien", "content": "x"}]}, "messages[0].role", "role must be one of"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
        ({"tool_choice": "auto"}, "tool_choice", "tool calling"),
        ({"response_format": {"type": "json_object"}}, "response_format", "structured output"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"n": 2}, "n", "1"),
        ({"best_of": 2}, "best_of", "one sequence"),
        ({"use_beam_search": True}, "use_beam_search", "beam search"),
        ({"functions": []}, "functions", "unknown field"),
    ],
)
def test_what_copse_cannot_honour_is_a_400_naming_the_field(
    extra: dict[str, Any], param: str, fragment: str
) -> None:
    error = _error(ChatCompletionRequest, {**CHAT, **extra})
    assert error.param == param
    assert fragment in error.message


@pytest.mark.parametrize(
    "extra",
    [
        {
            "messages": [
                {"role": role, "content": "x"}
                for role in ("system", "developer", "user", "assistant", "tool")
            ]
        },
        {"seed": 7, "user": "u", "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
        {"logprobs": False, "top_logprobs": 0, "best_of": 1, "use_beam_search": False},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
    ],
)
def test_what_trtllm_serve_accepts_and_copse_honours_passes(extra: dict[str, Any]) -> None:
    parse_request(ChatCompletionRequest, json.dumps({**CHAT, **extra}).encode())


def test_context_checks_name_the_context() -> None:
    with pytest.raises(RequestError, match="context of 1000 tokens") as caught:
        check_context(prompt_tokens=None, max_tokens=10**12, context=1000)
    assert caught.value.param == "max_tokens"
    with pytest.raises(RequestError, match=r"prompt \(11 tokens\) plus max_tokens \(990\).*1000") as caught:
        check_context(prompt_tokens=11, max_tokens=990, context=1000)
    with pytest.raises(RequestError, match="context is 1000 tokens") as caught:
        check_context(prompt_tokens=1000, max_tokens=None, context=1000)
    assert caught.value.param == "prompt"
    check_context(prompt_tokens=10, max_tokens=990, context=1000)
    check_context(prompt_tokens=999, max_tokens=None, context=1000)


def test_one_error_shape_wraps_trtllm_serves_flat_errors_and_text() -> None:
    flat = json.dumps(
        {"object": "error", "message": "bad", "type": "BadRequestError", "param": "x", "code": 400}
    )
    assert json.loads(as_openai_error(flat.encode(), status=400)) == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}
    }
    ours = error_body(429, "slow down")
    assert as_openai_error(ours, status=429) == ours
    assert (
        json.loads(as_openai_error(b"<html>oops</html>", status=502))["error"]["message"]
        == "<html>oops</html>"
    )
