"""Hugging Face-style chat templates, rendered with sandboxed jinja2.

Templates see what transformers gives them: `trim_blocks` and `lstrip_blocks` on, the
`loopcontrols` extension, `raise_exception` (a ValueError naming `messages`), `strftime_now` and a
`tojson` filter that does not escape HTML. A template is compiled once per process.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Optional

_TEMPLATE_CACHE: dict[str, Any] = {}


def _raise_exception(message: str) -> None:
    raise ValueError(f"messages: rejected by the chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # unlike jinja's own filter, no HTML escaping: templates emit raw JSON into prompts
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compiled(template: str) -> Any:
    """`template` compiled in the sandbox (cached by its text)."""
    if template not in _TEMPLATE_CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _TEMPLATE_CACHE[template] = env.from_string(template)
    return _TEMPLATE_CACHE[template]


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Renders a Hugging Face-style chat template (sandboxed jinja2, `trim_blocks` and
    `lstrip_blocks` on, `raise_exception` / `strftime_now` / a non-escaping `tojson`).
    ValueError when `messages` is not a list of dicts with a "role", or the template rejects
    them through `raise_exception`."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"messages: expected a list of dicts with 'role' and 'content', got "
                         f"{messages!r:.200}")
    return _compiled(template).render(messages=messages,
                                      add_generation_prompt=add_generation_prompt, **variables)
