"""How far the engine's greedy output stays with transformers' (float32, same GGUF file) for each
weight/activation setting: tokens before the first difference per prompt, and, teacher-forced on
the engine's own tokens, how many nats below its own choice transformers rates each token the
engine picked (0 where they agree; a near-tie where small).

    python -m bench.quant_accuracy --settings float32:gguf float32:gguf-int8 \\
        bfloat16:auto bfloat16:gguf-int8 --tokens 48 --out quant_accuracy.json

Needs `transformers` and `gguf` (the test extras). Runs on one thread.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os

import torch

PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a kind old man who",
           "1, 2, 3,", "def fibonacci(n):", "The three primary colours are", "Water boils at",
           "Explain why the sky is blue.", "Write a haiku about autumn leaves.",
           "List three uses of a paperclip:", "The quick brown fox",
           "In 1969, the first humans", "import numpy as np\n"]


def transformers_model() -> torch.nn.Module:
    """Hugging Face transformers' Llama loaded from the engine's default GGUF file, in float32:
    the engine's independent oracle (also the tests' `hf_default_model`)."""
    import transformers

    from engine.model.loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def transformers_greedy(hf: torch.nn.Module, prompts: list[list[int]], counts: list[int]
                        ) -> list[list[int]]:
    """transformers' greedy continuation (the token ids after the prompt) of each prompt,
    `counts[i]` new tokens for prompt i."""
    outs = []
    for ids, n in zip(prompts, counts, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def engine_tokens(dtype: str, quantization: str, prompts: list[list[int]], n: int
                  ) -> list[list[int]]:
    from engine import LLM, SamplingParams
    from engine.model.loader import load_model

    loaded = load_model(None, dtype=getattr(torch, dtype), quantization=quantization)
    llm = LLM(model=loaded, num_kv_blocks=32 * len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts),
                        use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def gaps(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Per new token: transformers' best log-probability minus that of the engine's token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logp = logits.double().log_softmax(-1)
    picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (logp.max(-1).values - picked).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", default=["float32:gguf", "float32:gguf-int8",
                                                     "bfloat16:auto", "bfloat16:gguf-int8"],
                   help="dtype:quantization pairs")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from engine.model.gguf_reader import gguf_metadata, open_gguf
    from engine.model.loader import default_model_path
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(gguf_metadata(open_gguf(default_model_path())))
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    hf = transformers_model()
    hf_tokens = transformers_greedy(hf, prompts, [args.tokens] * len(prompts))
    rows = []
    print("| dtype | quantization | tokens kept per prompt | whole kept | largest gap (nats) |")
    print("|---|---|---|---|---|")
    for setting in args.settings:
        dtype, quantization = setting.split(":")
        got = engine_tokens(dtype, quantization, prompts, args.tokens)
        kept = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
                for t, r in zip(got, hf_tokens)]
        worst = max(max(gaps(hf, ids, t)) for ids, t in zip(prompts, got))
        rows.append({"dtype": dtype, "quantization": quantization, "kept": kept,
                     "largest_gap_nats": worst})
        print(f"| {dtype} | {quantization} | {', '.join(map(str, kept))} | "
              f"{sum(k == args.tokens for k in kept)} / {len(kept)} | {worst:.3f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "tokens": args.tokens, "prompts": PROMPTS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
