"""A model family against transformers on a tiny random checkpoint (the family tests' harness).

`write_checkpoint` builds the family's model with transformers from its own config class, gives
every tensor random values large enough that greedy choices are clear (matrices ~N(0, 0.2^2),
norm weights around their neutral value, biases ~N(0, 0.1^2)), and saves it as a Hugging Face
directory (config.json, model.safetensors, a small byte-level BPE tokenizer with a chat template).

`assert_engine_matches_transformers` runs the engine's greedy continuations of a batch of
different-length prompts in every `CASES` setting (chunked prefill, prefix-cache hits,
preemption by recompute and by swap) and compares them token for token with transformers' own
generation, one prompt at a time on a fresh copy of the model. Each case also asserts that its
feature happened (chunks, cache hits, preemptions) and that the engine's books balance
(`check_integrity`).
"""

from __future__ import annotations

import copy
import json
import os
import random
from typing import Any, Optional

import torch

VOCAB = 300
#: Prompt lengths of the batch: several blocks of 4, one shorter than a block, longer than a
#: chunk of `CASES["chunked"]`.
PROMPT_LENS = (37, 5, 23, 11)
NEW_TOKENS = 32
BLOCK_SIZE = 4
#: The small case for the slow backends (cuda-host, the Triton interpreter): two prompts, one
#: past a window of up to 12 positions, prefilled in chunks of `SMALL_CHUNK`, a few new tokens.
SMALL_LENS = (13, 6)
SMALL_NEW_TOKENS = 4
SMALL_CHUNK = 8
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")

#: Engine settings of each case (float32, blocks of 4 tokens).
CASES: dict[str, dict[str, Any]] = {
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "prefix": dict(enable_prefix_caching=True),
    "recompute": dict(num_kv_blocks=40, max_num_seqs=4, enable_prefix_caching=False,
                      preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=40, max_num_seqs=4, enable_prefix_caching=False,
                 preemption_mode="swap"),
}


def tiny_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    """Writes a byte-level BPE `tokenizer.json` (specials `<unk>` 0, `<s>` 1, `</s>` 2) and a
    `tokenizer_config.json` with `CHAT_TEMPLATE` into `path`."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, the paged cache says hello"] * 20, trainer)
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, norm_center: float = 1.0) -> None:
    """Random values in every parameter of a transformers model: norm weights (1-D, named
    "norm") `norm_center + N(0, 0.1^2)`, other 1-D tensors (biases) N(0, 0.1^2), matrices
    N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.dim() > 1:
            p.copy_(0.2 * noise)
        elif "norm" in name:
            p.copy_(norm_center + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)


def write_checkpoint(path: str, hf_config: Any, seed: int = 0,
                     norm_center: float = 1.0) -> str:
    """Saves a random-weight model of transformers config `hf_config` (float32) with the tiny
    tokenizer into directory `path`; returns `path`. `norm_center` is the neutral value of the
    family's norm weights (0.0 where RMSNorm multiplies by `1 + weight`)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(model, seed, norm_center)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(path, hf_config.vocab_size)
    return path


def prompts(seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS,
            shared_prefix: int = 0) -> list[list[int]]:
    """Random prompts of `lens` tokens (ids 3 .. VOCAB-1), the first `shared_prefix` tokens of
    each equal to the first prompt's."""
    rng = random.Random(seed)
    out = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]
    for p in out[1:]:
        p[:shared_prefix] = out[0][:min(shared_prefix, len(p))]
    return out


@torch.no_grad()
def transformers_greedy(path: str, batch: list[list[int]],
                        new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuations (no end-of-sequence stop) of each prompt, each run
    alone on a fresh copy of the model loaded from `path` in float32."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    out = []
    for prompt in batch:
        model = copy.deepcopy(base)  # rotary scalings that depend on the length keep state
        model.generation_config = config  # replaces the file's, whose eos would stop early
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids))
        out.append(generated[0, len(prompt):].tolist())
    return out


def engine_greedy(path: str, batch: list[list[int]], new_tokens: int = NEW_TOKENS,
                  warm: Optional[list[list[int]]] = None, **settings: Any) -> tuple[list, Any]:
    """The engine's greedy continuations of `batch` (one `generate` call) and the engine, in
    float32 with `BLOCK_SIZE`-token blocks, 256 of them unless `settings` (LLM's arguments)
    say otherwise. `warm` prompts run first, in their own call (for prefix-cache hits).
    Checks the engine's integrity."""
    from engine import LLM, SamplingParams

    # a pool of its own size: the default budget (hundreds of MiB for a tiny model) takes
    # seconds to allocate and zero
    settings = {"dtype": torch.float32, "block_size": BLOCK_SIZE, "num_kv_blocks": 256,
                **settings}
    llm = LLM(path, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    if warm:
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    return [list(o.outputs[0].token_ids) for o in outputs], llm.llm_engine


def assert_engine_matches_transformers(path: str, cases: tuple[str, ...] = tuple(CASES),
                                       seed: int = 0, **settings: Any) -> None:
    """The engine equals transformers token for token on `path` in each of `cases` (names of
    `CASES`), each case asserting that its feature happened; `settings` go to every case (a
    backend, say)."""
    batch = prompts(seed)
    shared = prompts(seed + 1, shared_prefix=20)
    want = transformers_greedy(path, batch)
    want_shared = None
    for case in cases:
        run = {**CASES[case], **settings}
        if case == "prefix":
            if want_shared is None:
                want_shared = transformers_greedy(path, shared[1:])
            got, engine = engine_greedy(path, shared[1:], warm=shared[:1], **run)
            assert engine.stats().prefix_cache_hits > 0, "prefix: no cache hit happened"
            assert got == want_shared, f"prefix: engine {got} != transformers {want_shared}"
            continue
        got, engine = engine_greedy(path, batch, **run)
        if case in ("recompute", "swap"):
            assert engine.stats().num_preemptions > 0, f"{case}: no preemption happened"
        if case == "chunked":
            assert max(map(len, batch)) > run["max_num_batched_tokens"]
        assert got == want, f"{case}: engine {got} != transformers {want}"


def assert_small_case_matches(path: str, seed: int = 0, lens: tuple[int, ...] = SMALL_LENS,
                              new_tokens: int = SMALL_NEW_TOKENS, **settings: Any) -> None:
    """The engine equals transformers token for token on `lens` prompts and `new_tokens` new
    tokens, prefilled in chunks of `SMALL_CHUNK` (no prefix cache): the case for backends too
    slow for `assert_engine_matches_transformers`; `settings` go to the engine (a backend)."""
    batch = prompts(seed, lens)
    assert max(lens) > SMALL_CHUNK
    want = transformers_greedy(path, batch, new_tokens)
    got, _ = engine_greedy(path, batch, new_tokens, max_num_batched_tokens=SMALL_CHUNK,
                           enable_prefix_caching=False, **settings)
    assert got == want, f"small case: engine {got} != transformers {want}"
