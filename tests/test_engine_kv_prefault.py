"""`EngineConfig.prefault_kv_cache` (the server's `--prefault-kv-cache`, on by default there): the
CPU KV pools are made resident when the cache is built, and nothing else changes; off (the
library's default), a pool costs no resident memory until its blocks are written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kv_cache import KVCache
from engine.model.loader import load_model

LAYERS, KV_HEADS, HEAD_SIZE, BLOCKS, BLOCK_SIZE = 4, 2, 64, 1024, 16
POOL_KIB = LAYERS * 2 * BLOCKS * KV_HEADS * BLOCK_SIZE * HEAD_SIZE * 2 // 1024  # 32 MiB


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.parametrize("prefault", [False, True])
def test_the_pools_are_resident_only_when_prefaulted(prefault: bool):
    """A 32 MiB device pool and a 32 MiB host pool: resident at construction with `prefault`,
    not without (then only what is written becomes resident); they read zero either way."""
    before = _rss_kib()
    cache = KVCache(LAYERS, KV_HEADS, HEAD_SIZE, BLOCKS, BLOCK_SIZE, torch.bfloat16,
                    num_host_blocks=BLOCKS, prefault=prefault)
    grown = _rss_kib() - before
    if prefault:
        assert grown > 2 * POOL_KIB * 3 // 4
    else:
        assert grown < POOL_KIB // 4
    for k, v in cache.device_caches + cache.host_caches:
        assert int(torch.count_nonzero(k)) == 0 and int(torch.count_nonzero(v)) == 0


def test_the_setting_is_a_bool():
    with pytest.raises(ValueError, match="prefault_kv_cache: expected a bool, got 1"):
        EngineConfig(prefault_kv_cache=1)


def test_generation_is_the_same_with_a_prefaulted_pool():
    """Greedy output of the default model with and without prefaulting: the same tokens."""
    loaded = load_model(None, dtype=torch.float32)
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3,")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = []
    for prefault in (False, True):
        llm = LLM(model=loaded, num_kv_blocks=64, prefault_kv_cache=prefault)
        outs.append([o.outputs[0].token_ids for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
    assert outs[0] == outs[1]
