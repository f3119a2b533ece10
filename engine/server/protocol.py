"""Request models of the OpenAI-compatible API (OpenAI's fields plus vLLM's sampling extras).

Pydantic checks types and ranges; a failure becomes a 400 in OpenAI's error shape
(`engine.server.errors`). Before any of that, every string of a request body (prompts, messages,
names, `model`, `stop`, `user`, unknown fields too) must be valid Unicode: JSON's `\\ud800`
escapes decode to lone surrogates, which no tokenizer or encoder takes; such a body is a 400
naming the field (`messages.0.content`), without echoing the text. `sampling_kwargs` maps a
request onto `engine.sampling_params.SamplingParams` keyword arguments. Responses are plain dicts
built in `engine.server.app`.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.sampling_params import LOGIT_BIAS_MAX, SEED_MAX, SEED_MIN, StructuredOutputsParams
from engine.server.errors import INVALID_UNICODE, APIError, encodable
from engine.server.tools import ToolCalls

#: Most top log-probabilities a request may ask for per token (OpenAI's limit).
MAX_LOGPROBS = 20
#: Most candidates a completions request may ask for (`best_of`), as many as `n` may be.
MAX_BEST_OF = 64


class _Model(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


def _invalid_text(value: str) -> int:
    """The index of the first character of `value` UTF-8 cannot encode (a lone surrogate), or
    -1 when it is valid text."""
    if value.isascii():
        return -1
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return -1


def _first_invalid_text(value: Any, path: str) -> Optional[tuple[str, int, str]]:
    """(field path, index, character) of the first string in the JSON value `value` (object
    keys included) that is not valid Unicode; None when all are."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            at = _invalid_text(item)
            if at >= 0:
                return where, at, item[at]
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                sub_path = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and _invalid_text(key) >= 0:
                    return encodable(sub_path), _invalid_text(key), key[_invalid_text(key)]
                stack.append((sub, sub_path))
        elif isinstance(item, list) and not all(type(x) is int for x in item):
            stack.extend((sub, f"{where}.{i}") for i, sub in reversed(list(enumerate(item))))
    return None


def check_unicode(data: Any) -> Any:
    """`data` (a parsed JSON body) unchanged when every string in it is valid Unicode; else a
    pydantic error of type `errors.INVALID_UNICODE` naming the first field at fault."""
    bad = _first_invalid_text(data, "")
    if bad is not None:
        field, at, ch = bad
        raise PydanticCustomError(
            INVALID_UNICODE, "{field}: expected valid Unicode text, got a string with a lone "
            "surrogate (U+{code}) at character {at}; encode text as UTF-8 and escape only "
            "whole characters (\\ud83d\\ude00 pairs)",
            {"field": field or "body", "code": f"{ord(ch):04X}", "at": at})
    return data


class _Request(_Model):
    """A request body: its strings are checked to be valid Unicode before anything else."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(data)


class StreamOptions(_Model):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(_Model):
    """`response_format.json_schema`: the schema the output must validate against (OpenAI's
    `name`, `description` and `strict` are taken and not used: the schema is always enforced)."""

    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Model):
    """`response_format`: "text" (no constraint), "json_object" (JSON mode: a JSON object)
    or "json_schema" (with `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The constraint this format asks for (None for "text"); 400 naming
        `response_format.json_schema` when "json_schema" comes without one."""
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format.json_schema: expected an object with a "
                               "schema when type is 'json_schema', got nothing",
                               "response_format.json_schema")
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` extra field: exactly one of `json` (a schema), `json_object`,
    `regex`, `choice` (a list of strings) and `grammar` (EBNF)."""

    json_: Optional[Union[dict[str, Any], StrictStr]] = Field(None, alias="json")
    json_object: Optional[StrictBool] = None
    regex: Optional[StrictStr] = None
    choice: Optional[list[StrictStr]] = None
    grammar: Optional[StrictStr] = None

    def constraint(self) -> StructuredOutputsParams:
        """The constraint; 400 naming `structured_outputs` (and the part at fault) when it is
        not exactly one well-formed constraint."""
        try:
            return StructuredOutputsParams(json=self.json_, json_object=self.json_object,
                                           regex=self.regex, choice=self.choice,
                                           grammar=self.grammar)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(":", 1)[0]) from None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: Optional[StrictStr] = None
    n: StrictInt = Field(1, ge=1, le=64)
    temperature: Optional[StrictFloat] = Field(None, ge=0.0)
    top_p: Optional[StrictFloat] = Field(None, gt=0.0, le=1.0)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[StrictStr, StrictFloat]] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[StrictInt] = Field(None, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: Optional[list[StrictInt]] = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    structured_outputs: Optional[StructuredOutputs] = None
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0

    def check_beam_search(self) -> None:
        """With `use_beam_search` (`n` is the beam width, engine/server/beam_search.py): 400
        naming the first field it cannot go with (streaming, sampling, `n` above the widest
        search, logit_bias, constrained output)."""
        if not self.use_beam_search:
            return
        from engine.server.beam_search import MAX_BEAM_WIDTH

        conflicts = [("stream", self.stream, "false"), ("stop", bool(self.stop), "unset"),
                     ("n", self.n > MAX_BEAM_WIDTH, f"at most {MAX_BEAM_WIDTH} (the beam width)"),
                     ("temperature", bool(self.temperature), "0 or unset (the search ranks the "
                                                             "model's own log-probabilities)"),
                     ("logit_bias", bool(self.logit_bias), "unset"),
                     ("best_of", getattr(self, "best_of", None) not in (None, self.n),
                      "unset or n"),
                     ("tools", bool(getattr(self, "tools", None)), "unset")]
        found = self.constraint()
        if found is not None:
            conflicts.append((found[1], True, "unset (no constrained output)"))
        for field, conflict, expected in conflicts:
            if conflict:
                raise APIError(400, f"{field}: expected {expected} with use_beam_search, got "
                               f"{getattr(self, field)!r}", field)

    def logit_bias_ids(self, vocab_size: int) -> Optional[dict[int, float]]:
        """`logit_bias` with int keys; 400 naming `logit_bias` for a key that is not a token
        id in [0, vocab_size) or a bias outside [-100, 100]."""
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = int(key) if key.strip().isdigit() else -1
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: expected token ids in [0, {vocab_size}) as "
                               f"keys, got {key!r}", "logit_bias")
            if not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
                raise APIError(400, f"logit_bias: expected biases in [-{LOGIT_BIAS_MAX:g}, "
                               f"{LOGIT_BIAS_MAX:g}], got {value} for token {key}",
                               "logit_bias")
            bias[token] = float(value)
        return bias

    def constraint(self) -> Optional[tuple[StructuredOutputsParams, str]]:
        """(the output's constraint, the field it came from: `response_format` or
        `structured_outputs`), or None; 400 when both fields constrain the output."""
        fmt = self.response_format.constraint() if self.response_format else None
        extra = self.structured_outputs.constraint() if self.structured_outputs else None
        if fmt is not None and extra is not None:
            raise APIError(400, "structured_outputs: expected it or a constraining "
                           "response_format, got both", "structured_outputs")
        if fmt is not None:
            return fmt, "response_format"
        return None if extra is None else (extra, "structured_outputs")

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: Union[str, list[str], None]) -> Union[str, list[str], None]:
        items = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return value

    def base_sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments common to both endpoints."""
        kwargs: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_p=self.min_p, seed=self.seed, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = list(self.stop_token_ids)
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt` is a string, a list of strings, a list of token ids,
    or a list of token-id lists; each prompt yields `n` choices."""

    prompt: PromptType
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None
    add_special_tokens: StrictBool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Optional[str]) -> Optional[str]:
        if value:
            raise ValueError("suffix is not supported by this server; leave it out")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a token-id prompt must not be empty")
        return value

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts in order: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check_best_of(self) -> None:
        """400 naming `best_of` unless it is None or in [n, 64], and, when more than n, the
        request does not stream (the n best are known only at the end)."""
        if self.best_of is None:
            return
        if not self.n <= self.best_of <= MAX_BEST_OF:
            raise APIError(400, f"best_of: expected None or an integer in [n={self.n}, "
                           f"{MAX_BEST_OF}], got {self.best_of}", "best_of")
        if self.stream and self.best_of > self.n:
            raise APIError(400, f"best_of: expected at most n={self.n} when streaming (the "
                           f"best are known only at the end), got {self.best_of}", "best_of")


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Model):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Model):
    """An assistant message's earlier tool call (`tool_calls` in OpenAI's shape)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    """One chat message; `content` is a string or a list of text parts (joined). An assistant
    message may carry its `tool_calls`; a "tool" message answers one by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None

    def as_template_dict(self) -> dict[str, Any]:
        """The dict the chat template sees (`role`, `content` as one string; `tool_calls`
        with their arguments as objects when they are JSON, as templates expect;
        `tool_call_id`)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Model):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Model):
    """One entry of `tools`: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    """`tool_choice` naming one function: the reply is a call of it."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`. With neither `max_tokens` nor `max_completion_tokens`, a
    reply may use the rest of the context (`--max-model-len` minus the prompt)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False

    def tool_calls(self, parser: str = "hermes") -> ToolCalls:
        """How this request's tools are used (`engine.server.tools`): `tool_choice`, by
        default "auto" with tools and "none" without; "auto" replies read by `parser` (a
        name of `TOOL_CALL_PARSERS`)."""
        functions = {t.function.name: t.function.parameters or {"type": "object"}
                     for t in self.tools or ()}
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return ToolCalls(functions, choice.function.name, named=True, parser=parser)
        return ToolCalls(functions, choice or ("auto" if functions else "none"), parser=parser)

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as the chat template sees them (None when they are not to be used)."""
        if not self.tools or not self.tool_calls().active:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> Optional[tuple[StructuredOutputsParams, str]]:
        """As for completions, plus the constraint of a named or "required" `tool_choice`
        (400 when `response_format` or `structured_outputs` constrains the reply too)."""
        found = super().constraint()
        tools = self.tool_calls().constraint()
        if tools is None:
            return found
        if found is not None:
            raise APIError(400, f"tool_choice: expected 'none' or 'auto' with {found[1]}, got "
                           "a choice that constrains the reply too", "tool_choice")
        return tools, "tools"

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        """Top log-probabilities per token for the engine (None: no logprobs)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: expected logprobs=true when top_logprobs is set",
                           "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """`POST /tokenize`: either `prompt` or chat `messages` (vLLM's shape)."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Request):
    """`POST /detokenize`: token ids back to text."""

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]
