"""A model family other than the default through `python -m engine.serve`, with the official
`openai` client: the listing gives the checkpoint's name and its length limit, chats are rendered
by the checkpoint's own chat template, and greedy answers equal the offline engine's."""

from __future__ import annotations

import os

import pytest
import torch

from family_case import CHAT_TEMPLATE, write_checkpoint
from serve_process import ServerProcess

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

MAX_POSITIONS = 96


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True)
    return write_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3")), config)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    proc = ServerProcess("--model", qwen3_dir, "--dtype", "float32", "--num-threads", "1",
                         "--block-size", "4", "--num-kv-blocks", "64").start()
    yield proc
    proc.stop()


def test_listing_names_the_checkpoint_and_its_length(server, qwen3_dir):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    (model,) = client.models.list().data
    assert model.id == os.path.basename(qwen3_dir)
    assert model.model_extra["max_model_len"] == MAX_POSITIONS


def test_chat_uses_the_checkpoint_template_and_equals_the_engine(server, qwen3_dir):
    from engine import LLM, SamplingParams
    from engine.tokenizer import Tokenizer

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "hello world"}]
    tokenizer = Tokenizer.from_hf_dir(qwen3_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                           add_special_tokens=False)
    reply = client.chat.completions.create(model=os.path.basename(qwen3_dir), messages=messages,
                                           max_tokens=8, temperature=0.0)
    assert reply.usage.prompt_tokens == len(ids)
    offline = LLM(qwen3_dir, dtype=torch.float32, block_size=4, num_kv_blocks=64).chat(
        messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert list(offline[0].prompt_token_ids) == ids
    assert reply.choices[0].message.content == offline[0].outputs[0].text


def test_beam_search_through_the_server_equals_the_offline_search(server, qwen3_dir):
    """`use_beam_search` (vLLM's extra field; `n` is the beam width) runs one-token engine
    requests per beam and step; its hypotheses equal `LLM.beam_search` on the same model."""
    from engine import LLM
    from engine.sampling_params import BeamSearchParams

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    prompt = list(range(10, 23))
    reply = client.completions.create(model=os.path.basename(qwen3_dir), prompt=prompt, n=3,
                                      max_tokens=6, extra_body={"use_beam_search": True,
                                                                "ignore_eos": True})
    offline = LLM(qwen3_dir, dtype=torch.float32, block_size=4, num_kv_blocks=64).beam_search(
        [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                         ignore_eos=True))[0]
    assert [c.text for c in reply.choices] == [s.text for s in offline.sequences]
    assert reply.usage.completion_tokens == sum(len(s.token_ids) for s in offline.sequences)
    for extra, field in [({"stream": True}, "stream"), ({"n": 11}, "n"),
                         ({"temperature": 0.7}, "temperature")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=os.path.basename(qwen3_dir), prompt=prompt,
                                      max_tokens=4, **{"n": 2, **extra},
                                      extra_body={"use_beam_search": True})
        assert err.value.body["param"] == field
