"""How close an 8-bit KV cache keeps the default model to the bfloat16 cache, teacher-forced.

The model runs in bfloat16 on the engine's own KV cache and attention (`LLM(kv_cache_dtype=...)`,
the same loaded model for every cache dtype). Each prompt's continuation is fixed first: the
greedy tokens of the bfloat16 cache. Then, for every cache dtype, all prompts are prefilled in
one step (which calibrates the scales: engine/kv_scales.py) and the continuations are fed one
token per decode step, every step reading the cache written so far; at each position the
next-token log-probabilities are compared with the bfloat16 cache's:

- top-1 agreement: the fraction of positions where both caches pick the same next token;
- mean |log-prob gap|: mean over positions of |log p(t) - log p_bf16(t)|, t the continuation's
  token (nats), and the largest such gap.

    python -m bench.kv_quant_accuracy --tokens 64 --out kv_quant_accuracy.json

Runs on one thread.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.model.loader import LoadedModel, load_model
from engine.model.metadata import AttentionMetadata

from bench.quant_accuracy import PROMPTS

CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
BLOCK_SIZE = 16


def greedy_continuations(loaded: LoadedModel, prompts: list[list[int]], tokens: int
                         ) -> list[list[int]]:
    """The bfloat16 cache's greedy continuation (exactly `tokens` ids) of each prompt."""
    llm = LLM(model=loaded, num_kv_blocks=_blocks_per_seq(prompts, tokens) * len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _blocks_per_seq(prompts: list[list[int]], tokens: int) -> int:
    return -(-(max(map(len, prompts)) + tokens) // BLOCK_SIZE)


def _meta(block_tables: torch.Tensor, starts: list[int], q_lens: list[int], backend: str
          ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of one step: sequence i computes `q_lens[i]` tokens from position
    `starts[i]`, in its blocks `block_tables[i]` (consecutive slots)."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    blocks = block_tables[seq_of, positions // BLOCK_SIZE].long()
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    decode = all(n == 1 for n in q_lens)
    meta = AttentionMetadata(
        slot_mapping=blocks * BLOCK_SIZE + positions % BLOCK_SIZE, block_tables=block_tables,
        seq_lens=torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32),
        cu_seqlens_q=None if decode else cu, backend=backend)
    return positions, meta


@torch.inference_mode()
def teacher_forced_logprobs(loaded: LoadedModel, kv_cache_dtype: str, prompts: list[list[int]],
                            continuations: list[list[int]], backend: str = "auto"
                            ) -> torch.Tensor:
    """float64 next-token log-probabilities `[num_prompts, tokens, vocab]`: row t of prompt i
    predicts `continuations[i][t]` from the prompt and the continuation's first t tokens, read
    from a cache of `kv_cache_dtype` (prefill of every prompt in one step, then one decode step
    per continuation token)."""
    per_seq = _blocks_per_seq(prompts, len(continuations[0]))
    llm = LLM(model=loaded, num_kv_blocks=per_seq * len(prompts), kv_cache_dtype=kv_cache_dtype,
              block_size=BLOCK_SIZE, backend=backend)
    cache, model = llm.llm_engine.kv_cache, loaded.model
    tables = torch.arange(per_seq * len(prompts), dtype=torch.int32).view(len(prompts), per_seq)
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    rows = []
    for t in range(len(continuations[0])):
        q_lens = lens if t == 0 else [1] * len(prompts)
        starts = [0] * len(prompts) if t == 0 else [n + t - 1 for n in lens]
        positions, meta = _meta(tables, starts, q_lens, backend)
        hidden = model(ids, positions, cache.device_caches, meta, cache.scales)
        last = torch.tensor(q_lens).cumsum(0) - 1
        rows.append(model.compute_logits(hidden[last]).double().log_softmax(-1))
        ids = torch.tensor([c[t] for c in continuations])
    return torch.stack(rows, dim=1)


def compare(got: torch.Tensor, want: torch.Tensor, continuations: list[list[int]]
            ) -> dict[str, Any]:
    """Top-1 agreement and |log-prob gap| of `got` against `want` (both `[P, T, vocab]`)."""
    tokens = torch.tensor(continuations).unsqueeze(-1)
    gap = (got.gather(-1, tokens) - want.gather(-1, tokens)).abs().squeeze(-1)
    agree = got.argmax(-1) == want.argmax(-1)
    return {"top1_agreement": agree.double().mean().item(),
            "top1_agreement_per_prompt": agree.double().mean(-1).tolist(),
            "mean_abs_logprob_gap": gap.mean().item(), "max_abs_logprob_gap": gap.max().item(),
            "positions": int(agree.numel())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dtypes", nargs="+", default=list(CACHE_DTYPES))
    p.add_argument("--tokens", type=int, default=64, help="continuation tokens per prompt")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None, dtype=torch.bfloat16)
    prompts = [loaded.tokenizer.encode(t) for t in PROMPTS]
    continuations = greedy_continuations(loaded, prompts, args.tokens)
    want = teacher_forced_logprobs(loaded, "auto", prompts, continuations, args.backend)
    rows = []
    print("| cache dtype | top-1 agreement | mean abs log-prob gap (nats) | largest gap |")
    print("|---|---|---|---|")
    for name in args.cache_dtypes:
        row = {"kv_cache_dtype": name, **compare(
            teacher_forced_logprobs(loaded, name, prompts, continuations, args.backend), want,
            continuations)}
        rows.append(row)
        print(f"| {name} | {100 * row['top1_agreement']:.2f} % | "
              f"{row['mean_abs_logprob_gap']:.4f} | {row['max_abs_logprob_gap']:.3f} |",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "model_dtype": "bfloat16", "backend": args.backend,
                       "tokens": args.tokens, "prompts": PROMPTS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
