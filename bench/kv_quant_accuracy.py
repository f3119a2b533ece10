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

Both are computed twice: on the engine's logits (the output head in bfloat16, so logits are
rounded to bfloat16, 0.0625-0.125 apart at typical magnitudes, and the top two of a position
can tie) and on float32 logits from the same final hidden states (tied head only). The share of
positions whose bfloat16 top two are within 0.1 nats, and the agreement of the bfloat16 cache
on another backend (`--floor-backend`: the same cache dtype, only the summation order
differs), say how much of the disagreement is near-ties.

    python -m bench.kv_quant_accuracy --tokens 128 --out kv_quant_accuracy.json

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

from bench.quant_accuracy import PROMPTS as _SHORT_PROMPTS

#: A fixed, varied set: bench.quant_accuracy's prompts and twelve more.
PROMPTS = _SHORT_PROMPTS + [
    "The mitochondria is the powerhouse of", "Translate to French: Good morning, my friend.",
    "Q: What is 17 times 3?\nA:", "My favourite recipe for pancakes starts with",
    "The Pythagorean theorem states that", "Dear hiring manager, I am writing to apply for",
    "Here is a short story about a robot who learns to paint:",
    "class Stack:\n    def __init__(self):", "The main causes of the French Revolution were",
    "Summarize: The cat sat on the mat all afternoon, watching the birds outside.",
    "SELECT name, age FROM users WHERE", "Three tips for better sleep are"]
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
                            ) -> dict[str, torch.Tensor]:
    """float64 next-token log-probabilities `[num_prompts, tokens, vocab]`: row t of prompt i
    predicts `continuations[i][t]` from the prompt and the continuation's first t tokens, read
    from a cache of `kv_cache_dtype` (prefill of every prompt in one step, then one decode step
    per continuation token). Under "engine" from the model's logits, under "float32_head" (tied
    output head only) from float32 logits of the same hidden states."""
    per_seq = _blocks_per_seq(prompts, len(continuations[0]))
    llm = LLM(model=loaded, num_kv_blocks=per_seq * len(prompts), kv_cache_dtype=kv_cache_dtype,
              block_size=BLOCK_SIZE, backend=backend)
    cache, model = llm.llm_engine.kv_cache, loaded.model
    tables = torch.arange(per_seq * len(prompts), dtype=torch.int32).view(len(prompts), per_seq)
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    head = loaded.model.embed_tokens.float() if loaded.config.tie_word_embeddings else None
    rows: dict[str, list[torch.Tensor]] = {"engine": [], "float32_head": []}
    for t in range(len(continuations[0])):
        q_lens = lens if t == 0 else [1] * len(prompts)
        starts = [0] * len(prompts) if t == 0 else [n + t - 1 for n in lens]
        positions, meta = _meta(tables, starts, q_lens, backend)
        hidden = model(ids, positions, cache.device_caches, meta, cache.scales)
        last = torch.tensor(q_lens).cumsum(0) - 1
        rows["engine"].append(model.compute_logits(hidden[last]).double().log_softmax(-1))
        if head is not None:
            logits = torch.nn.functional.linear(hidden[last].float(), head)
            rows["float32_head"].append(logits.double().log_softmax(-1))
        ids = torch.tensor([c[t] for c in continuations])
    return {k: torch.stack(v, dim=1) for k, v in rows.items() if v}


def compare(got: torch.Tensor, want: torch.Tensor, continuations: list[list[int]]
            ) -> dict[str, Any]:
    """Top-1 agreement and |log-prob gap| of `got` against `want` (both `[P, T, vocab]`), and
    the median top-2 margin of `want` where they disagree."""
    tokens = torch.tensor(continuations).unsqueeze(-1)
    gap = (got.gather(-1, tokens) - want.gather(-1, tokens)).abs().squeeze(-1)
    agree = got.argmax(-1) == want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    return {"top1_agreement": agree.double().mean().item(),
            "top1_agreement_per_prompt": agree.double().mean(-1).tolist(),
            "mean_abs_logprob_gap": gap.mean().item(), "max_abs_logprob_gap": gap.max().item(),
            "median_margin_where_disagree": (margin[~agree].median().item() if (~agree).any()
                                             else None),
            "positions": int(agree.numel())}


def near_tie_share(want: torch.Tensor, nats: float = 0.1) -> float:
    """The share of positions whose top two log-probabilities are within `nats`."""
    top2 = want.topk(2, dim=-1).values
    return ((top2[..., 0] - top2[..., 1]) < nats).double().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dtypes", nargs="+", default=list(CACHE_DTYPES))
    p.add_argument("--tokens", type=int, default=128, help="continuation tokens per prompt")
    p.add_argument("--backend", default="auto")
    p.add_argument("--floor-backend", default="reference",
                   help="also the bfloat16 cache on this backend ('' to skip)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(None, dtype=torch.bfloat16)
    prompts = [loaded.tokenizer.encode(t) for t in PROMPTS]
    continuations = greedy_continuations(loaded, prompts, args.tokens)
    want = teacher_forced_logprobs(loaded, "auto", prompts, continuations, args.backend)
    runs = [(name, args.backend) for name in args.cache_dtypes]
    if args.floor_backend:
        runs.insert(0, ("auto", args.floor_backend))
    ties = {k: near_tie_share(w) for k, w in want.items()}
    print(f"{len(prompts)} prompts x {args.tokens} tokens; bfloat16 top two within 0.1 nats: "
          + ", ".join(f"{100 * v:.1f} % ({k} logits)" for k, v in ties.items()))
    print("| cache dtype | backend | logits | top-1 agreement | mean abs log-prob gap (nats) | "
          "largest gap | median bf16 margin where they disagree |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, backend in runs:
        got = teacher_forced_logprobs(loaded, name, prompts, continuations, backend)
        for logits in got:
            row = {"kv_cache_dtype": name, "backend": backend, "logits": logits,
                   **compare(got[logits], want[logits], continuations)}
            rows.append(row)
            margin = row["median_margin_where_disagree"]
            print(f"| {name} | {backend} | {logits} | {100 * row['top1_agreement']:.2f} % | "
                  f"{row['mean_abs_logprob_gap']:.4f} | {row['max_abs_logprob_gap']:.3f} | "
                  f"{'-' if margin is None else f'{margin:.3f}'} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "model_dtype": "bfloat16", "backend": args.backend,
                       "tokens": args.tokens, "prompts": PROMPTS, "near_tie_share": ties,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
