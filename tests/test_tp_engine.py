"""Tensor parallelism on CPU (gloo): N ranks give the tokens of one process, token for token.

A tiny random-weight Llama (4 query heads over 2 KV heads) runs with N = 2 (one KV head each)
and N = 4 (KV heads replicated, preemption by swap), the default model (9 heads over 3 KV
heads) with N = 3, all in float32, against N = 1 and transformers, with preemption (a tiny KV
pool) and prefix-cache hits.
Then the lifecycle: a worker killed with SIGKILL mid-run makes the engine raise within seconds
and leaves no process behind; the same outputs when `torchrun` starts the ranks; a server with
`--tensor-parallel-size 2` answers the openai client, serves the same /metrics names and ends
its workers when it stops.

Engines are shared per module (each start spawns processes that import torch: seconds each).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.executor import WorkerDiedError
from family_case import prompts, transformers_greedy, write_checkpoint
from serve_process import REPO, ServerProcess, free_port
from spec_timing import fake_step_times

NEW_TOKENS = 10
#: A pool of 12 blocks of 4 tokens: the batch below cannot run at once, so it preempts.
TINY_POOL = dict(dtype=torch.float32, block_size=4, num_kv_blocks=12, max_num_seqs=4)


def tiny_llama_config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("tp-llama")), tiny_llama_config())


def greedy(llm: LLM, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.executor.procs]


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    """Each pid has exited (a zombie not yet reaped counts as exited)."""
    deadline = time.monotonic() + within
    for pid in pids:
        while True:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"process {pid} still runs"
            time.sleep(0.1)


def run_cases(llm: LLM) -> dict[str, list[list[int]]]:
    """Greedy continuations of: a batch that preempts in `TINY_POOL`, one prompt with n = 2
    (copy-on-write), then prompts that share a prefix with one run before them (prefix-cache
    hits)."""
    batch = prompts(0, lens=(9, 5, 7, 11))
    shared = prompts(1, lens=(14, 13, 12), shared_prefix=8)
    out = {"preempt": greedy(llm, batch)}
    # n = 2: the two sequences share the prompt's last block, so the first decode copies it
    # (copy-on-write on every rank's cache)
    forked = llm.generate([{"prompt_token_ids": batch[0]}],
                          SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    out["fork"] = [list(c.token_ids) for c in forked.outputs]
    greedy(llm, shared[:1])
    out["prefix"] = greedy(llm, shared[1:])
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    llm.llm_engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def single(tiny):
    llm = LLM(tiny, **TINY_POOL)
    return run_cases(llm)


@pytest.fixture(scope="module")
def two_ranks(tiny):
    """An N = 2 engine for the equality test, then killed by the lifecycle test (one
    tensor-parallel engine per process at a time: it must be shut down before the next)."""
    llm = LLM(tiny, tensor_parallel_size=2, **TINY_POOL)
    yield llm
    llm.shutdown()


def test_two_ranks_equal_one_process_and_transformers(tiny, single, two_ranks):
    assert two_ranks.llm_engine.kv_cache.device_caches[0][0].shape[1] == 1  # 2 KV heads / 2
    got = run_cases(two_ranks)
    assert got == single
    assert got["preempt"] == transformers_greedy(tiny, prompts(0, lens=(9, 5, 7, 11)),
                                                 NEW_TOKENS)


def test_killed_worker_raises_within_seconds_and_leaves_no_process(two_ranks):
    llm = two_ranks
    pid = worker_pids(llm)[0]
    killed = []

    def kill_mid_run():
        while llm.llm_engine.stats().num_running == 0:  # generate has started
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    threading.Thread(target=kill_mid_run, daemon=True).start()
    with pytest.raises(WorkerDiedError, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
        greedy(llm, prompts(0, lens=(5,)), new_tokens=40)  # 12 blocks of 4 hold 48 tokens
    assert time.monotonic() - killed[0] < 5.0
    with pytest.raises(WorkerDiedError):  # and every later step
        greedy(llm, prompts(0, lens=(5,)))
    llm.shutdown()
    assert_gone([pid])


def test_four_ranks_replicate_kv_heads_and_equal_one_process_under_swap(tiny):
    """Also with n-gram speculation on the 4 ranks: the drafts travel in the step message."""
    swap = {**TINY_POOL, "preemption_mode": "swap"}  # swap-out / swap-in on every rank
    want = run_cases(LLM(tiny, **swap))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(tiny, tensor_parallel_size=4, speculative_config=ngram, **swap)
    pids = worker_pids(llm)
    assert len(pids) == 3
    try:
        assert llm.llm_engine.kv_cache.device_caches[0][0].shape[1] == 1  # 2 KV heads, 4 ranks
        fake_step_times(llm)
        assert run_cases(llm) == want
        assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_default_model_three_ranks_equals_one():
    batch = [[1, 504, 3575, 282, 4649, 314], [1, 9519, 2114, 253, 655]]
    settings = dict(quantization="none", dtype=torch.float32, num_kv_blocks=32)
    want = greedy(LLM(None, **settings), batch, 6)
    llm = LLM(None, tensor_parallel_size=3, **settings)
    try:
        assert llm.llm_engine.kv_cache.device_caches[0][0].shape[1] == 1  # 3 KV heads / 3
        assert greedy(llm, batch, 6) == want
    finally:
        llm.shutdown()


def test_heads_that_do_not_divide_fail_before_spawning(tiny):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="3"):
        LLM(tiny, tensor_parallel_size=3, **TINY_POOL)
    with pytest.raises(ValueError, match=r"draft_layers.*tensor_parallel_size=1"):
        LLM(tiny, tensor_parallel_size=2, speculative_config={"draft_layers": 1,
                                                              "num_speculative_tokens": 2})
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


TORCHRUN_SCRIPT = """
import json, sys
import torch
from engine import LLM, SamplingParams

if __name__ == "__main__":
    path, out, batch = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(path, tensor_parallel_size=2, dtype=torch.float32, block_size=4,
              num_kv_blocks=12, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=%d, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in got], f)
    llm.shutdown()
""" % NEW_TOKENS


def test_torchrun_two_ranks_same_outputs(tiny, single, tmp_path):
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(TORCHRUN_SCRIPT)
    batch = prompts(0, lens=(9, 5, 7, 11))
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), tiny,
         str(out), json.dumps(batch)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == single["preempt"]


def test_server_with_two_ranks(tiny):
    import httpx
    import openai

    server = ServerProcess("--model", tiny, "--tensor-parallel-size", "2", "--dtype",
                           "float32", "--block-size", "4", "--num-kv-blocks", "64").start()
    try:
        workers = psutil.Process(server.proc.pid).children(recursive=True)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        got = client.completions.create(model=tiny, prompt=prompts(0, lens=(9,))[0],
                                        max_tokens=NEW_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == NEW_TOKENS
        text = httpx.get(f"{server.base_url}/metrics").text
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
                     "vllm:time_to_first_token_seconds_bucket"):
            assert f"{name}{{" in text, name
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert_gone([p.pid for p in workers])
