"""engine/server/responses.py without a server: stream chunks encoded with their fixed fields
encoded once are the events of the whole chunk."""

from __future__ import annotations

import json

import pytest

from engine.server import responses as R


@pytest.mark.parametrize("extra", [None, {"usage": None}])
def test_chunk_encoder_events_are_the_whole_chunk(extra):
    fixed = {"id": 'cmpl-"é\\', "object": "text_completion", "created": 7, "model": "m/ü"}
    encoder = R.ChunkEncoder({**fixed, "choices": []}, extra)
    for choices in ([], [R.completion_choice(0, 'a "quoted"\nline é', None, None, None)],
                    [R.completion_choice(1, "", {"tokens": ["x"]}, "stop", "\n\n")]):
        event = encoder.event(choices)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        body = json.loads(event[len(b"data: "):-2].decode("utf-8"))
        assert body == {**fixed, "choices": choices, **(extra or {})}
        assert list(body) == [*fixed, "choices", *(extra or {})]  # the order OpenAI sends
        assert event == R.sse({**fixed, "choices": choices, **(extra or {})})

