"""Per-request bounds the server enforces before any heavy work, set by `engine.serve` flags.

OpenAI allows 4 stop strings; vLLM sets no bound. The defaults here keep every client that
follows OpenAI's or vLLM's usual practice working while bounding what one request can cost.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: Default most `stop` strings per request.
DEFAULT_MAX_STOP_STRINGS = 64
#: Default most characters per `stop` string.
DEFAULT_MAX_STOP_STRING_LENGTH = 256


@dataclass(frozen=True)
class ServerLimits:
    """`max_stop_strings`: most `stop` strings a request may give; `max_stop_string_length`:
    most characters in one of them. A request beyond either is a 400 naming `stop`."""

    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `engine.serve` flags of `ServerLimits`."""
    parser.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        help="most stop strings per request (400 beyond; default "
                             f"{DEFAULT_MAX_STOP_STRINGS}; OpenAI allows 4)")
    parser.add_argument("--max-stop-string-length", type=int,
                        default=DEFAULT_MAX_STOP_STRING_LENGTH,
                        help="most characters per stop string (400 beyond; default "
                             f"{DEFAULT_MAX_STOP_STRING_LENGTH})")


def from_args(args: argparse.Namespace) -> ServerLimits:
    """The limits the parsed flags give; ValueError naming the flag's field when one is < 1."""
    return ServerLimits(max_stop_strings=args.max_stop_strings,
                        max_stop_string_length=args.max_stop_string_length)
