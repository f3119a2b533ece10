"""The OpenAI-compatible server behind `python -m engine.serve`.

Modules: `protocol` (request models), `errors` (OpenAI's error JSON), `middleware` (API key, body
limit), `async_engine` (the engine loop thread and per-request streams), `responses` (response
and chunk JSON), `metrics` (Prometheus, vLLM's names), `app` (the routes).
"""
