"""What the engine returns, shaped like vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    - `index`: which of the request's `n` sequences (or beams) this is.
    - `text`: the detokenized output (stop string removed unless `include_stop_str_in_output`).
    - `token_ids`: the generated token ids (a stop token or EOS included, as vLLM does).
    - `cumulative_logprob`: sum of the chosen tokens' log-probabilities (raw logits' log-softmax).
    - `logprobs`: per generated token, `{token_id: logprob}` for the top-`logprobs` tokens and
      the chosen one; None unless the request asked for logprobs.
    - `finish_reason`: "stop" (EOS, stop token or stop string), "length" (max_tokens or the
      model's length limit), "abort", or None while unfinished; `stop_reason`: the stop string or
      stop token id that ended it, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt, its outputs (ordered by index), and whether it is
    finished. The engine's `step()` returns one for each request that produced tokens."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
