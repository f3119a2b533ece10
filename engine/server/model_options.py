"""The server's flags about the model it runs: `--device`, `--chat-template` and
`--tool-call-parser` (vLLM's names), checked before anything loads."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from engine.server.tools import TOOL_CALL_PARSERS

__all__ = ["ModelOptions", "add_arguments", "from_args"]


@dataclass(frozen=True)
class ModelOptions:
    """`device`: where the engine runs ("cpu", "cuda", "cuda:N"); `chat_template`: the Jinja
    text that replaces the model's own (None: keep it); `tool_call_parser`: a name of
    `TOOL_CALL_PARSERS`."""

    device: str = "cpu"
    chat_template: Optional[str] = None
    tool_call_parser: str = "hermes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",
                   help="where the engine runs: cpu, cuda or cuda:N (on a GPU the attention "
                        "backend 'auto' picks a GPU backend)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, used instead of the "
                        "model's")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_CALL_PARSERS),
                   help="how replies to chat requests with tools (tool_choice 'auto') are read "
                        "as tool calls (default: hermes, <tool_call>{...}</tool_call>)")


def from_args(args: argparse.Namespace) -> ModelOptions:
    """The options the flags give; ValueError starting with the flag's name when a value is
    unusable (a device torch cannot use here, a template file that cannot be read, a template
    Jinja cannot parse)."""
    return ModelOptions(check_device(args.device), load_chat_template(args.chat_template),
                        args.tool_call_parser)


def check_device(value: str) -> str:
    """`value` when it names the CPU or a CUDA device this machine has."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {value!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"--device: expected a CUDA device this machine has ({count} "
                             f"visible), got {value!r}")
    return value


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text of `--chat-template`: a file's contents when `value` is a path, else
    `value` itself when it looks like a template (contains "{{" or "{%")."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template: expected a readable UTF-8 file, got {value!r}: "
                             f"{exc}") from exc
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template: expected a file or a Jinja template, got {value!r} "
                         "(no such file, and no '{{' or '{%' in it)")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: expected a Jinja template, got one that does not "
                         f"parse: {exc}") from exc
    return text
