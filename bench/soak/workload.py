"""What the soak's clients send: one `Spec` per request, drawn by `draw_spec`, and the greedy
reference prompts whose answers a clean run fixes.

Prompts share a long prefix (a system text for chat, the opening of a completion prompt), so the
prefix cache shares blocks between requests. Sizes are small (at most 42 prompt tokens for a
completion and 53 for a chat, at most `MAX_OUTPUT` new tokens, `n` up to 3 with at most
`MAX_OUTPUT_N3` tokens each) so that any one request fits in `MIN_KV_BLOCKS` blocks of 16 tokens
(the engine refuses a request that could never fit) while a few running together preempt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

#: Most new tokens a soak request asks for; with `n` = 3, `MAX_OUTPUT_N3`.
MAX_OUTPUT = 24
MAX_OUTPUT_N3 = 16
#: The smallest KV pool (blocks of 16 tokens) that holds any one soak request.
MIN_KV_BLOCKS = 12
#: The server's `--max-model-len` in the soak (a longer prompt is one of the bad requests).
MAX_MODEL_LEN = 512

SHARED_PREFIX = ("You are a careful assistant that answers in plain English. Keep every answer "
                 "short, concrete and friendly, and never invent facts you are unsure of. ")
_TOPICS = ("the sea", "volcanoes", "bread", "the moon", "bicycles", "rain", "chess", "bees",
           "maps", "glass", "clocks", "salt", "trains", "owls", "paper", "copper")
_ASKS = ("Tell me one fact about {}.", "Describe {} in a sentence.", "Why do people like {}?",
         "Write a line of a poem about {}.", "What is the history of {}?")
STOP_SETS = (["."], ["\n"], [" the", ","], ["!", "?", "."])

#: Request kinds and their weights in the mix.
KIND_WEIGHTS = {"greedy": 4, "sampled": 3, "n_best": 2, "stop": 2, "bad": 2, "disconnect": 2}


@dataclass
class Spec:
    """One request. `api`: "completion" or "chat"; `client`: "openai" (the official client) or
    "httpx" (raw HTTP); `body`: the JSON body (or `raw_body` bytes sent as is); `expect_status`
    and `expect_param` for a bad request; `disconnect_after`: for a disconnecting client, the
    stream chunks read (streaming) or the seconds waited (non-streaming) before it leaves;
    `reference`: the index of the greedy reference it must reproduce."""

    kind: str
    api: str
    client: str
    body: dict[str, Any] = field(default_factory=dict)
    raw_body: Optional[bytes] = None
    method: str = "POST"
    path: str = ""
    expect_status: Optional[int] = None
    expect_param: Optional[str] = None
    disconnect_after: Optional[float] = None
    reference: Optional[int] = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def url_path(self) -> str:
        return self.path or ("/v1/completions" if self.api == "completion"
                             else "/v1/chat/completions")

    @property
    def num_choices(self) -> int:
        return int(self.body.get("n", 1))


def question(rng: random.Random) -> str:
    return rng.choice(_ASKS).format(rng.choice(_TOPICS))


def base_body(api: str, text: str, max_tokens: int) -> dict[str, Any]:
    """A completion (shared prefix + `text`) or a chat (shared prefix as the system message)."""
    if api == "completion":
        return {"prompt": SHARED_PREFIX + text + "\nAnswer:", "max_tokens": max_tokens}
    return {"messages": [{"role": "system", "content": SHARED_PREFIX},
                         {"role": "user", "content": text}], "max_tokens": max_tokens}


def reference_bodies(num: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """`num` greedy requests `(api, body)`, alternately completions and chats."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        api = "completion" if i % 2 == 0 else "chat"
        body = base_body(api, question(rng), rng.randint(8, MAX_OUTPUT))
        body.update(temperature=0.0, ignore_eos=True)
        out.append((api, body))
    return out


def draw_spec(rng: random.Random, references: list[tuple[str, dict[str, Any]]],
              model: str) -> Spec:
    """One request of a kind drawn from `KIND_WEIGHTS`."""
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    if kind == "bad":
        return bad_spec(rng, model)
    if kind == "greedy":
        index = rng.randrange(len(references))
        api, body = references[index]
        spec = Spec(kind, api, rng.choice(("openai", "httpx")), dict(body), reference=index)
    else:
        api = "completion" if kind in ("n_best", "stop") else rng.choice(("completion", "chat"))
        body = base_body(api, question(rng), rng.randint(4, MAX_OUTPUT))
        body.update(temperature=0.8, seed=rng.randrange(1 << 31))
        if kind == "n_best":
            body["n"] = rng.randint(2, 3)
            if body["n"] == 3:
                body["max_tokens"] = min(body["max_tokens"], MAX_OUTPUT_N3)
        if kind == "stop":
            body["stop"] = rng.choice(STOP_SETS)
        client = "httpx" if kind == "disconnect" else rng.choice(("openai", "httpx"))
        spec = Spec(kind, api, client, body)
        if kind == "disconnect":
            spec.body["stream"] = rng.random() < 0.5
            spec.disconnect_after = (rng.randint(0, 3) if spec.stream
                                     else rng.uniform(0.05, 1.5))
    spec.body["model"] = model
    if kind != "disconnect":
        spec.body["stream"] = rng.random() < 0.5
    if spec.stream:
        spec.body["stream_options"] = {"include_usage": True}
    return spec


def bad_spec(rng: random.Random, model: str) -> Spec:
    """A request the server must refuse with a given 4xx (and name the field where it can)."""
    case = rng.randrange(len(_BAD_CASES))
    status, param, api, change = _BAD_CASES[case]
    body = base_body(api, "hello", 4)
    body["model"] = model
    spec = Spec("bad", api, "httpx", body, expect_status=status, expect_param=param)
    change(spec)
    return spec


def _set(**fields: Any) -> Any:
    return lambda spec: spec.body.update(fields)


def _raw(data: bytes) -> Any:
    def change(spec: Spec) -> None:
        spec.raw_body = data
    return change


def _method(method: str) -> Any:
    def change(spec: Spec) -> None:
        spec.method = method
    return change


def _fault(body: dict[str, Any]) -> Any:
    def change(spec: Spec) -> None:
        spec.path, spec.body = "/debug/faults", body
    return change


#: (status, param or None, api, how the good body is spoiled).
_BAD_CASES: list[tuple[int, Optional[str], str, Any]] = [
    (400, "temperature", "completion", _set(temperature=-1.0)),
    (400, "max_tokens", "completion", _set(max_tokens=0)),
    (400, "n", "chat", _set(n=0)),
    (400, "top_p", "chat", _set(top_p=2.0)),
    (404, "model", "completion", _set(model="no-such-model")),
    (400, None, "completion", _raw(b'{"prompt": "unterminated')),
    (400, "prompt", "completion", _set(prompt=[10 ** 9])),
    (400, "prompt", "completion", _set(prompt=[17] * (MAX_MODEL_LEN + 8))),
    (400, "messages", "chat", _set(messages=[])),
    (400, "prompt", "completion",
     _raw(json.dumps({"prompt": "x"}).encode().replace(b'"x"', b'"\\ud800 lone"'))),
    (400, "seed", "completion", _set(seed=1 << 70)),
    (400, "stop", "completion", _set(stop=["."] * 1000)),
    (405, None, "completion", _method("GET")),
    (400, "kind", "completion", _fault({"kind": "no-such-fault"})),
]
