"""What a request gives the engine, checked: prompt token ids (from text, token ids or chat
messages), `max_tokens` against `max_model_len`, and `SamplingParams`. Every problem is a 400
`APIError` naming the request field at fault."""

from __future__ import annotations

from typing import Any, Optional, Union

from engine.server.errors import APIError
from engine.server.protocol import ChatCompletionRequest


def prompt_ids(tokenizer: Any, prompt: Union[str, list[int]],
               add_special_tokens: bool) -> list[int]:
    """`prompt`'s token ids: text is encoded, ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    vocab = tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {bad[0]}",
                       "prompt")
    return list(prompt)


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """The token ids of `req.messages` rendered by the model's chat template; any template
    error is the request's fault (400, param "messages")."""
    messages = [m.as_template_dict() for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", "messages") from None
    except Exception as exc:  # a template error is the request's fault
        raise APIError(400, f"messages: the chat template rejected them "
                       f"({type(exc).__name__})", "messages") from None
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


def sampling_params(kwargs: dict[str, Any]) -> Any:
    """`SamplingParams(**kwargs)`; its ValueError or TypeError becomes a 400 whose param is the
    message's leading field name."""
    from engine.sampling_params import SamplingParams  # engine is heavy

    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        raise APIError(400, str(exc), param) from None
