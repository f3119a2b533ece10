"""Who may use the server, set by `engine.serve` flags: the API key, the Host header allow list
and CORS.

- The API key comes from `--api-key`, `--api-key-file PATH` (kept out of the process list), or
  the environment: `$ENGINE_API_KEY`, else vLLM's `$VLLM_API_KEY`, so a deployment written for
  vLLM keeps its key. An empty key (an unset shell variable, an empty file) is an error, never
  "no key".
- Host allow list (`--allowed-hosts`), against DNS rebinding: a web page on an attacker's
  domain that resolves to 127.0.0.1 reaches a loopback server with its own name in `Host`.
  Default: the loopback names and the bound address when bound to a loopback address, any host
  otherwise. Other hosts get a 400.
- CORS is off unless `--allowed-origins` is given (vLLM's flag names; vLLM turns it on for every
  origin by default, this server for none).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional

#: Environment variables read for the API key, in this order, when no flag gives one.
API_KEY_ENVS = ("ENGINE_API_KEY", "VLLM_API_KEY")
#: The names of the loopback interface a local client may put in `Host`.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class CORSSettings:
    """Starlette's CORSMiddleware arguments."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool


@dataclass(frozen=True)
class AccessSettings:
    """`api_key`: None when no key is required; `key_source`: where it came from (a flag or an
    environment variable's name, for the log); `allowed_hosts`: the Host names accepted (lower
    case, no port; `*.example.com` matches subdomains), None for any; `cors`: None for off."""

    api_key: Optional[str] = None
    key_source: Optional[str] = None
    allowed_hosts: Optional[frozenset[str]] = None
    cors: Optional[CORSSettings] = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `engine.serve` flags of `AccessSettings`."""
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                          "(visible in the process list: prefer --api-key-file or "
                          f"${API_KEY_ENVS[0]}; default: ${API_KEY_ENVS[0]}, else "
                          f"${API_KEY_ENVS[1]}, if set)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the API key from this file (surrounding whitespace dropped)")
    parser.add_argument("--allowed-hosts", type=_string_list, default=None,
                        help="Host header names accepted, comma-separated or a JSON list; '*' "
                             "for any (default: the loopback names when bound to loopback, "
                             "else any)")
    parser.add_argument("--allowed-origins", type=_string_list, default=None,
                        help="turn CORS on for these origins (JSON list or comma-separated; "
                             "'*' for any); default: CORS off")
    parser.add_argument("--allowed-methods", type=_string_list, default=None,
                        help="CORS: methods allowed (default: *)")
    parser.add_argument("--allowed-headers", type=_string_list, default=None,
                        help="CORS: request headers allowed (default: *)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, Authorization)")


def _string_list(text: str) -> list[str]:
    """'a,b' or '["a", "b"]' -> ['a', 'b'] (vLLM takes JSON lists; commas are easier to type)."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r} "
                                             f"({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        items = value
    else:
        items = text.split(",")
    items = [item.strip() for item in items if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected at least one name, got {text!r}")
    return items


def from_args(args: argparse.Namespace,
              environ: Optional[Mapping[str, str]] = None) -> AccessSettings:
    """The settings the parsed flags (and `environ`, default os.environ) give. ValueError
    beginning with the flag or variable at fault when a key is empty or unreadable, or when a
    CORS option is given without `--allowed-origins`."""
    api_key, source = _api_key(args, os.environ if environ is None else environ)
    hosts = args.allowed_hosts
    allowed = default_allowed_hosts(args.host) if hosts is None else _host_set(hosts)
    return AccessSettings(api_key, source, allowed, _cors(args))


def _api_key(args: argparse.Namespace,
             environ: Mapping[str, str]) -> tuple[Optional[str], Optional[str]]:
    if args.api_key is not None:
        return _checked_key(args.api_key, "--api-key"), "--api-key"
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file!r}: {exc}") from None
        return _checked_key(text.strip(), "--api-key-file"), "--api-key-file"
    for name in API_KEY_ENVS:
        if name in environ:
            return _checked_key(environ[name], f"${name}"), f"${name}"
    return None, None


def _checked_key(key: str, where: str) -> str:
    if not key:
        raise ValueError(f"{where}: expected a non-empty API key, got an empty one (an unset "
                         "shell variable or an empty file?); to serve without a key, give "
                         "none")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where}: expected an API key of visible ASCII characters (no spaces "
                         f"or control characters), got one of {len(key)} characters that is "
                         "not")
    return key


def is_loopback(host: str) -> bool:
    """Whether binding `host` (a name or address) serves only this machine."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> Optional[frozenset[str]]:
    """The loopback names and `bind_host` when it is a loopback address; None (any) else."""
    if not is_loopback(bind_host):
        return None
    return LOOPBACK_NAMES | {_host_name(bind_host)}


def _host_set(hosts: list[str]) -> Optional[frozenset[str]]:
    return None if "*" in hosts else frozenset(_host_name(h) for h in hosts)


def _host_name(host: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'; '::1' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def host_allowed(allowed: Optional[frozenset[str]], host_header: Optional[str]) -> bool:
    """Whether a request whose `Host` header is `host_header` may pass. A request without the
    header passes (browsers, which DNS rebinding needs, always send it)."""
    if allowed is None or host_header is None:
        return True
    name = _host_name(host_header)
    if name in allowed:
        return True
    return any(a.startswith("*.") and name.endswith(a[1:]) for a in allowed)


def _cors(args: argparse.Namespace) -> Optional[CORSSettings]:
    if args.allowed_origins is None:
        for flag in ("allowed_methods", "allowed_headers", "allow_credentials"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')}: has no effect without "
                                 "--allowed-origins (CORS is off without it)")
        return None
    return CORSSettings(args.allowed_origins, args.allowed_methods or ["*"],
                        args.allowed_headers or ["*"], args.allow_credentials)


def warnings(settings: AccessSettings, bind_host: str) -> list[str]:
    """What the start-up log should warn about: a non-loopback address without a key."""
    if settings.api_key is None and not is_loopback(bind_host):
        return [f"bound to {bind_host}, which is not a loopback address, without an API key: "
                "anyone who can reach this port can use the model; give a key with "
                f"--api-key-file or ${API_KEY_ENVS[0]}"]
    return []
