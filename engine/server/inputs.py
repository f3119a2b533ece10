"""What a request gives the engine, checked: prompt token ids (from text, token ids or chat
messages), `max_tokens` against `max_model_len`, the stop strings against `ServerLimits`, and
`SamplingParams`. Every problem is a 400 `APIError` naming the request field at fault.

Cheap checks come first: a text that cannot fit `max_model_len` by its length alone (at least
`len(text) / tokenizer.max_chars_per_token` tokens) is refused before it is tokenised. The
functions that tokenise or render a chat template are the heavy part of a request; the server
runs them in its worker threads, off the event loop.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from engine.server.errors import APIError
from engine.server.limits import ServerLimits
from engine.server.protocol import ChatCompletionRequest


def check_stop(stop: Union[str, Sequence[str], None], limits: ServerLimits) -> None:
    """400 naming `stop` when it has more strings than `limits.max_stop_strings` or a string
    longer than `limits.max_stop_string_length` characters."""
    items = [stop] if isinstance(stop, str) else list(stop or ())
    if len(items) > limits.max_stop_strings:
        raise APIError(400, f"stop: expected at most {limits.max_stop_strings} strings "
                       f"(--max-stop-strings), got {len(items)}", "stop")
    for i, item in enumerate(items):
        if len(item) > limits.max_stop_string_length:
            raise APIError(400, f"stop: expected strings of at most "
                           f"{limits.max_stop_string_length} characters "
                           f"(--max-stop-string-length), got {len(item)} characters in "
                           f"stop.{i}", "stop")


def check_stop_token_ids(ids: Optional[Sequence[int]], vocab_size: int) -> None:
    """400 naming `stop_token_ids` unless every id is in the vocabulary."""
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: expected token ids in [0, {vocab_size}), got "
                       f"{bad[0]}", "stop_token_ids")


def check_text_fits(tokenizer: Any, text: str, max_model_len: int, requested: Optional[int],
                    param: str) -> None:
    """400 naming `param` when `text` has too many characters to fit `max_model_len` tokens
    (with `requested` more for the output) whatever its tokens: every token stands for at most
    `tokenizer.max_chars_per_token` characters. Nothing is refused that could fit."""
    least = tokenizer.min_num_tokens(text)
    why = (f"({len(text)} characters, at most {tokenizer.max_chars_per_token} per token)")
    if least >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                       f"(--max-model-len), but the prompt has at least {least} tokens {why}; "
                       "reduce the prompt", param)
    if requested is not None and least + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                       f"(--max-model-len), but at least {least + requested} were requested "
                       f"(at least {least} in the prompt {why}, {requested} for the "
                       "completion); reduce the prompt or max_tokens", "max_tokens")


def prompt_ids(tokenizer: Any, prompt: Union[str, list[int]], add_special_tokens: bool,
               max_model_len: Optional[int] = None, requested: Optional[int] = None
               ) -> list[int]:
    """`prompt`'s token ids: text is encoded, ids are checked against the vocabulary. With
    `max_model_len`, text that cannot fit (`check_text_fits`) is refused before encoding."""
    if isinstance(prompt, str):
        if max_model_len is not None:
            check_text_fits(tokenizer, prompt, max_model_len, requested, "prompt")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    vocab = tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {bad[0]}",
                       "prompt")
    return list(prompt)


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest,
                    max_model_len: Optional[int] = None) -> list[int]:
    """The token ids of `req.messages` rendered by the model's chat template (with the tools
    when they are to be used; a template that takes none ignores them); any template
    error is the request's fault (400, param "messages"). With `max_model_len`, a rendering
    that cannot fit (`check_text_fits`, with the request's max tokens) is refused before
    encoding."""
    messages = [m.as_template_dict() for m in req.messages]
    try:
        tools = req.template_tools()
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt,
            **({"tools": tools} if tools else {}))
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", "messages") from None
    except Exception as exc:  # a template error is the request's fault
        raise APIError(400, f"messages: the chat template rejected them "
                       f"({type(exc).__name__})", "messages") from None
    if max_model_len is not None:
        check_text_fits(tokenizer, text, max_model_len, req.requested_max_tokens, "messages")
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


def max_tokens(max_model_len: int, prompt_len: int, requested: Optional[int]) -> int:
    """`requested`, or all the room left; 400 (with the lengths) when it does not fit."""
    limit = max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens "
                       f"(--max-model-len), but the prompt has {prompt_len} tokens; reduce "
                       "the prompt", "messages" if requested is None else "prompt")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens "
                       f"(--max-model-len), but {prompt_len + requested} were requested "
                       f"({prompt_len} in the prompt, {requested} for the completion); "
                       "reduce the prompt or max_tokens", "max_tokens")
    return requested


def output_controls(engine: Any, req: Any) -> dict[str, Any]:
    """The SamplingParams keyword arguments of `req`'s `logit_bias` (ids checked against the
    model's vocabulary) and its output constraint (`response_format` or `structured_outputs`,
    compiled here through `engine.structured_output`, the compiled grammar cached for the
    engine); 400 naming the field at fault (a schema, regex or grammar that does not
    compile)."""
    kwargs: dict[str, Any] = {}
    bias = req.logit_bias_ids(engine.model_config.vocab_size) if req.logit_bias else None
    if bias:
        kwargs["logit_bias"] = bias
    found = req.constraint()
    if found is not None:
        spec, field = found
        try:
            engine.structured_output.compile(spec, field)
        except ValueError as exc:
            raise APIError(400, str(exc), field) from None
        kwargs["structured_outputs"] = spec
    return kwargs


def sampling_params(kwargs: dict[str, Any]) -> Any:
    """`SamplingParams(**kwargs)`; its ValueError or TypeError becomes a 400 whose param is the
    message's leading field name."""
    from engine.sampling_params import SamplingParams  # engine is heavy

    try:
        params = SamplingParams(**kwargs)
        _ = params.stop_matcher  # built here (a worker thread), not in the engine's
    except (ValueError, TypeError) as exc:
        param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        raise APIError(400, str(exc), param) from None
    return params
