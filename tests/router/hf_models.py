"""Small Hugging Face model directories for tokenizer tests, built with the ``tokenizers`` library
(nothing is downloaded), and the engine side: what ``trtllm-serve`` does to a request, replayed
with the ``transformers`` release TensorRT-LLM pins (4.57).

The engine-side functions follow TensorRT-LLM's code path step by step (``serve/openai_server.py``
``openai_chat``/``openai_completion``, ``serve/chat_utils.py`` ``parse_chat_message_content_parts``,
``inputs/utils.py`` ``apply_chat_template``/``resolve_hf_chat_template``, ``inputs/registry.py``
``DefaultInputProcessor``), calling ``transformers`` itself for the template and the encoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Summarise the following document in three sentences, then list its key figures.",
    "KV cache aware routing sends each request to the engine that already holds its prefix.",
    "Ünïcödé text, emoji 🦊 and numbers 1234567890 must survive tokenization unchanged.",
] * 20

#: Llama 3's chat template shape: BOS from the template, a default system turn, role checks with
#: raise_exception, documents through tojson, an assistant generation block and loop controls.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = default_system | default('You are a helpful assistant.') %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message }}"
    "{%- if documents %}{{- '\\nDocuments: ' + (documents | tojson) }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('Conversation roles must be user or assistant') }}"
    "{%- endif %}"
    "{%- if message['content'] == '' %}{%- continue %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: Another named template, picked by a request's ``chat_template``.
RAG_TEMPLATE = (
    "{{ bos_token }}{% for document in documents or [] %}"
    "[doc {{ loop.index }}] {{ document.text }}\n{% endfor %}"
    "{% for message in messages %}"
    "<{{ message.role }}>{{ message.content }}</{{ message.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

#: Llama 2's template shape: no BOS in the template (the tokenizer adds it when asked).
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA2_SPECIALS = ["<unk>", "<s>", "</s>"]


def _train(specials: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def llama3_like(directory: Path, *, template_file: bool = False) -> Path:
    """A Llama-3-style model directory: ``PreTrainedTokenizerFast`` whose post-processor adds BOS,
    a chat template in ``tokenizer_config.json`` (as a named list, with a ``rag`` template) or,
    with ``template_file``, in ``chat_template.jinja`` (which then takes priority)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(LLAMA3_SPECIALS)
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "chat_template": [
            {
                "name": "default",
                "template": "{{ 'this template is overridden' }}" if template_file else LLAMA3_TEMPLATE,
            },
            {"name": "rag", "template": RAG_TEMPLATE},
        ],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file:
        (directory / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    return directory


def llama2_like(directory: Path) -> Path:
    """A Llama-2-style directory: ``LlamaTokenizer`` class, ``tokenizer.json`` *without* a
    post-processor and ``add_bos_token: true``, so only the class's rebuild adds BOS."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(LLAMA2_SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "chat_template": LLAMA2_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def engine_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer ``trtllm-serve`` loads for the model (``AutoTokenizer``, fast)."""
    loaded = AutoTokenizer.from_pretrained(str(directory), use_fast=True)  # type: ignore[no-untyped-call]
    assert isinstance(loaded, PreTrainedTokenizerBase)
    return loaded


def _flatten(content: object) -> str:
    """``parse_chat_message_content_parts``: text parts joined by newlines; none is ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    assert isinstance(content, list)
    return "\n".join(part["text"] for part in content)


def engine_chat_ids(tokenizer: PreTrainedTokenizerBase, request: dict[str, Any]) -> list[int]:
    """Token ids ``trtllm-serve`` feeds its engine for a ``/v1/chat/completions`` body."""
    conversation = [
        {"role": message["role"], "content": _flatten(message.get("content")), "media": []}
        for message in request["messages"]
    ]
    # resolve_hf_chat_template: the request's template, else the tokenizer's (no tools).
    template = request.get("chat_template") or tokenizer.get_chat_template(None, tools=None)
    prompt = tokenizer.apply_chat_template(
        conversation=conversation,
        tokenize=False,
        return_dict=False,
        add_generation_prompt=request.get("add_generation_prompt", True),
        tools=None,
        documents=request.get("documents"),
        chat_template=template,
        **(request.get("chat_template_kwargs") or {}),
    )
    assert isinstance(prompt, str)
    # DefaultInputProcessor: encode with the request's add_special_tokens (chat default: false).
    return list(tokenizer.encode(prompt, add_special_tokens=request.get("add_special_tokens", False)))


def engine_completion_ids(tokenizer: PreTrainedTokenizerBase, request: dict[str, Any]) -> list[int]:
    """Token ids ``trtllm-serve`` feeds its engine for a ``/v1/completions`` body."""
    prompt = request["prompt"]
    if isinstance(prompt, list):
        return list(prompt)
    return list(tokenizer.encode(prompt, add_special_tokens=request.get("add_special_tokens", True)))
