"""`python -m engine.serve`'s command line (no server started): every flag of issue 7 exists
and maps onto the engine's config, sizes parse, bad values are refused by argparse."""

from __future__ import annotations

import argparse

import pytest

from engine.serve import build_parser, check_args, engine_builder, parse_size, served_names


def test_every_issue_flag_parses():
    args = build_parser().parse_args([
        "--model", "/m/model.gguf", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--dtype", "float32", "--backend", "reference", "--block-size", "32",
        "--num-kv-blocks", "100", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--max-model-len", "1024", "--no-enable-prefix-caching", "--preemption-mode", "swap",
        "--max-queue", "4", "--log-level", "debug", "--max-request-bytes", "1MiB"])
    assert (args.model, args.host, args.port, args.api_key) == ("/m/model.gguf", "0.0.0.0",
                                                                9000, "k")
    assert (args.dtype, args.backend, args.block_size, args.num_kv_blocks) == (
        "float32", "reference", 32, 100)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (8, 512, 1024)
    assert args.enable_prefix_caching is False and args.preemption_mode == "swap"
    assert (args.max_queue, args.log_level, args.max_request_bytes) == (4, "debug", 1 << 20)


def test_defaults():
    args = build_parser().parse_args([])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000
    assert args.dtype == "auto" and args.enable_prefix_caching is True
    assert args.kv_cache_memory is None and args.num_kv_blocks is None


@pytest.mark.parametrize("text, expected", [("1048576", 1 << 20), ("512MiB", 512 << 20),
                                             ("2G", 2 << 30), ("1.5k", 1536), ("64kb", 65536)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-5M"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        parse_size(text)


@pytest.mark.parametrize("argv", [["--block-size", "0"], ["--max-num-seqs", "-1"],
                                  ["--num-kv-blocks", "10", "--kv-cache-memory", "1G"],
                                  ["--dtype", "int8"], ["--preemption-mode", "never"],
                                  ["--kv-allocation", "reserve"]])
def test_bad_flags_exit(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "error" in capsys.readouterr().err


def built_config(argv: list[str], monkeypatch: pytest.MonkeyPatch):
    """The EngineConfig that `engine_builder` passes to LLMEngine for the command line `argv`
    (no model is loaded)."""
    import engine.llm_engine
    import engine.serve

    built = []
    monkeypatch.setattr(engine.llm_engine, "LLMEngine",
                        lambda model, dtype, config, device: built.append(config) or config)
    monkeypatch.setattr(engine.serve, "_log_engine", lambda engine: None)
    engine_builder(build_parser().parse_args(argv))()
    return built[0]


@pytest.mark.parametrize("argv, policy", [([], "paged"),
                                          (["--kv-allocation", "reserve-pow2"], "reserve-pow2")])
def test_kv_allocation_reaches_the_engine_config(argv, policy, monkeypatch):
    assert built_config(argv, monkeypatch).kv_allocation == policy


@pytest.mark.parametrize("argv, cache_dtype, calibrate", [
    ([], "auto", True),
    (["--kv-cache-dtype", "fp8"], "fp8", True),
    (["--kv-cache-dtype", "int8", "--no-calculate-kv-scales"], "int8", False)])
def test_kv_cache_dtype_reaches_the_engine_config(argv, cache_dtype, calibrate, monkeypatch):
    config = built_config(argv, monkeypatch)
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == (cache_dtype, calibrate)


@pytest.mark.parametrize("argv, prefault", [([], True), (["--no-prefault-kv-cache"], False)])
def test_prefault_kv_cache_reaches_the_engine_config(argv, prefault, monkeypatch):
    assert built_config(argv, monkeypatch).prefault_kv_cache is prefault


def test_kv_cache_dtype_rejects_an_unknown_name(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_served_names():
    assert served_names(None, None) == ["SmolLM2-135M-Instruct"]
    assert served_names("/x/tiny.gguf", None) == ["tiny", "/x/tiny.gguf"]
    assert served_names("/x/hf_dir/", "mine") == ["mine", "hf_dir", "/x/hf_dir/"]


def test_connection_shutdown_and_access_flags_parse(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    args = build_parser().parse_args([
        "--limit-concurrency", "64", "--timeout-keep-alive", "2", "--timeout-header-read", "3",
        "--timeout-body-read", "4.5", "--shutdown-timeout", "0", "--api-key-file", str(key_file),
        "--allowed-hosts", "api.example.com,localhost", "--allowed-origins", '["http://a.b"]',
        "--allowed-methods", "GET,POST", "--allow-credentials"])
    _, conn, who, _ = check_args(args)
    assert (conn.limit_concurrency, conn.timeout_keep_alive, conn.timeout_header_read,
            conn.timeout_body_read) == (64, 2.0, 3.0, 4.5)
    assert args.shutdown_timeout == 0.0 and who.api_key == "k3y"
    assert who.allowed_hosts == {"api.example.com", "localhost"}
    assert who.cors.allowed_origins == ["http://a.b"] and who.cors.allowed_methods == [
        "GET", "POST"] and who.cors.allowed_headers == ["*"] and who.cors.allow_credentials


@pytest.mark.parametrize("argv, flag", [(["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                                        (["--limit-concurrency", "0"], "--limit-concurrency"),
                                        (["--timeout-header-read", "0"], "--timeout-header-read"),
                                        (["--api-key", ""], "--api-key"),
                                        (["--allowed-headers", "x"], "--allowed-headers")])
def test_bad_connection_shutdown_and_access_values_exit_naming_the_flag(argv, flag, capsys,
                                                                       monkeypatch):
    for name in ("ENGINE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        check_args(build_parser().parse_args(argv))
    assert f"error: {flag}:" in capsys.readouterr().err


# ------------------------------------------------ --device, --chat-template, --tool-call-parser
def test_model_option_flags(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    args = build_parser().parse_args(["--device", "cpu", "--chat-template", str(path),
                                      "--tool-call-parser", "llama3_json"])
    *_, options = check_args(args)
    assert (options.device, options.chat_template, options.tool_call_parser) == (
        "cpu", template, "llama3_json")
    *_, inline = check_args(build_parser().parse_args(["--chat-template", template]))
    assert inline.chat_template == template
    *_, default = check_args(build_parser().parse_args([]))
    assert (default.device, default.chat_template, default.tool_call_parser) == (
        "cpu", None, "hermes")


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--device", "cuda:7"],
                                  ["--chat-template", "no-such-file.jinja"],
                                  ["--chat-template", "{% for m in messages %}"]])
def test_bad_model_options_exit_naming_the_flag(argv, capsys):
    import torch

    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(SystemExit):
        check_args(build_parser().parse_args(argv))
    assert f"error: {argv[0]}:" in capsys.readouterr().err


def test_engine_builder_puts_the_chat_template_in_place(tmp_path):
    import transformers

    from engine.server.model_options import ModelOptions
    from family_case import write_checkpoint

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      max_position_embeddings=64)
    path = write_checkpoint(str(tmp_path), config)
    args = build_parser().parse_args(["--model", path, "--dtype", "float32",
                                      "--num-kv-blocks", "8"])
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    engine = engine_builder(args, ModelOptions(chat_template=template))()
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=False) == "[hi]"
    assert engine.device.type == "cpu"
