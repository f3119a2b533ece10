"""The OpenAI-compatible server behind `python -m engine.serve`.

Modules: `protocol` (request models), `errors` (OpenAI's error JSON), `middleware` (API key, body
limit), `async_engine` (the engine loop thread and per-request streams), `inputs` (a request's
prompt ids and sampling parameters, checked), `streaming` (adding engine requests, merging their
deltas, server-sent events, abort on disconnect), `jobs` (deltas -> response or chunks),
`responses` (response and chunk JSON), `metrics` (Prometheus, vLLM's names), `openapi` (the
served schema), `routes` (the handlers), `app` (the app and its routes).
"""
