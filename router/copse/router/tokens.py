"""Turning a request's prompt into exactly the token ids the engine will cache.

The router hashes a prompt's token ids into KV block hashes; an engine's KV events carry the
hashes of the token ids *it* tokenized. The two meet only if the router tokenizes exactly as
the engine does, so each engine kind has its tokenizer here:

* :class:`MockPromptTokenizer`: copse's mocked engines (:mod:`copse.workers.protocol.tokenizer`).
* :class:`HfPromptTokenizer`: a real ``trtllm-serve``. What it does to a request, read in
  TensorRT-LLM's sources (``serve/openai_server.py``, ``serve/chat_utils.py``,
  ``serve/openai_protocol.py``, ``inputs/utils.py``, ``inputs/registry.py``) and in the
  ``transformers`` release it pins (4.57, ``PreTrainedTokenizerBase.apply_chat_template``):

  - ``/v1/completions`` with a text prompt: ``tokenizer.encode(prompt,
    add_special_tokens=request.add_special_tokens)``; the request's default is ``true``, so a
    Llama-style tokenizer prepends BOS.
  - ``/v1/chat/completions``: each message becomes ``{"role", "content", "media": []}`` with its
    text parts joined by ``"\\n"`` (no content: ``""``); the model's Hugging Face chat template
    renders them (``tokenize=False``) with ``add_generation_prompt`` (default ``true``),
    ``documents``, ``tools=None`` and, as variables, the tokenizer's special tokens
    (``bos_token``, ``eos_token``, ...) overridden by ``chat_template_kwargs``; the text is then
    encoded with ``add_special_tokens=request.add_special_tokens`` whose chat default is
    ``false`` (the template writes BOS itself). A request's ``chat_template`` replaces the
    model's (a name picks one of the model's named templates).
  - The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``,
    the ``loopcontrols`` extension and ``{% generation %}`` blocks, and the globals and filters
    ``transformers`` adds: ``raise_exception`` (an error), ``strftime_now`` and a ``tojson`` that
    does not escape HTML or non-ASCII.
  - The template comes from ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``)
    when the model directory has them, else from ``tokenizer_config.json``'s ``chat_template``
    (a string, or a list of named templates: ``default`` is used).
  - ``transformers`` loads ``tokenizer.json`` with truncation and padding off and, for the Llama,
    Code Llama, Gemma, Cohere and GPT-NeoX tokenizer classes, rebuilds the post-processor from
    ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` (class defaults when
    absent); so does this module.

  Not covered (the router's estimate is then off, never the engine's answer, which the engine
  computes itself): tool definitions and assistant ``tool_calls`` (copse's request schema takes
  neither), multimodal content, ``trtllm-serve --chat_template`` overrides, models with their own
  Python tokenizer (DeepSeek V3.2/V4 ``custom_tokenizer``), and tokens that
  ``tokenizer_config.json``'s ``added_tokens_decoder`` adds beyond ``tokenizer.json``.

Token-id prompts (a completion's ``prompt`` as ids, a chat's ``prompt_token_ids``) pass through
unchanged for every engine, as ``trtllm-serve`` uses them without rendering or encoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors
from tokenizers.decoders import DecodeStream

from copse.router.config import RouterConfig
from copse.workers.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    TokenIds,
)
from copse.workers.protocol.tokenizer import chat_tokens, encode

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"

#: The special-token attributes ``transformers`` passes to chat templates (``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)

#: Tokenizer classes whose ``transformers`` fast tokenizer rebuilds its post-processor from
#: ``add_bos_token``/``add_eos_token``: class -> (default BOS, default EOS, add BOS, add EOS).
_BOS_EOS_CLASSES: dict[str, tuple[str | None, str | None, bool, bool]] = {
    "LlamaTokenizer": ("<s>", "</s>", True, False),
    "CodeLlamaTokenizer": ("<s>", "</s>", True, False),
    "GemmaTokenizer": ("<bos>", "<eos>", True, False),
    "CohereTokenizer": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", True, False),
    "GPTNeoXTokenizer": ("<|endoftext|>", "<|endoftext|>", False, False),
}


class PromptTokenizer(Protocol):
    """Text prompts and chats to the token ids an engine caches."""

    def completion_tokens(self, prompt: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of a completion's text prompt."""
        ...

    def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        """Token ids of a chat request's rendered prompt. Raises :class:`RequestError` when the
        chat cannot be rendered (the engine would refuse it too)."""
        ...


class MockPromptTokenizer:
    """Copse's mocked engines: their word-hash tokenizer and fixed chat template."""

    def completion_tokens(self, prompt: str, *, add_special_tokens: bool) -> list[int]:
        return encode(prompt)

    def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        return chat_tokens(request.turns(), add_generation_prompt=request.add_generation_prompt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (``transformers`` uses the
    block only to find the assistant's tokens in training; rendering is unchanged)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as ``transformers`` compiles it. Raises ``jinja2.TemplateSyntaxError``."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from exc
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return loaded


def model_directory(directory: Path) -> Path:
    """``directory``, or, when it is a Hugging Face hub cache folder of a model
    (``<HF_HUB_CACHE>/models--<org>--<name>``, what ``snapshot_download`` and the operator's weights
    Job fill), the snapshot its ``refs/main`` names: a manifest can point the router at the model
    cache without knowing the revision that was downloaded."""
    ref = directory / "refs" / "main"
    if (directory / TOKENIZER_FILE).exists() or not ref.is_file():
        return directory
    revision = ref.read_text().strip()
    snapshot = directory / "snapshots" / revision
    if not revision or not snapshot.is_dir():
        raise ValueError(f"{ref} names revision {revision!r}, but there is no {snapshot}")
    return snapshot


class HfPromptTokenizer:
    """A Hugging Face model directory's tokenizer and chat template, applied as ``trtllm-serve``
    applies them (see the module documentation for what that is). ``directory`` may also be the
    model's hub cache folder (:func:`model_directory`)."""

    def __init__(self, directory: Path) -> None:
        directory = model_directory(directory)
        if directory.is_file():
            raise ValueError(
                f"{directory} is a file; give the model directory holding {TOKENIZER_FILE} "
                f"and {TOKENIZER_CONFIG_FILE}"
            )
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{directory}: no {TOKENIZER_FILE} (the model's fast tokenizer)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"{path}: cannot load ({exc})") from exc
        # transformers encodes without tokenizer.json's truncation or padding unless asked to.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        legacy_path = directory / SPECIAL_TOKENS_MAP_FILE
        legacy = _read_json(legacy_path) if legacy_path.is_file() else {}
        self.special_tokens = self._special_tokens(config, legacy)
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        """Whether decoded text is cleaned up (``transformers`` 4.57's default: no)."""
        self._apply_bos_eos(config)
        self.templates = self._templates(directory, config)
        for name, source in self.templates.items():
            try:
                compile_chat_template(source)
            except jinja2.TemplateSyntaxError as exc:
                where = CHAT_TEMPLATE_FILE if name == "default" else f"chat template {name!r}"
                raise ValueError(f"{directory}: {where} is not valid Jinja: {exc}") from exc

    @staticmethod
    def _special_tokens(config: Mapping[str, Any], legacy: Mapping[str, Any]) -> dict[str, Any]:
        """The template's special-token variables: ``tokenizer_config.json`` first, the legacy
        ``special_tokens_map.json`` for the rest; empty ones are left out, as ``transformers`` does."""
        tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name, legacy.get(name))
            if name == "additional_special_tokens":
                extra = [text for item in value or () if (text := _token_text(item))]
                if extra:
                    tokens[name] = extra
            elif text := _token_text(value):
                tokens[name] = text
        return tokens

    def _apply_bos_eos(self, config: Mapping[str, Any]) -> None:
        """What the Llama-family fast tokenizers of ``transformers`` do in ``__init__``: replace the
        post-processor by ``[BOS] $A [EOS]`` according to ``add_bos_token``/``add_eos_token``."""
        kind = str(config.get("tokenizer_class") or "").removesuffix("Fast")
        if kind not in _BOS_EOS_CLASSES:
            return
        default_bos, default_eos, default_add_bos, default_add_eos = _BOS_EOS_CLASSES[kind]
        bos = self.special_tokens.get("bos_token", default_bos)
        eos = self.special_tokens.get("eos_token", default_eos)
        add_bos = bool(config.get("add_bos_token", default_add_bos))
        add_eos = bool(config.get("add_eos_token", default_add_eos))
        specials: list[tuple[str, int]] = []
        for wanted, token, which in ((add_bos, bos, "bos_token"), (add_eos, eos, "eos_token")):
            if not wanted:
                continue
            token_id = None if token is None else self._tokenizer.token_to_id(token)
            if token is None or token_id is None:
                raise ValueError(
                    f"{TOKENIZER_CONFIG_FILE}: add_{which} is true but {which} {token!r} "
                    "is not in the vocabulary"
                )
            specials.append((token, token_id))
        single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
        pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
        self._tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )

    @staticmethod
    def _templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
        """Named chat templates; ``default`` is the model's own."""
        templates: dict[str, str] = {}
        jinja_file = directory / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = directory / ADDITIONAL_CHAT_TEMPLATES_DIR
        if extra_dir.is_dir():
            for extra in sorted(extra_dir.glob("*.jinja")):
                templates[extra.stem] = extra.read_text(encoding="utf-8")
        if templates:
            return templates  # files take priority over the config's entries
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return {"default": configured}
        if isinstance(configured, list):
            for entry in configured:
                if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)):
                    raise ValueError(
                        f"{TOKENIZER_CONFIG_FILE}: chat_template entries need a name and a template"
                    )
                templates[entry["name"]] = str(entry.get("template", ""))
        return templates

    def _template(self, requested: str | None) -> jinja2.Template:
        """The template a request renders with, chosen as ``get_chat_template`` chooses it."""
        if requested is not None:
            source = self.templates.get(requested, requested)
        elif "default" in self.templates:
            source = self.templates["default"]
        elif self.templates:
            names = ", ".join(sorted(self.templates))
            raise RequestError(
                f"the model has several chat templates and none is named 'default'; "
                f"name one in chat_template ({names})",
                param="chat_template",
            )
        else:
            raise RequestError(
                f"the model has no chat template ({CHAT_TEMPLATE_FILE} or chat_template in "
                f"{TOKENIZER_CONFIG_FILE}); send a chat_template or use /v1/completions",
                param="messages",
            )
        try:
            return compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise RequestError(f"chat_template is not valid Jinja: {exc}", param="chat_template") from exc

    def render_chat(self, request: ChatCompletionRequest) -> str:
        """The prompt text the model's chat template renders for ``request``."""
        template = self._template(request.chat_template)
        messages = [{"role": role, "content": text, "media": []} for role, text in request.turns()]
        variables = {**self.special_tokens, **(request.chat_template_kwargs or {})}
        try:
            return template.render(
                messages=messages,
                tools=None,
                documents=request.documents,
                add_generation_prompt=request.add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template refused the messages: {exc}", param="messages") from exc

    def completion_tokens(self, prompt: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)

    def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        return self.completion_tokens(
            self.render_chat(request), add_special_tokens=request.add_special_tokens
        )

    def stop_ids(self, stop: str) -> list[int]:
        """The token ids ``trtllm-serve`` stops on for a stop string (``SamplingParams._setup``
        encodes it without special tokens)."""
        return self.completion_tokens(stop, add_special_tokens=False)

    def stream_decoder(self, *, skip_special_tokens: bool) -> StreamDecoder:
        """A decoder of one output's streamed token ids, as ``trtllm-serve`` decodes them."""
        return StreamDecoder(
            self._tokenizer, skip_special_tokens=skip_special_tokens, clean_up=self.clean_up_spaces
        )


def clean_up_tokenization(text: str) -> str:
    """``transformers``' ``clean_up_tokenization`` (4.57): no space before punctuation and contractions."""
    for before, after in _CLEAN_UPS:
        text = text.replace(before, after)
    return text


_CLEAN_UPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class StreamDecoder:
    """Streamed token ids to text the way ``trtllm-serve`` decodes a stream by default
    (``TransformersTokenizer.hf_decode_incrementally``, chosen for fast tokenizers while
    ``spaces_between_special_tokens`` is true and the stream interval below 24): one
    ``tokenizers`` ``DecodeStream`` per output, stepped token by token (a token that ends inside a
    multi-byte character gives nothing until the character is whole), the pieces of one chunk
    joined and cleaned up (``clean_up_tokenization_spaces`` of ``tokenizer_config.json``) chunk by
    chunk. Bytes of a character the stream never completes are never shown, as there."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool, clean_up: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._clean_up = clean_up

    def decode(self, ids: Sequence[int]) -> str:
        """The text one chunk's token ids add."""
        pieces = [piece for token in ids if (piece := self._stream.step(self._tokenizer, token)) is not None]
        text = "".join(pieces)
        return clean_up_tokenization(text) if self._clean_up else text


def load_tokenizer(config: RouterConfig) -> PromptTokenizer:
    """The tokenizer of the configured engines. Raises ``ValueError`` naming the problem."""
    if config.engine == "mock":
        return MockPromptTokenizer()
    assert config.tokenizer is not None  # the config requires it with engine: trtllm
    try:
        return HfPromptTokenizer(config.tokenizer)
    except ValueError as exc:
        raise ValueError(f"tokenizer: {exc}") from exc


def prompt_tokens(request: CompletionRequest | ChatCompletionRequest, tokenizer: PromptTokenizer) -> TokenIds:
    """The token ids the engine will see for ``request``'s prompt (a tuple: see
    :data:`~copse.workers.protocol.openai_api.TokenIds`). Raises :class:`RequestError`."""
    if isinstance(request, ChatCompletionRequest):
        if request.prompt_token_ids is not None:  # already rendered and tokenized: used as is
            return request.prompt_token_ids
        return tuple(tokenizer.chat_tokens(request))
    if isinstance(request.prompt, str):
        return tuple(
            tokenizer.completion_tokens(request.prompt, add_special_tokens=request.add_special_tokens)
        )
    return request.prompt
