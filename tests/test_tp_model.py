"""The tensor-parallel model shard (engine/model/sharding.py) against the unsharded model.

One group of 4 ranks (the test's process and 3 spawned with torch.multiprocessing, gloo on
loopback, one thread each) runs every case: each rank loads its shard of a small random-weight
checkpoint (tests/family_case.py) with `load_model(..., tp=...)` and runs a mixed prefill (one
sequence in two chunks, windows shorter than the prompts) and decode steps through `forward` and
`compute_logits` on its own NaN-filled paged KV cache of its KV heads (the same random block
tables on every rank); rank 0 then runs the unsharded model (one process, tp=SINGLE) on the same
steps. The oracle is that unsharded model: every row of logits must match (float32) and so must
every greedy choice. The N=2 cases run on a subgroup of ranks 0 and 1.

Cases: Llama with Q/K/V/O and MLP biases and a vocabulary that does not split evenly (N=2, 4);
grouped queries with fewer KV heads than ranks (replicated KV heads) and a tied output head;
Qwen3 (per-head Q/K norms, biases); Gemma 2 (sandwich norms, soft caps, sliding windows);
Phi-3 (fused q/k/v and gate/up checkpoint tensors, one KV head over two ranks). Without
processes: the error for heads that do not split, and the shapes and bytes of a loaded shard.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import pytest
import torch

from engine.model import AttentionMetadata, DecoderConfig
from engine.model.decoder import DecoderForCausalLM, check_tensor_parallel
from engine.model.loader import load_model
from engine.model.sharding import take_blocks
from engine.parallel_state import SINGLE, TensorParallel
from family_case import write_checkpoint

BLOCK_SIZE = 4
WORLD = 4
#: Each step: sequence -> how many new tokens (prefill in two chunks for sequence 0, which
#: passes the windows of 6 positions, then decode of both).
STEPS = ({0: 7, 1: 5}, {0: 4, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1})
#: Relative tolerance on the logits (float32; the shards sum in another order).
RTOL = 1e-5


def _configs() -> dict[str, object]:
    import transformers

    small = dict(hidden_size=64, num_hidden_layers=2, max_position_embeddings=64,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama": transformers.LlamaConfig(
            **small, vocab_size=302, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=4, attention_bias=True, mlp_bias=True),
        "llama_gqa": transformers.LlamaConfig(
            **small, vocab_size=300, intermediate_size=100, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(
            **small, vocab_size=300, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, attention_bias=True, use_sliding_window=True,
            sliding_window=6, max_window_layers=1),
        "gemma2": transformers.Gemma2Config(
            **small, vocab_size=300, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
            attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
        "phi3": transformers.Phi3Config(
            **{**small, "hidden_size": 128}, vocab_size=300, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=1, original_max_position_embeddings=64),
    }


#: (checkpoint, tensor_parallel_size) of each sharded run.
RUNS = (("llama", 2), ("llama", 4), ("llama_gqa", 4), ("qwen3", 2), ("gemma2", 2), ("phi3", 2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return {name: write_checkpoint(str(root / name), config,
                                   norm_center=0.0 if name == "gemma2" else 1.0)
            for name, config in _configs().items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def _run_steps(model: DecoderForCausalLM, vocab_size: int) -> list[torch.Tensor]:
    """The logits of every token of `STEPS` on a NaN-filled paged cache of the model's KV heads
    with random block tables (the same on every rank: fixed seeds)."""
    rng = random.Random(0)
    c = model.config
    max_blocks = -(-sum(s[0] for s in STEPS) // BLOCK_SIZE)
    num_blocks = 4 * max_blocks
    ids = rng.sample(range(num_blocks), 2 * max_blocks)
    tables = torch.tensor(ids, dtype=torch.int32).view(2, max_blocks)
    shape = (num_blocks, model.num_local_kv_heads, BLOCK_SIZE, c.head_dim)
    caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
              for _ in range(c.num_hidden_layers)]
    lens, out = [0, 0], []
    for step in STEPS:
        tokens, positions, slots, q_lens = [], [], [], []
        for s, n in step.items():
            for pos in range(lens[s], lens[s] + n):
                tokens.append(rng.randrange(3, vocab_size))
                positions.append(pos)
                slots.append(int(tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            lens[s] += n
            q_lens.append(n)
        cu = (None if all(n == 1 for n in q_lens) else
              torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32))
        meta = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(lens, dtype=torch.int32),
                                 cu)
        hidden = model(torch.tensor(tokens), torch.tensor(positions), caches, meta)
        out.append(model.compute_logits(hidden))
    return out


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, object]:
    got_all, want_all = torch.cat(got), torch.cat(want)
    return {"shape_ok": got_all.shape == want_all.shape,
            "rel_err": float((got_all - want_all).abs().max() / want_all.abs().max()),
            "argmax_equal": bool(torch.equal(got_all.argmax(-1), want_all.argmax(-1)))}


def _rank(rank: int, port: int, paths: dict[str, str]) -> dict[str, dict[str, object]]:
    """Runs every case of `RUNS` as rank `rank` of `WORLD`; rank 0 returns each case's
    comparison with the unsharded model (the other ranks an empty dict)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        groups = {WORLD: None, 2: dist.new_group([0, 1])}  # every rank creates every group
        results, references = {}, {}
        for name, size in RUNS:
            if rank >= size:
                continue
            loaded = load_model(paths[name], dtype=torch.float32,
                                tp=TensorParallel(rank, size, groups[size]))
            got = _run_steps(loaded.model, loaded.config.vocab_size)
            if rank == 0:
                if name not in references:
                    ref = load_model(paths[name], dtype=torch.float32, tp=SINGLE)
                    references[name] = _run_steps(ref.model, ref.config.vocab_size)
                results[f"{name}-tp{size}"] = _compare(got, references[name])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


def _worker(index: int, port: int, paths: dict[str, str]) -> None:
    """A spawned rank (1 .. WORLD-1); rank 0 is the test's own process."""
    torch.set_num_threads(1)
    _rank(index + 1, port, paths)


@pytest.fixture(scope="module")
def tp_results(checkpoints) -> dict[str, dict[str, object]]:
    """Rank 0 runs in this process (one interpreter fewer to start), ranks 1-3 are spawned."""
    import torch.multiprocessing as mp

    port = _free_port()
    workers = mp.start_processes(_worker, args=(port, checkpoints), nprocs=WORLD - 1,
                                 start_method="spawn", join=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = _rank(0, port, checkpoints)
        while not workers.join():
            pass
    finally:
        torch.set_num_threads(threads)
        for process in workers.processes:
            process.kill()
            process.join()
    return results


@pytest.mark.parametrize("name,size", RUNS, ids=[f"{n}-tp{s}" for n, s in RUNS])
def test_shard_logits_equal_unsharded(tp_results, name, size):
    result = tp_results[f"{name}-tp{size}"]
    assert result["shape_ok"], "logits are not [tokens, vocab_size]"
    assert result["rel_err"] < RTOL, f"max |Δlogits| / max |logits| = {result['rel_err']:.2e}"
    assert result["argmax_equal"], "a greedy choice differs from the unsharded model's"


def _config(heads: int, kv_heads: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=8)


@pytest.mark.parametrize("heads,kv_heads,size", [(9, 3, 2), (9, 3, 6), (8, 4, 3), (8, 2, 3)])
def test_heads_that_do_not_split_are_refused(heads, kv_heads, size):
    config = _config(heads, kv_heads)
    match = (f"tensor_parallel_size: expected a divisor of num_attention_heads={heads} .*"
             f"num_key_value_heads={kv_heads}.* got {size}")
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(config, size)
    with pytest.raises(ValueError, match=match):
        DecoderForCausalLM(config, tp=TensorParallel(0, size))


@pytest.mark.parametrize("heads,kv_heads,size", [(9, 3, 3), (8, 2, 4), (8, 2, 8), (8, 8, 2)])
def test_heads_that_split_are_accepted(heads, kv_heads, size):
    check_tensor_parallel(_config(heads, kv_heads), size)
    model = DecoderForCausalLM(_config(heads, kv_heads), tp=TensorParallel(size - 1, size))
    assert model.num_local_heads == heads // size
    assert model.num_local_kv_heads == max(1, kv_heads // size)


def test_a_loaded_shard_holds_only_its_share(checkpoints):
    """Rank 1 of 4 of the Llama checkpoint: each projection has its share of rows or columns,
    and the shard's bytes are the replicated embedding and norms plus a quarter of the rest."""
    full = load_model(checkpoints["llama"], dtype=torch.float32).model
    shard = load_model(checkpoints["llama"], dtype=torch.float32,
                       tp=TensorParallel(1, 4)).model
    c = full.config
    d, h = c.head_dim, c.hidden_size
    layer = shard.layers[0]
    want = {"qkv_proj": (3 * d, h), "qkv_bias": (3 * d,), "o_proj": (h, d), "o_bias": (h,),
            "gate_up_proj": (2 * 24, h), "gate_up_bias": (2 * 24,), "down_proj": (h, 24),
            "down_bias": (h,)}
    for name, shape in want.items():
        assert tuple(getattr(layer, name).shape) == shape, name
    assert tuple(shard.lm_head.shape) == (76, h)  # ceil(302 / 4) rows
    assert tuple(shard.embed_tokens.shape) == (302, h)

    def nbytes(model: DecoderForCausalLM) -> int:
        return sum(t.numel() * t.element_size() for t in _weights(model))

    replicated = sum(t.numel() * 4 for t in [full.embed_tokens, full.norm]) + sum(
        t.numel() * 4 for lay in full.layers for t in
        (lay.input_layernorm, lay.post_attention_layernorm, lay.o_bias, lay.down_bias))
    assert nbytes(shard) <= replicated + (nbytes(full) - replicated) / 4 + 2 * h * 4


def _weights(model: DecoderForCausalLM) -> list[torch.Tensor]:
    """Every weight tensor of `model`, packed ones included (they are not Parameters)."""
    names = ("qkv_proj", "qkv_bias", "o_proj", "o_bias", "gate_up_proj", "gate_up_bias",
             "down_proj", "down_bias", "input_layernorm", "post_attention_layernorm")
    tensors = [model.embed_tokens, model.norm, model.lm_head]
    tensors += [getattr(layer, n) for layer in model.layers for n in names
                if getattr(layer, n) is not None]
    return [t.to_dense() if t.is_mkldnn else t for t in tensors]


def test_kv_scales_from_the_file_are_cut_to_the_shard():
    config = _config(8, 4)
    model = DecoderForCausalLM(config, tp=TensorParallel(1, 2))
    weights = {n: torch.zeros(s) for n, s in model.checkpoint_shapes().items()}
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    model.load_weights(weights.items())
    (k_scale, v_scale), = model.kv_scales_from_file
    assert k_scale.tolist() == [3.0, 4.0] and v_scale.tolist() == [0.5]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_blocks_of_a_shard_match_its_dense_weights(qtype):
    """Rank 1 of 2 of a small model whose projections are GGUF blocks (written with the `gguf`
    package's own quantizer): each projection's blocks are the rank's rows (column-parallel) or
    32-column blocks (row-parallel) of the file's, so multiplying by them equals multiplying by
    the rank's dense shard of the dequantised weights. A column range off the 32-column blocks
    has no blocks (that projection stays dense)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from engine.model.quant import GGUFBlocks, QuantizedWeight, attach_gguf_weights
    from engine.model.quant import quantized_linear

    kind = GGMLQuantizationType[qtype]
    config = DecoderConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32)
    model = DecoderForCausalLM(config, tp=TensorParallel(1, 2))
    g = torch.Generator().manual_seed(0)
    dense, blocks = {}, []
    for name, shape in model.checkpoint_shapes().items():
        w = torch.randn(shape, generator=g)
        if len(shape) == 2 and name != "model.embed_tokens.weight":
            q = quantize(w.numpy(), kind)
            blocks.append((name, GGUFBlocks(qtype, torch.from_numpy(q), shape[1])))
            w = torch.from_numpy(dequantize(q, kind).copy()).reshape(shape)
        dense[name] = w
    model.load_weights(dense.items())
    converted = attach_gguf_weights(model, iter(blocks))
    assert converted == ["layers.0.qkv_proj", "layers.0.o_proj", "layers.0.gate_up_proj",
                         "layers.0.down_proj", "lm_head"]
    layer = model.layers[0]
    for weight in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj,
                   model.lm_head):
        assert isinstance(weight, QuantizedWeight)
        x = torch.randn(3, weight.shape[1], generator=g)
        torch.testing.assert_close(quantized_linear(x, weight.blocks), x @ weight.dense.T,
                                   rtol=1e-5, atol=1e-5)
    assert tuple(layer.o_proj.shape) == (64, 64) and tuple(layer.down_proj.shape) == (64, 64)
    assert take_blocks(layer.o_proj.blocks, (1, ((0, 48),))) is None
