"""Who may use the server (engine/server/access.py): the API key's sources, the Host header
allow list against DNS rebinding, CORS, and the warning for a non-loopback bind without a key.

The servers get a model file that does not exist: access is decided before any route runs, so
they answer at once and cost no CPU (a request that passes the guard gets the route's 503
"failed to load" instead of a 401 or 400).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
from serve_process import REPO, ServerProcess

from engine.serve import build_parser
from engine.server import access

KEY = "sk-test-from-file-123"
NO_MODEL = ("--model", "/nonexistent/missing.gguf")
APP_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """On loopback, the key from a file, CORS for APP_ORIGIN."""
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY + "\n")
    proc = ServerProcess(*NO_MODEL, "--api-key-file", str(key_file),
                         "--allowed-origins", APP_ORIGIN,
                         env={"ENGINE_API_KEY": "", "VLLM_API_KEY": "unused"})
    # $ENGINE_API_KEY is set but empty: the file is given, so the environment is not read
    proc.start(until_ready=False)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def open_bind():
    """Bound to every interface, no key, no CORS flags."""
    env = {k: v for k, v in os.environ.items() if k not in access.API_KEY_ENVS}
    proc = ServerProcess(*NO_MODEL, host="0.0.0.0")
    proc.env = {**env, "PYTHONUNBUFFERED": "1"}
    proc.start(until_ready=False)
    yield proc
    proc.stop()


def _settings(argv: list[str], environ: dict[str, str]) -> access.AccessSettings:
    return access.from_args(build_parser().parse_args(argv), environ)


def test_an_empty_api_key_is_refused_at_start():
    env = {k: v for k, v in os.environ.items() if k not in access.API_KEY_ENVS}
    proc = subprocess.run([sys.executable, "-m", "engine.serve", "--api-key", "", *NO_MODEL,
                           "--port", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--api-key: expected a non-empty API key" in proc.stderr


@pytest.mark.parametrize("argv, environ, where", [
    (["--api-key-file", "EMPTY"], {}, "--api-key-file"),
    ([], {"ENGINE_API_KEY": ""}, "$ENGINE_API_KEY"),
    ([], {"VLLM_API_KEY": ""}, "$VLLM_API_KEY"),
    (["--api-key", "two words"], {}, "--api-key"),
    (["--api-key-file", "/nonexistent/key"], {}, "--api-key-file"),
    (["--allow-credentials"], {}, "--allow-credentials"),
])
def test_bad_keys_and_flags_name_their_source(argv, environ, where, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    with pytest.raises(ValueError) as info:
        _settings(argv, environ)
    assert str(info.value).startswith(where + ":"), info.value


def test_key_sources_in_order(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    both = {"ENGINE_API_KEY": "engine", "VLLM_API_KEY": "vllm"}
    assert _settings(["--api-key", "flag"], both).api_key == "flag"
    assert _settings(["--api-key-file", str(key_file)], both).api_key == "from-file"
    assert _settings([], both).api_key == "engine"
    assert _settings([], {"VLLM_API_KEY": "vllm"}).key_source == "$VLLM_API_KEY"
    assert _settings([], {}).api_key is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--api-key", "a", "--api-key-file", str(key_file)])


def test_host_allow_list_rules():
    loop = access.default_allowed_hosts("127.0.0.1")
    assert access.host_allowed(loop, "localhost:8000") and access.host_allowed(loop, "[::1]:80")
    assert access.host_allowed(loop, "127.0.0.1") and access.host_allowed(loop, "LOCALHOST")
    assert not access.host_allowed(loop, "rebind.attacker.example:8000")
    assert access.default_allowed_hosts("0.0.0.0") is None
    assert access.default_allowed_hosts("::") is None
    listed = _settings(["--allowed-hosts", "api.example.com,*.corp.example"], {}).allowed_hosts
    assert access.host_allowed(listed, "api.example.com:443")
    assert access.host_allowed(listed, "a.b.corp.example")
    assert not access.host_allowed(listed, "corp.example.evil") and not access.host_allowed(
        listed, "localhost")
    assert _settings(["--allowed-hosts", '["*"]'], {}).allowed_hosts is None


def test_key_from_a_file_stays_out_of_the_process_list(keyed):
    with open(f"/proc/{keyed.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    bad = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:  # past the guard: model missing
        good.models.list()
    assert info.value.status_code == 503
    log = keyed.log_text()
    assert "API key required, from --api-key-file" in log and KEY not in log


@pytest.mark.parametrize("host", ["rebind.attacker.example", "rebind.attacker.example:80",
                                  "10.0.0.1"])
def test_a_foreign_host_header_gets_400_on_loopback(keyed, host):
    r = httpx.get(f"{keyed.base_url}/v1/models",
                  headers={"Host": host, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and "--allowed-hosts" in err["message"]
    for ok in (f"localhost:{keyed.port}", f"127.0.0.1:{keyed.port}"):
        r = httpx.get(f"{keyed.base_url}/v1/models",
                      headers={"Host": ok, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503  # passed the guard


def test_cors_for_the_allowed_origin_only(keyed):
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{keyed.base_url}/v1/completions", headers=preflight)
    assert r.status_code == 200  # a preflight carries no key
    assert r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.get(f"{keyed.base_url}/v1/models",
                  headers={"Origin": APP_ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.options(f"{keyed.base_url}/v1/completions",
                      headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_non_loopback_bind_without_key_warns_allows_any_host_and_no_cors(open_bind):
    log = open_bind.log_text()
    assert "WARNING" in log and "not a loopback address, without an API key" in log
    r = httpx.get(f"{open_bind.base_url}/openapi.json",
                  headers={"Host": "my-server.lan:8000", "Origin": APP_ORIGIN})
    assert r.status_code == 200
    assert not any(h.startswith("access-control-") for h in r.headers)
    r = httpx.options(f"{open_bind.base_url}/v1/completions",
                      headers={"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
