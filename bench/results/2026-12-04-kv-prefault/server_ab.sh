#!/bin/bash
# alternate our server with and without the KV prefault; one c16 run each
for r in 1 2 3; do
  for flag in --prefault-kv-cache --no-prefault-kv-cache; do
    python -m engine.serve --port 8393 --num-threads 2 --max-model-len 512 --max-num-seqs 16 --no-enable-prefix-caching $flag > ${OUT:-/tmp}/serve.log 2>&1 &
    pid=$!
    for i in $(seq 120); do curl -sf localhost:8393/health >/dev/null && break; sleep 1; done
    python -m bench.load_gen --base-url http://127.0.0.1:8393 --concurrency 16 --num-prompts 32 --prompt-len 256 --output-len 128 --seed 11 --output ${OUT:-/tmp}/r${r}${flag}.json > /dev/null 2>&1
    kill $pid; wait $pid 2>/dev/null
    python -c "import json; d=json.load(open('${OUT:-/tmp}/r${r}${flag}.json')); print('$r $flag', round(d['output_throughput_tok_s'],1), round(d['ttft_ms']['p50']), round(d['itl_ms']['p50'],1))"
  done
done
